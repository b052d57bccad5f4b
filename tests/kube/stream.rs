//! `kubectl logs` for a pod on an edgemeta node, over the real path: kubectl → the fake API
//! server's `pods/log` → HTTPS with the apiserver's client certificate to the address and port
//! the Node reports → the controller's stream server → the mosquitto cloud broker → edged's
//! stream link → edged's loopback kubelet API. Certificates are made by openssl at test time.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt as _, BufReader};

use super::common::cloud::bridged;
use super::common::edged::Edged;
use super::common::pki::Pki;
use super::common::{free_port, unique_id, wait_until, CloudBroker, Node};
use super::{phase, Cluster, Controller, RUN_WAIT};

const DOMAIN: &str = "edge.test";

/// Everything of one test, the stream path included.
struct StreamRig {
    cluster: Cluster,
    _cloud: CloudBroker,
    controller: Controller,
    node: Node,
    name: String,
    edged: Edged,
    pki: Pki,
    client: String,
    stream_port: u16,
}

impl StreamRig {
    /// `exec`: edged's `kubelet.exec`.
    async fn start(exec: bool) -> StreamRig {
        let pki = Pki::new();
        pki.issue(
            "stream",
            "edgemeta stream server",
            "ca",
            &format!("subjectAltName=DNS:*.{DOMAIN}\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n"),
        );
        // The apiserver's kubelet client certificate comes from a CA of its own.
        pki.authority("apiclients");
        let client = pki.client("kube-apiserver-kubelet-client", "apiclients");
        let stream_port = free_port();
        let cluster = Cluster::start_with(edgemeta_fakeapi::Config {
            kubelet: Some(edgemeta_fakeapi::KubeletClient {
                cert: pki.path(&format!("{client}.pem")),
                key: pki.path(&format!("{client}.key")),
                ca: pki.path("ca.pem"),
                preferred_address_types: vec!["InternalDNS".to_owned(), "InternalIP".to_owned()],
                dial: Some(std::net::SocketAddr::from(([127, 0, 0, 1], stream_port))),
            }),
            ..edgemeta_fakeapi::Config::default()
        })
        .await;
        let cloud = CloudBroker::start().await;
        let listen = format!("127.0.0.1:{stream_port}");
        let (cert, key, ca) = (
            pki.path("stream.pem").display().to_string(),
            pki.path("stream.key").display().to_string(),
            pki.path("apiclients.pem").display().to_string(),
        );
        let controller = Controller::start_with(
            &cluster,
            &cloud,
            &unique_id("controller"),
            &[
                "--node-status-refresh-ms",
                "2000",
                "--stream-listen",
                &listen,
                "--stream-cert",
                &cert,
                "--stream-key",
                &key,
                "--stream-client-ca",
                &ca,
                "--stream-domain",
                DOMAIN,
            ],
        );
        let (node, bridge) = bridged(&cloud).await;
        let name = bridge.node_id.clone();
        let node_section = format!(
            "{{name: {name}, status_interval_ms: 1000, lease_interval_ms: 1000, \
             kubelet_port: {stream_port}, kubelet_address: {name}.{DOMAIN}}}"
        );
        let stream_section = format!("{{broker_url: 'mqtt://127.0.0.1:{}'}}", cloud.port);
        let kubelet_section = format!("{{exec: {exec}}}");
        let edged = Edged::start(
            &node,
            &[
                ("node", node_section.as_str()),
                ("stream", stream_section.as_str()),
                ("kubelet", kubelet_section.as_str()),
            ],
        );
        StreamRig {
            cluster,
            _cloud: cloud,
            controller,
            node,
            name,
            edged,
            pki,
            client,
            stream_port,
        }
    }

    fn logs(&self) -> String {
        format!(
            "--- controller\n{}\n--- node\n{}\n--- edged\n{}",
            self.controller.log(),
            self.node.log(),
            self.edged.log()
        )
    }

