//! kubelet's `exec` over WebSocket (`v5.channel.k8s.io`, `v4.channel.k8s.io`): the command runs
//! with the container's environment and working directory (its volumes are there as
//! `EDGED_VOLUME_*`), in a process group of its own. Each binary message starts with its
//! channel: 0 stdin, 1 stdout, 2 stderr, 3 the final status, 4 resize (ignored), 255 close
//! (v5: `[255, 0]` ends stdin). No terminal: `tty` runs the command on pipes.

use std::process::Stdio;

use axum::extract::ws::{Message, WebSocket};
use futures_util::{SinkExt as _, StreamExt as _};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::mpsc;

use crate::plan::ContainerPlan;

/// The subprotocols served, most preferred first.
pub const PROTOCOLS: [&str; 2] = ["v5.channel.k8s.io", "v4.channel.k8s.io"];
const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const STATUS: u8 = 3;
const CLOSE: u8 = 255;

/// What the request asked for.
pub struct ExecRequest {
    pub command: Vec<String>,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
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

/// Runs `request` in `plan`'s environment over `socket` until the command exits.
pub async fn run(socket: WebSocket, plan: ContainerPlan, request: ExecRequest) {
    let (mut sink, mut incoming) = socket.split();
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
        Err(e) => {
            let message = format!("starting {program:?}: {e}");
            let _ = sink
                .send(framed(STATUS, status(None, Some(message)).as_bytes()))
                .await;
            close(&mut sink).await;
            return;
        }
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

/// Ends the connection with a normal closure: client-go takes any other close (an empty close
/// frame reads as 1005) as an error, and may report it instead of the status it received.
async fn close(sink: &mut futures_util::stream::SplitSink<WebSocket, Message>) {
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
    }
}
