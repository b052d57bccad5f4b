//! kubelet's `exec` over WebSocket (`v5.channel.k8s.io`, `v4.channel.k8s.io`): the command runs
//! with the container's environment and working directory (its volumes are there as
//! `EDGED_VOLUME_*`), in a process group of its own. Each binary message starts with its
//! channel: 0 stdin, 1 stdout, 2 stderr, 3 the final status, 4 resize, 255 close
//! (v5: `[255, 0]` ends stdin). With `tty` the command runs on a pseudo-terminal (`pty.rs`) in
//! a session of its own, its output on channel 1, and resize sets the terminal's size.

use std::process::Stdio;

use axum::extract::ws::{Message, WebSocket};
use futures_util::{SinkExt as _, StreamExt as _};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::mpsc;

use tracing::debug;

use crate::plan::ContainerPlan;
use crate::pty::Pty;

/// The subprotocols served, most preferred first.
pub const PROTOCOLS: [&str; 2] = ["v5.channel.k8s.io", "v4.channel.k8s.io"];
const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const STATUS: u8 = 3;
const RESIZE: u8 = 4;
const CLOSE: u8 = 255;
/// What a terminal's end of input is: VEOF (^D) in canonical mode.
const END_OF_TRANSMISSION: u8 = 4;
/// How long after the upgrade the command starts. kubectl registers its channels only after it
/// has begun reading the socket, and drops a frame for a channel not yet registered ("Unknown
/// stream id", client-go `tools/remotecommand/websocket.go`: `StreamWithContext` starts
/// `readDemuxLoop` before `streamer.stream` creates the streams): a status sent at once, as
/// `sh -c 'exit 3'` sends it, could be lost, and kubectl would report exit code 0.
const CHANNELS_GRACE: std::time::Duration = std::time::Duration::from_millis(50);

/// What the request asked for.
pub struct ExecRequest {
    pub command: Vec<String>,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
    pub tty: bool,
}

impl ExecRequest {
    /// From the query (`command` repeats); `Err` is the 400 message.
    pub fn parse(query: &[(String, String)]) -> Result<ExecRequest, String> {
        let flag = |name: &str| {
            query
                .iter()
                .any(|(k, v)| k == name && matches!(v.as_str(), "1" | "true"))
        };
        let command: Vec<String> = query
            .iter()
            .filter(|(k, _)| k == "command")
            .map(|(_, v)| v.clone())
            .collect();
        if command.is_empty() {
            return Err("you must specify at least 1 command".to_owned());
        }
        Ok(ExecRequest {
            command,
            stdin: flag("stdin"),
            stdout: flag("stdout") || !query.iter().any(|(k, _)| k == "stdout"),
            stderr: flag("stderr"),
            tty: flag("tty"),
        })
    }
}