    /// Creates pod `web` on the node running `script`, with `extra` merged into its container.
    async fn web(&self, script: &str, extra: Value) {
        let mut container =
            json!({"name": "main", "image": "busybox", "command": ["sh", "-c", script]});
        if let Value::Object(extra) = extra {
            for (k, v) in extra {
                container[k] = v;
            }
        }
        self.cluster
            .create::<Pod>(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "web", "namespace": "default"},
                "spec": {"nodeName": self.name, "terminationGracePeriodSeconds": 1,
                         "containers": [container]}}))
            .await;
        wait_until("web Running", RUN_WAIT, async || {
            match self.cluster.pods().get("web").await {
                Ok(pod) if phase(&pod) == "Running" => Ok(()),
                _ => Err(self.logs()),
            }
        })
        .await;
    }

    /// `kubectl logs <args>`: (success, stdout, stderr).
    fn kubectl_logs(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(self.cluster.kubeconfig())
            .arg("logs")
            .args(args)
            .arg("--request-timeout=20s")
            .output()
            .expect("kubectl is installed");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Waits until `kubectl logs <args>` succeeds with output `check` accepts.
    async fn await_logs(&self, args: &[&str], check: impl Fn(&str) -> bool) -> String {
        wait_until(format_args!("kubectl logs {args:?}"), RUN_WAIT, || {
            let (ok, out, err) = self.kubectl_logs(args);
            std::future::ready(if ok && check(&out) {
                Ok(out)
            } else {
                Err(format!(
                    "ok={ok}\nstdout:\n{out}\nstderr:\n{err}\n{}",
                    self.logs()
                ))
            })
        })
        .await
    }

    /// `curl` to the controller's stream server as `<node>.<domain>`, with the apiserver's
    /// client certificate or none: (HTTP code, body).
    fn curl(&self, method: &str, path: &str, with_cert: bool) -> (u16, String) {
        let host = format!("{}.{DOMAIN}", self.name);
        let mut command = Command::new("curl");
        command
            .args([
                "-sS",
                "-X",
                method,
                "--max-time",
                "20",
                "-o",
                "-",
                "-w",
                "\n%{http_code}",
            ])
            .arg("--resolve")
            .arg(format!("{host}:{}:127.0.0.1", self.stream_port))
            .arg("--cacert")
            .arg(self.pki.path("ca.pem"));
        if with_cert {
            command
                .arg("--cert")
                .arg(self.pki.path(&format!("{}.pem", self.client)))
                .arg("--key")
                .arg(self.pki.path(&format!("{}.key", self.client)));
        }
        let out = command
            .arg(format!("https://{host}:{}{path}", self.stream_port))
            .stderr(Stdio::inherit())
            .output()
            .expect("curl is installed");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_owned())
    }
}

/// Makes the pod's script print `text` (it prints and removes `<pod dir>/say`).
fn say(dir: &Path, text: &str) {
    let temporary = dir.join("say.tmp");
    std::fs::write(&temporary, format!("{text}\n")).expect("say");
    std::fs::rename(&temporary, dir.join("say")).expect("say");
}

/// Prints `first` and `second`, then whatever is put in `say`; exits 1 when `stop` appears.
const SCRIPT: &str = "rm -f unhealthy; echo first; echo second; \
    while true; do if [ -f say ]; then cat say; rm say; fi; sleep 0.05; done";

