//! Writes `dmi/src/generated/v1beta1.rs` from KubeEdge's `api.proto` with tonic-build, using
//! the protoc binary of `protoc-bin-vendored` (no protoc on the machine needed).

use std::path::PathBuf;

fn main() {
    let dmi = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("codegen lives in dmi/codegen")
        .to_path_buf();
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("a vendored protoc for this platform");
    std::env::set_var("PROTOC", protoc);
    let out = dmi.join("src/generated");
    std::fs::create_dir_all(&out).expect("create dmi/src/generated");
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        .build_transport(true)
        .out_dir(&out)
        .compile_protos(&[dmi.join("proto/api.proto")], &[dmi.join("proto")])
        .expect("compile api.proto");
    println!("wrote {}", out.join("v1beta1.rs").display());
}
