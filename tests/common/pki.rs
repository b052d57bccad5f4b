//! A throw-away PKI made with `openssl` at test time; no certificate is committed.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use super::WAIT;

const SERVER_EXTENSIONS: &str =
    "subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n";

/// How a certificate's private key is made and written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    /// EC P-256, PKCS#8 PEM (`BEGIN PRIVATE KEY`).
    Ec,
    /// RSA 2048, the traditional PKCS#1 PEM (`BEGIN RSA PRIVATE KEY`).
    RsaPkcs1,
}

impl Key {
    fn newkey(self) -> &'static [&'static str] {
        match self {
            Key::Ec => &["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"],
            Key::RsaPkcs1 => &["-newkey", "rsa:2048"],
        }
    }
}

/// A throw-away PKI in its own directory: one CA, a server certificate for `localhost`, and
/// client certificates by common name.
pub struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    /// The CA `ca` and `server.pem` / `server.key` (EC) for `localhost`, signed by it.
    pub fn new() -> Pki {
        Pki::with_server_key(Key::Ec)
    }

    /// Like [`Pki::new`], with the server key made as `key`.
    pub fn with_server_key(key: Key) -> Pki {
        let pki = Pki {
            dir: tempfile::tempdir().expect("temp dir"),
        };
        pki.authority("ca");
        pki.issue_with(key, "server", "localhost", "ca", SERVER_EXTENSIONS);
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
        let (key, pem, subject) = (
            format!("{name}.key"),
            format!("{name}.pem"),
            format!("/CN=edgemeta test {name}"),
        );
        let mut args = vec!["req", "-x509", "-nodes", "-keyout", &key, "-out", &pem];
        args.extend(Key::Ec.newkey());
        args.extend(["-days", "2", "-subj", &subject]);
        args.extend(["-addext", "basicConstraints=critical,CA:TRUE"]);
        args.extend(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]);
        self.openssl(&args);
    }

    /// `<file>.pem` / `<file>.key` (EC) with subject CN `cn`, signed by the CA `<ca>`.
    pub fn issue(&self, file: &str, cn: &str, ca: &str, extensions: &str) {
        self.issue_with(Key::Ec, file, cn, ca, extensions);
    }

    /// [`Pki::issue`] with the key made as `key`.
    pub fn issue_with(&self, key: Key, file: &str, cn: &str, ca: &str, extensions: &str) {
        let name = |ending: &str| format!("{file}.{ending}");
        std::fs::write(self.path(&name("ext")), extensions).expect("extensions");
        // `req` writes PKCS#8; a PKCS#1 key is converted from it.
        let (made, csr, subject) = (name("pk8"), name("csr"), format!("/CN={cn}"));
        let mut args = vec!["req", "-nodes", "-keyout", &made];
        args.extend(key.newkey());
        args.extend(["-out", &csr, "-subj", &subject]);
        self.openssl(&args);
        match key {
            Key::Ec => std::fs::rename(self.path(&made), self.path(&name("key"))).expect("key"),
            Key::RsaPkcs1 => {
                self.openssl(&["rsa", "-in", &made, "-out", &name("key"), "-traditional"])
            }
        }
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &name("pem"),
            "-days",
            "2",
            "-extfile",
            &name("ext"),
        ]);
    }

    /// The node's `extra_listeners` YAML for a server-only TLS listener on `port` with
    /// `server.pem`.
    pub fn listener(&self, port: u16) -> String {
        format!(
            "    mqtts:\n      address: 127.0.0.1:{port}\n      tls:\n        cert_file: {}\n        key_file: {}\n",
            self.path("server.pem").display(),
            self.path("server.key").display(),
        )
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

    /// `mosquitto_pub -h localhost -p <port> -q 1 <args>` over TLS, trusting the CA `trust`, with
    /// the client certificate `cert` (or none). Returns whether it succeeded and its stderr; one
    /// still running after [`WAIT`] is killed and counts as failed.
    pub fn tls_pub(
        &self,
        port: u16,
        trust: &str,
        cert: Option<&str>,
        args: &[&str],
    ) -> (bool, String) {
        let mut command = Command::new("mosquitto_pub");
        command
            .args(["-h", "localhost", "-p", &port.to_string(), "-q", "1"])
            .arg("--cafile")
            .arg(self.path(&format!("{trust}.pem")));
        if let Some(cert) = cert {
            command
                .arg("--cert")
                .arg(self.path(&format!("{cert}.pem")))
                .arg("--key")
                .arg(self.path(&format!("{cert}.key")));
        }
        let mut child = command
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("mosquitto_pub is installed (scripts/test installs it)");
        if super::exit_within(&mut child, WAIT).is_none() {
            let _ = child.kill();
            let _ = child.wait();
            return (false, format!("still running after {WAIT:?}, killed"));
        }
        let out = child.wait_with_output().expect("mosquitto_pub output");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}