/// The status message kubelet sends on channel 3 when the command ended.
fn status(code: Option<i32>, error: Option<String>) -> String {
    match (code, error) {
        (Some(0), None) => r#"{"metadata":{},"status":"Success"}"#.to_owned(),
        (_, Some(message)) => serde_json::json!({"metadata": {}, "status": "Failure",
            "message": message, "reason": "InternalError"})
        .to_string(),
        (code, None) => {
            let code = code.unwrap_or(137);
            serde_json::json!({"metadata": {}, "status": "Failure",
                "message": format!("command terminated with non-zero exit code: exit status {code}"),
                "reason": "NonZeroExitCode",
                "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]}})
            .to_string()
        }
    }
}

fn framed(channel: u8, data: &[u8]) -> Message {
    let mut bytes = Vec::with_capacity(data.len() + 1);
    bytes.push(channel);
    bytes.extend_from_slice(data);
    Message::Binary(bytes)
}

type Sink = futures_util::stream::SplitSink<WebSocket, Message>;
type Incoming = futures_util::stream::SplitStream<WebSocket>;

/// Runs `request` in `plan`'s environment over `socket` until the command exits.
pub async fn run(socket: WebSocket, plan: ContainerPlan, request: ExecRequest) {
    tokio::time::sleep(CHANNELS_GRACE).await;
    let (sink, incoming) = socket.split();
    if request.tty {
        run_on_terminal(sink, incoming, plan, request).await;
    } else {
        run_on_pipes(sink, incoming, plan, request).await;
    }
}

/// Reports that the command could not start, and ends the connection.
async fn failed(sink: &mut Sink, message: String) {
    let _ = sink
        .send(framed(STATUS, status(None, Some(message)).as_bytes()))
        .await;
    close(sink).await;
}

/// The command with stdin, stdout and stderr on pipes, each on its channel.
async fn run_on_pipes(
    mut sink: Sink,
    mut incoming: Incoming,
    plan: ContainerPlan,
    request: ExecRequest,
) {
    let (program, args) = request
        .command
        .split_first()
        .expect("parse() refuses an empty command");
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
        .env_clear()
        .envs(plan.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&plan.working_dir)
        .stdin(if request.stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => return failed(&mut sink, format!("starting {program:?}: {e}")).await,
    };
    // Output of both pipes goes through one bounded queue to the socket's one writer.
    let (out_tx, mut out_rx) = mpsc::channel::<Message>(16);
    let mut readers = Vec::new();
    for (pipe, channel, wanted) in [
        (
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn tokio::io::AsyncRead + Send + Unpin>),
            STDOUT,
            request.stdout,
        ),
        (
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn tokio::io::AsyncRead + Send + Unpin>),
            STDERR,
            request.stderr,
        ),
    ] {
        let Some(mut pipe) = pipe else { continue };
        let tx = out_tx.clone();
        readers.push(tokio::spawn(async move {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                match pipe.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) if wanted => {
                        if tx.send(framed(channel, &buf[..n])).await.is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                }
            }
        }));
    }
    drop(out_tx);
    let mut stdin = child.stdin.take();
    let mut output_open = true;
    let exit = loop {
        tokio::select! {
            message = out_rx.recv(), if output_open => match message {
                Some(message) => {
                    if sink.send(message).await.is_err() {
                        break None;
                    }
                }
                None => output_open = false,
            },
            message = incoming.next() => match message {
                Some(Ok(Message::Binary(data))) => match data.split_first() {
                    Some((&STDIN, rest)) => {
                        if let Some(pipe) = stdin.as_mut() {
                            if pipe.write_all(rest).await.is_err() {
                                stdin = None;
                            }
                        }
                    }
                    Some((&CLOSE, [STDIN])) => stdin = None,
                    _ => {}
                },
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break None,
                Some(Ok(_)) => {}
            },
            exited = child.wait(), if !output_open => break exited.ok(),
        }
    };
    let code = match exit {
        Some(status) => status.code(),
        None => {
            // The client went away: the command goes too.
            let _ = child.kill().await;
            return;
        }
    };
    for reader in readers {
        let _ = reader.await;
    }
    let _ = sink
        .send(framed(STATUS, status(code, None).as_bytes()))
        .await;
    close(&mut sink).await;
}

