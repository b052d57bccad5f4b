//! A throw-away PKI made with `openssl` at test time; no certificate is committed.

use std::path::PathBuf;
use std::process::Command;

/// A throw-away PKI in its own directory: one CA, a server certificate for `localhost`, and
/// client certificates by common name.
pub struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    pub fn new() -> Pki {
        let pki = Pki {
            dir: tempfile::tempdir().expect("temp dir"),
        };
        pki.authority("ca");
        pki.issue("server", "localhost", "ca", "subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n");
        pki
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    pub fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .expect("openssl is installed");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A self-signed CA `<name>.pem` / `<name>.key`.
    pub fn authority(&self, name: &str) {
        self.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-subj",
            &format!("/CN=edgemeta test {name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ]);
    }

    /// `<file>.pem` / `<file>.key` with subject CN `cn`, signed by the CA `<ca>`.
    pub fn issue(&self, file: &str, cn: &str, ca: &str, extensions: &str) {
        std::fs::write(self.path(&format!("{file}.ext")), extensions).expect("extensions");
        self.openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{file}.key"),
            "-out",
            &format!("{file}.csr"),
            "-subj",
            &format!("/CN={cn}"),
        ]);
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{file}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &format!("{file}.pem"),
            "-days",
            "2",
            "-extfile",
            &format!("{file}.ext"),
        ]);
    }

    /// A client certificate for `cn` signed by `ca`.
    pub fn client(&self, cn: &str, ca: &str) -> String {
        let file = format!("client-{cn}-{ca}");
        self.issue(
            &file,
            cn,
            ca,
            "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n",
        );
        file
    }
}
