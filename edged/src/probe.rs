//! Liveness and readiness probes: exec (exit code 0), HTTP GET (status 200–399) and TCP connect,
//! each bounded by its `timeoutSeconds`.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::plan::ContainerPlan;
use crate::spec::Probe;

/// Runs `probe` once against the container planned as `plan`; `true` is success.
pub async fn check(probe: &Probe, plan: &ContainerPlan, default_host: &str) -> bool {
    let timeout = Duration::from_secs(probe.timeout_seconds.clamp(1, i32::MAX as u64));
    let attempt = async {
        if let Some(exec) = &probe.exec {
            exec_ok(&exec.command, plan).await
        } else if let Some(http) = &probe.http_get {
            let host = http.host.as_deref().unwrap_or(default_host);
            match port(&http.port) {
                Some(port) => http_ok(host, port, &http.path).await,
                None => false,
            }
        } else if let Some(tcp) = &probe.tcp_socket {
            let host = tcp.host.as_deref().unwrap_or(default_host);
            match port(&tcp.port) {
                Some(port) => TcpStream::connect((host, port)).await.is_ok(),
                None => false,
            }
        } else {
            // A probe with no handler cannot fail (Kubernetes would refuse it at admission).
            true
        }
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .unwrap_or(false)
}

/// A numeric port (named ports need a container port list this runtime does not have).
fn port(value: &Value) -> Option<u16> {
    match value {
        Value::Number(n) => n.as_u64().and_then(|p| u16::try_from(p).ok()),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

async fn exec_ok(command: &[String], plan: &ContainerPlan) -> bool {
    let Some((program, args)) = command.split_first() else {
        return false;
    };
    let child = tokio::process::Command::new(program)
        .args(args)
        .env_clear()
        .envs(plan.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&plan.working_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn();
    match child {
        Ok(mut child) => child.wait().await.is_ok_and(|s| s.success()),
        Err(_) => false,
    }
}

async fn http_ok(host: &str, port: u16, path: &str) -> bool {
    let Ok(mut stream) = TcpStream::connect((host, port)).await else {
        return false;
    };
    let path = if path.is_empty() { "/" } else { path };
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: edgemeta-edged-probe\r\nConnection: close\r\n\r\n"
    );
    if stream.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    let mut head = [0u8; 64];
    let mut filled = 0;
    while filled < head.len() {
        match stream.read(&mut head[filled..]).await {
            Ok(0) | Err(_) => break,
            Ok(n) => filled += n,
        }
        if head[..filled].contains(&b'\n') {
            break;
        }
    }
    let line = String::from_utf8_lossy(&head[..filled]);
    line.split_whitespace()
        .nth(1)
        .and_then(|code| code.parse::<u16>().ok())
        .is_some_and(|code| (200..400).contains(&code))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn plan(dir: &std::path::Path) -> ContainerPlan {
        ContainerPlan {
            name: "c".to_owned(),
            argv: Vec::new(),
            env: vec![("PATH".to_owned(), "/usr/bin:/bin".to_owned())],
            working_dir: dir.to_path_buf(),
            log_path: dir.join("c.log"),
            pid_path: dir.join("c.pid"),
            liveness: None,
            readiness: None,
        }
    }

    fn probe(value: Value) -> Probe {
        serde_json::from_value(value).expect("probe parses")
    }

    #[tokio::test]
    async fn exec_probes_pass_on_exit_zero_and_time_out() {
        let dir = tempfile::tempdir().expect("dir");
        let p = plan(dir.path());
        assert!(
            check(
                &probe(json!({"exec": {"command": ["true"]}})),
                &p,
                "127.0.0.1"
            )
            .await
        );
        assert!(
            !check(
                &probe(json!({"exec": {"command": ["false"]}})),
                &p,
                "127.0.0.1"
            )
            .await
        );
        assert!(
            !check(
                &probe(json!({"exec": {"command": ["sleep", "5"]}, "timeoutSeconds": 1})),
                &p,
                "127.0.0.1"
            )
            .await
        );
    }

    #[tokio::test]
    async fn http_probes_read_the_status_code() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            for code in [200, 500] {
                let (mut s, _) = listener.accept().await.expect("accept");
                let mut buf = [0u8; 256];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(format!("HTTP/1.1 {code} X\r\n\r\n").as_bytes())
                    .await;
            }
        });
        let dir = tempfile::tempdir().expect("dir");
        let p = plan(dir.path());
        let get = probe(json!({"httpGet": {"path": "/healthz", "port": port}}));
        assert!(check(&get, &p, "127.0.0.1").await);
        assert!(!check(&get, &p, "127.0.0.1").await);
    }
}