/// The command on a pseudo-terminal: a session of its own with the terminal as its controlling
/// one (job control and ^C work), its output on channel 1, resize on channel 4. The session is
/// made by util-linux's `setsid --ctty`, which execs the command: the workspace forbids the
/// `unsafe` a `pre_exec` hook needs.
async fn run_on_terminal(
    mut sink: Sink,
    mut incoming: Incoming,
    plan: ContainerPlan,
    request: ExecRequest,
) {
    let (pty, terminal) = match Pty::open() {
        Ok(opened) => opened,
        Err(e) => return failed(&mut sink, format!("allocating a terminal: {e}")).await,
    };
    let stdio = || terminal.try_clone().map(Stdio::from);
    let (stdin, stdout, stderr) = match (stdio(), stdio(), stdio()) {
        (Ok(i), Ok(o), Ok(e)) => (i, o, e),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
            return failed(&mut sink, format!("allocating a terminal: {e}")).await
        }
    };
    drop(terminal);
    let mut command = tokio::process::Command::new("setsid");
    command
        .arg("--ctty")
        .args(&request.command)
        .env_clear()
        .envs(plan.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&plan.working_dir)
        .stdin(stdin)
        .stdout(stdout)
        .stderr(stderr)
        .kill_on_drop(true);
    // A container runtime sets TERM for a terminal when the pod does not.
    if !plan.env.iter().any(|(k, _)| k == "TERM") {
        command.env("TERM", "xterm");
    }
    let spawned = command.spawn();
    // The command holds the terminal now; our copies must go, or its end never shows.
    drop(command);
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            return failed(&mut sink, format!("starting {:?}: {e}", request.command[0])).await
        }
    };
    let mut buf = vec![0u8; 16 * 1024];
    // Input the terminal has not taken yet; no more is read from the client until it has.
    let mut pending: Vec<u8> = Vec::new();
    let mut output_open = true;
    let exit = loop {
        tokio::select! {
            ready = pty.readable(), if output_open => {
                let Ok(mut ready) = ready else {
                    output_open = false;
                    continue;
                };
                match Pty::read(&mut ready, &mut buf) {
                    Some(Ok(0)) | Some(Err(_)) => output_open = false,
                    Some(Ok(n)) => {
                        let sent = sink.send(framed(STDOUT, &buf[..n])).await;
                        if sent.is_err() {
                            break None;
                        }
                    }
                    None => {}
                }
            },
            ready = pty.writable(), if !pending.is_empty() => {
                let Ok(mut ready) = ready else {
                    pending.clear();
                    continue;
                };
                match Pty::write(&mut ready, &pending) {
                    Some(Ok(n)) => {
                        pending.drain(..n);
                    }
                    Some(Err(_)) => pending.clear(),
                    None => {}
                }
            },
            message = incoming.next(), if pending.is_empty() => match message {
                Some(Ok(Message::Binary(data))) => match data.split_first() {
                    Some((&STDIN, rest)) if request.stdin => pending.extend_from_slice(rest),
                    Some((&RESIZE, rest)) => resize(&pty, rest),
                    Some((&CLOSE, [STDIN])) if request.stdin => pending.push(END_OF_TRANSMISSION),
                    _ => {}
                },
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break None,
                Some(Ok(_)) => {}
            },
            exited = child.wait() => break Some(exited),
        }
    };
    let code = match exit {
        Some(Ok(status)) => status.code(),
        Some(Err(e)) => return failed(&mut sink, format!("waiting for the command: {e}")).await,
        None => {
            // The client went away: the command goes, and closing the terminal hangs up
            // whatever else runs in its session.
            let _ = child.kill().await;
            return;
        }
    };
    // What the command wrote before it exited is in the terminal's buffer.
    while let Ok(n) = pty.read_now(&mut buf) {
        if n == 0 || sink.send(framed(STDOUT, &buf[..n])).await.is_err() {
            break;
        }
    }
    drop(pty);
    let _ = sink
        .send(framed(STATUS, status(code, None).as_bytes()))
        .await;
    close(&mut sink).await;
}

/// A resize message (`{"Width":80,"Height":24}`) applied to the terminal; anything else is
/// ignored, as kubelet does.
fn resize(pty: &Pty, message: &[u8]) {
    let Some((columns, rows)) = window_size(message) else {
        return;
    };
    if let Err(e) = pty.resize(columns, rows) {
        debug!(error = %e, "resizing an exec terminal");
    }
}

fn window_size(message: &[u8]) -> Option<(u16, u16)> {
    let size: serde_json::Value = serde_json::from_slice(message).ok()?;
    let dimension = |name: &str| size[name].as_u64().and_then(|v| u16::try_from(v).ok());
    Some((dimension("Width")?, dimension("Height")?))
}

/// Ends the connection with a normal closure: client-go takes any other close (an empty close
/// frame reads as 1005) as an error, and may report it instead of the status it received.
async fn close(sink: &mut Sink) {
    let normal = axum::extract::ws::CloseFrame {
        code: axum::extract::ws::close_code::NORMAL,
        reason: "".into(),
    };
    let _ = sink.send(Message::Close(Some(normal))).await;
    let _ = sink.close().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_repeat_and_statuses_say_the_exit_code() {
        let query: Vec<(String, String)> = [
            ("command", "sh"),
            ("command", "-c"),
            ("command", "exit 3"),
            ("stdin", "true"),
            ("stdout", "true"),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        let request = ExecRequest::parse(&query).expect("valid");
        assert_eq!(request.command, ["sh", "-c", "exit 3"]);
        assert!(request.stdin && request.stdout && !request.stderr);
        assert!(ExecRequest::parse(&[]).is_err());
        assert!(status(Some(0), None).contains("Success"));
        assert!(status(Some(3), None).contains(r#""message":"3""#));
        assert_eq!(
            window_size(br#"{"Width":120,"Height":40}"#),
            Some((120, 40))
        );
        assert_eq!(window_size(br#"{"Width":70000,"Height":40}"#), None);
        assert_eq!(window_size(b"junk"), None);
    }
}