fn is_timestamped(line: &str, text: &str) -> bool {
    let Some((time, rest)) = line.split_once(' ') else {
        return false;
    };
    rest == text
        && time.len() == 30
        && time.ends_with('Z')
        && time.as_bytes()[10] == b'T'
        && time.as_bytes()[19] == b'.'
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_logs_follow_tail_since_timestamps_and_previous_reach_the_pod_through_the_cloud_link(
) {
    let rig = StreamRig::start(true).await;
    // Liveness: a file `unhealthy` in the pod directory fails the probe; the script removes it.
    rig.web(
        SCRIPT,
        json!({"livenessProbe": {"exec": {"command": ["sh", "-c", "test ! -f unhealthy"]},
                                 "initialDelaySeconds": 1, "periodSeconds": 1,
                                 "failureThreshold": 1}}),
    )
    .await;
    let dir = rig.edged.pod_dir("web");

    let out = rig.await_logs(&["web"], |out| !out.is_empty()).await;
    assert_eq!(out, "first\nsecond\n", "{}", rig.logs());

    // -f: a line written now shows within a second.
    let mut follow = tokio::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(rig.cluster.kubeconfig())
        .args(["logs", "-f", "web"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("kubectl");
    let mut lines = BufReader::new(follow.stdout.take().expect("stdout")).lines();
    for expected in ["first", "second"] {
        let line = tokio::time::timeout(RUN_WAIT, lines.next_line())
            .await
            .expect("kubectl logs -f prints the log")
            .expect("read")
            .expect("a line");
        assert_eq!(line, expected);
    }
    let written = Instant::now();
    say(&dir, "marker-1");
    let line = tokio::time::timeout(Duration::from_secs(5), lines.next_line())
        .await
        .expect("the new line arrives")
        .expect("read")
        .expect("a line");
    let latency = written.elapsed();
    println!("kubectl logs -f: a new line after {latency:?}");
    assert_eq!(line, "marker-1");
    assert!(latency < Duration::from_secs(1), "{latency:?}");
    let _ = follow.kill().await;

    let (ok, out, err) = rig.kubectl_logs(&["web", "--tail=2"]);
    assert!(ok, "{err}");
    assert_eq!(out, "second\nmarker-1\n");

    let (ok, out, err) = rig.kubectl_logs(&["web", "--timestamps"]);
    assert!(ok, "{err}");
    let stamped: Vec<&str> = out.lines().collect();
    assert_eq!(stamped.len(), 3, "{out}");
    for (line, text) in stamped.iter().zip(["first", "second", "marker-1"]) {
        assert!(is_timestamped(line, text), "{line:?}");
    }

    // --since: only what was written in the last 2 seconds.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    say(&dir, "marker-2");
    rig.await_logs(&["web"], |out| out.ends_with("marker-2\n"))
        .await;
    let (ok, out, err) = rig.kubectl_logs(&["web", "--since=2s"]);
    assert!(ok, "{err}");
    assert_eq!(out, "marker-2\n");

    let (ok, out, _) = rig.kubectl_logs(&["web", "--limit-bytes=8"]);
    assert!(ok);
    assert_eq!(out, "first\nse");

    // --previous: after a liveness restart, the last run's log; the current run starts over.
    let (ok, _, err) = rig.kubectl_logs(&["web", "--previous"]);
    assert!(
        !ok && err.contains("previous terminated container"),
        "{err}"
    );
    std::fs::write(dir.join("unhealthy"), "").expect("unhealthy");
    wait_until(
        "web restarted by its liveness probe",
        RUN_WAIT,
        async || {
            let pod = rig
                .cluster
                .pods()
                .get("web")
                .await
                .map_err(|e| e.to_string())?;
            let restarts = pod
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|c| c.first())
                .map_or(0, |c| c.restart_count);
            if restarts >= 1 && phase(&pod) == "Running" {
                Ok(())
            } else {
                Err(rig.logs())
            }
        },
    )
    .await;
    let out = rig
        .await_logs(&["web", "--previous"], |out| !out.is_empty())
        .await;
    assert_eq!(out, "first\nsecond\nmarker-1\nmarker-2\n");
    let out = rig
        .await_logs(&["web"], |out| out == "first\nsecond\n")
        .await;
    assert_eq!(out, "first\nsecond\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_server_wants_the_apiservers_certificate_and_the_node_refuses_what_it_does_not_run(
) {
    let rig = StreamRig::start(false).await;
    rig.web(SCRIPT, json!({})).await;
    // The Node reports the stream server as its kubelet: InternalDNS and the port.
    let reported = wait_until("the Node's kubelet endpoint", RUN_WAIT, async || {
        let nodes: kube::Api<k8s_openapi::api::core::v1::Node> =
            kube::Api::all(rig.cluster.client.clone());
        let node = nodes.get(&rig.name).await.map_err(|e| e.to_string())?;
        let status = node.status.unwrap_or_default();
        let port = status
            .daemon_endpoints
            .and_then(|d| d.kubelet_endpoint)
            .map_or(0, |k| k.port);
        let dns = status
            .addresses
            .unwrap_or_default()
            .into_iter()
            .find(|a| a.type_ == "InternalDNS")
            .map(|a| a.address)
            .unwrap_or_default();
        if port == i32::from(rig.stream_port) {
            Ok(dns)
        } else {
            Err(format!("port {port}"))
        }
    })
    .await;
    assert_eq!(reported, format!("{}.{DOMAIN}", rig.name));

    let (code, body) = rig.curl("GET", "/containerLogs/default/web/main", false);
    assert_eq!(code, 401, "{body}");
    let (code, body) = rig.curl("GET", "/containerLogs/default/web/main", true);
    assert_eq!(
        (code, body.as_str()),
        (200, "first\nsecond\n"),
        "{}",
        rig.logs()
    );
    let (code, body) = rig.curl("GET", "/containerLogs/default/nosuch/main", true);
    assert_eq!(code, 404, "{body}");
    let (code, body) = rig.curl("GET", "/containerLogs/default/web/other", true);
    assert_eq!(code, 404, "{body}");
    let (code, body) = rig.curl("POST", "/exec/default/web/main?command=ls&stdout=1", true);
    assert_eq!(code, 403, "{body}");

    // What metrics-server scrapes: the pod's CPU and memory, and the node's.
    let (code, body) = rig.curl("GET", "/metrics/resource", true);
    assert_eq!(code, 200, "{body}");
    let labels = r#"{container="main",namespace="default",pod="web"}"#;
    for family in [
        "container_cpu_usage_seconds_total",
        "container_memory_working_set_bytes",
    ] {
        let line = body
            .lines()
            .find(|l| l.starts_with(&format!("{family}{labels} ")))
            .unwrap_or_else(|| panic!("{family} in\n{body}"));
        let value: f64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .expect("a value");
        assert!(value >= 0.0, "{line}");
    }
    assert!(body.contains("\nnode_memory_working_set_bytes "), "{body}");

    // kubectl sees kubelet's 404 for a container the pod does not have as the API's error.
    let (ok, _, err) = rig.kubectl_logs(&["web", "-c", "other"]);
    assert!(!ok && err.contains("not valid for pod"), "{err}");

    // Neither the node nor edged listens beyond loopback.
    let listening = String::from_utf8_lossy(
        &Command::new("ss")
            .args(["-ltnpH"])
            .output()
            .expect("ss")
            .stdout,
    )
    .into_owned();
    for pid in [rig.node.pid(), rig.edged.pid()] {
        let mine: Vec<&str> = listening
            .lines()
            .filter(|l| l.contains(&format!("pid={pid},")))
            .collect();
        assert!(
            !mine.is_empty(),
            "pid {pid} listens somewhere:\n{listening}"
        );
        for line in mine {
            let local = line.split_whitespace().nth(3).unwrap_or_default();
            assert!(
                local.starts_with("127.0.0.1:") || local.starts_with("[::1]:"),
                "pid {pid} listens beyond loopback: {line}"
            );
        }
    }
}

/// `curl -N` following `/containerLogs/default/<pod>/main` through the stream server.
fn follow_with_curl(rig: &StreamRig, pod: &str) -> tokio::process::Child {
    let host = format!("{}.{DOMAIN}", rig.name);
    tokio::process::Command::new("curl")
        .args(["-sSN", "--max-time", "60"])
        .arg("--resolve")
        .arg(format!("{host}:{}:127.0.0.1", rig.stream_port))
        .arg("--cacert")
        .arg(rig.pki.path("ca.pem"))
        .arg("--cert")
        .arg(rig.pki.path(&format!("{}.pem", rig.client)))
        .arg("--key")
        .arg(rig.pki.path(&format!("{}.key", rig.client)))
        .arg(format!(
            "https://{host}:{}/containerLogs/default/{pod}/main?follow=true&tailLines=0",
            rig.stream_port
        ))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("curl is installed")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_reads_nothing_slows_only_its_own_stream() {
    let rig = StreamRig::start(true).await;
    rig.web(SCRIPT, json!({})).await;
    // A second pod writing about 1 MB/s, followed by a reader that never reads.
    let noisy = "while true; do head -c 65536 /dev/zero | tr '\\0' x; echo; sleep 0.05; done";
    rig.cluster
        .create::<Pod>(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "noisy", "namespace": "default"},
            "spec": {"nodeName": rig.name, "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": "busybox",
                                     "command": ["sh", "-c", noisy]}]}}))
        .await;
    wait_until("noisy Running", RUN_WAIT, async || {
        match rig.cluster.pods().get("noisy").await {
            Ok(pod) if phase(&pod) == "Running" => Ok(()),
            _ => Err(rig.logs()),
        }
    })
    .await;
    let mut stalled = follow_with_curl(&rig, "noisy");
    const READERS: usize = 20;
    let mut readers = Vec::new();
    for _ in 0..READERS {
        let mut child = follow_with_curl(&rig, "web");
        let lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        readers.push((child, lines));
    }
    // Every follower is connected, and the one that reads nothing has filled what it can.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let dir = rig.edged.pod_dir("web");
    for round in 1..=3 {
        let text = format!("marker-{round}");
        let written = Instant::now();
        say(&dir, &text);
        let mut slowest = Duration::ZERO;
        for (_, lines) in &mut readers {
            let line = tokio::time::timeout(Duration::from_secs(5), lines.next_line())
                .await
                .unwrap_or_else(|_| panic!("{text} not seen within 5 s\n{}", rig.logs()))
                .expect("read")
                .expect("a line");
            assert_eq!(line, text);
            slowest = slowest.max(written.elapsed());
        }
        println!("{READERS} followers beside a stalled one: {text} seen by all after {slowest:?}");
        assert!(slowest < Duration::from_secs(1), "{slowest:?}");
    }
    assert!(
        stalled.try_wait().expect("curl").is_none(),
        "the stalled follower's stream was cut"
    );
}

/// `kubectl exec <args>` with `stdin` piped in: (exit code, stdout, stderr).
fn kubectl_exec(rig: &StreamRig, args: &[&str], stdin: &str) -> (i32, String, String) {
    use std::io::Write as _;
    let mut child = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(rig.cluster.kubeconfig())
        .arg("exec")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl is installed");
    if let Some(mut input) = child.stdin.take() {
        let _ = input.write_all(stdin.as_bytes());
    }
    let out = child.wait_with_output().expect("kubectl exec");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_exec_runs_in_the_pods_environment_with_stdin_and_exit_codes() {
    let rig = StreamRig::start(true).await;
    rig.web(
        SCRIPT,
        json!({"env": [{"name": "GREETING", "value": "hello from the pod"}]}),
    )
    .await;
    let (code, out, err) =
        kubectl_exec(&rig, &["web", "--", "sh", "-c", "echo $GREETING; pwd"], "");
    assert_eq!(code, 0, "{err}\n{}", rig.logs());
    let dir = rig.edged.pod_dir("web");
    assert_eq!(out, format!("hello from the pod\n{}\n", dir.display()));
    let (code, out, err) = kubectl_exec(
        &rig,
        &[
            "-i",
            "web",
            "--",
            "sh",
            "-c",
            "read a; echo got $a; echo oops >&2",
        ],
        "line\n",
    );
    assert_eq!((code, out.as_str()), (0, "got line\n"), "{err}");
    assert!(err.contains("oops"), "{err}");
    let (code, _, err) = kubectl_exec(&rig, &["web", "--", "sh", "-c", "exit 3"], "");
    assert_eq!(code, 3, "{err}");
    let (code, _, err) = kubectl_exec(&rig, &["web", "--", "/no/such/program"], "");
    assert_ne!(code, 0, "{err}");
}

/// A tmux server of the test's own (its socket in a temporary directory), killed on drop.
struct Tmux {
    dir: tempfile::TempDir,
}

impl Tmux {
    fn new() -> Tmux {
        Tmux {
            dir: tempfile::tempdir().expect("dir"),
        }
    }

    /// Starts a detached 120×40 session running the shell script `script`.
    fn run(&self, script: &str) {
        let path = self.path("session.sh");
        std::fs::write(&path, script).expect("script");
        let status = self
            .command()
            .args(["new-session", "-d", "-x", "120", "-y", "40", "sh"])
            .arg(&path)
            .status()
            .expect("tmux is installed");
        assert!(status.success(), "tmux new-session");
    }

    fn command(&self) -> Command {
        let mut command = Command::new("tmux");
        command
            .arg("-S")
            .arg(self.path("socket"))
            .args(["-f", "/dev/null"]);
        command
    }

    /// Types `keys`, then Enter, into the pane.
    fn type_line(&self, keys: &str) {
        for args in [["-l", keys], ["Enter", ""]] {
            let status = self
                .command()
                .args(["send-keys", "-t", "0"])
                .args(args.iter().filter(|a| !a.is_empty()))
                .status()
                .expect("tmux");
            assert!(status.success(), "tmux send-keys {args:?}");
        }
    }

    /// What the pane shows.
    fn screen(&self) -> String {
        let out = self
            .command()
            .args(["capture-pane", "-p", "-t", "0"])
            .output()
            .expect("tmux");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self
            .command()
            .arg("kill-server")
            .stderr(Stdio::null())
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_exec_it_is_an_interactive_shell_on_a_terminal() {
    let rig = StreamRig::start(true).await;
    rig.web(
        SCRIPT,
        json!({"env": [{"name": "GREETING", "value": "hello from the pod"}]}),
    )
    .await;
    // kubectl in a terminal, as an operator types it; its exit code goes to a file.
    let tmux = Tmux::new();
    let exit_file = tmux.path("exit-code");
    tmux.run(&format!(
        "kubectl --kubeconfig '{config}' exec -it web -- sh\n\
         echo $? > '{exit}.tmp'; mv '{exit}.tmp' '{exit}'\n\
         sleep 60\n",
        config = rig.cluster.kubeconfig().display(),
        exit = exit_file.display(),
    ));
    let screen_shows = async |what: &str, wanted: &dyn Fn(&str) -> bool| {
        wait_until(what, RUN_WAIT, async || {
            let screen = tmux.screen();
            if wanted(&screen) {
                Ok(())
            } else {
                Err(format!("screen:\n{screen}\n{}", rig.logs()))
            }
        })
        .await;
    };
    let has_line = |text: &str| {
        let text = text.to_owned();
        move |screen: &str| screen.lines().any(|l| l == text)
    };
    screen_shows("the shell's prompt", &|screen| {
        screen.lines().any(|l| l == "$" || l == "#")
    })
    .await;
    // Two commands: the pod's environment, and the terminal's size as the shell sees it (the
    // pane's, sent by kubectl on the resize channel).
    tmux.type_line("echo \"[$GREETING]\"");
    screen_shows(
        "the first command's output",
        &has_line("[hello from the pod]"),
    )
    .await;
    let pane = tmux
        .command()
        .args([
            "display-message",
            "-p",
            "-t",
            "0",
            "#{pane_height} #{pane_width}",
        ])
        .output()
        .expect("tmux");
    let pane = String::from_utf8_lossy(&pane.stdout).trim().to_owned();
    tmux.type_line("stty size; tty");
    screen_shows("the second command's output", &has_line(&pane)).await;
    tmux.type_line("exit");
    let code = wait_until("kubectl exec -it exits", RUN_WAIT, async || {
        std::fs::read_to_string(&exit_file).map_err(|_| format!("screen:\n{}", tmux.screen()))
    })
    .await;
    let screen = tmux.screen();
    assert_eq!(code.trim(), "0", "{screen}");
    assert!(screen.contains("/dev/pts/"), "{screen}");
}

/// Established TCP connections of process `pid` whose local port is `port`.
fn established(pid: u32, port: u16) -> usize {
    let out = Command::new("ss").args(["-tnpH"]).output().expect("ss");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("ESTAB") && l.contains(&format!("pid={pid},")))
        .filter(|l| {
            l.split_whitespace()
                .nth(3)
                .and_then(|local| local.rsplit_once(':'))
                .is_some_and(|(_, p)| p == port.to_string())
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_ends_at_both_ends_when_its_client_goes() {
    let rig = StreamRig::start(true).await;
    rig.web(SCRIPT, json!({})).await;
    // edged's kubelet API: the one port it listens on.
    let listening = String::from_utf8_lossy(
        &Command::new("ss")
            .args(["-ltnpH"])
            .output()
            .expect("ss")
            .stdout,
    )
    .into_owned();
    let kubelet_port: u16 = listening
        .lines()
        .find(|l| l.contains(&format!("pid={},", rig.edged.pid())))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|local| local.rsplit_once(':'))
        .and_then(|(_, port)| port.parse().ok())
        .unwrap_or_else(|| panic!("edged listens nowhere:\n{listening}"));
    let controller = rig.controller.pid();
    // Followers of a pod that writes nothing more: only their clients' going can end them.
    const FOLLOWERS: usize = 10;
    let mut followers: Vec<_> = (0..FOLLOWERS)
        .map(|_| follow_with_curl(&rig, "web"))
        .collect();
    wait_until("every follow open at both ends", RUN_WAIT, async || {
        let (at_edged, at_controller) = (
            established(rig.edged.pid(), kubelet_port),
            established(controller, rig.stream_port),
        );
        if at_edged == FOLLOWERS && at_controller == FOLLOWERS {
            Ok(())
        } else {
            Err(format!(
                "edged {at_edged}, controller {at_controller}\n{}",
                rig.logs()
            ))
        }
    })
    .await;
    for follower in &mut followers {
        follower.kill().await.expect("kill curl");
    }
    wait_until(
        "every stream ended at the controller and at edged",
        Duration::from_secs(10),
        async || {
            let (at_edged, at_controller) = (
                established(rig.edged.pid(), kubelet_port),
                established(controller, rig.stream_port),
            );
            if at_edged == 0 && at_controller == 0 {
                Ok(())
            } else {
                Err(format!("edged {at_edged}, controller {at_controller}"))
            }
        },
    )
    .await;
    // The pod's log is still served afterwards.
    let (code, body) = rig.curl("GET", "/containerLogs/default/web/main", true);
    assert_eq!((code, body.as_str()), (200, "first\nsecond\n"));
}
