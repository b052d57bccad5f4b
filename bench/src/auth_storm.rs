//! The auth-storm row: with users configured, 1,000 wrong-password CONNECTs over 10 s from 64
//! concurrent connections (100 over 1 s from 8 with --quick) while an honest client logs in
//! again and again. Measured: the broker's RSS rise and the honest login's CONNACK latency.
//! mosquitto runs the same storm against its password_file in the same run.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{rss_of, verdict, Args, Row, Server};

/// The honest user and its password; the guessers try this user with wrong ones.
const USER: &str = "alice";
const PASSWORD: &str = "correct horse";

/// Guesses in all, guessing connections at once, and the storm's length.
fn sizes(args: &Args) -> (usize, usize, Duration) {
    if args.quick {
        (100, 8, Duration::from_secs(1))
    } else {
        (1_000, 64, Duration::from_secs(10))
    }
}

/// What one storm did to one broker.
struct Storm {
    /// RSS before any login, before the storm (after one honest login), and at its peak.
    rss_kib: (u64, u64, u64),
    /// The honest client's CONNACK latencies.
    honest_ms: Vec<f64>,
    honest_refused: usize,
    /// Guesses answered "bad user name or password" (checked), "busy" or otherwise.
    refused: usize,
    busy: usize,
    other: usize,
}

pub async fn auth_storm(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let hash = edgemeta_hash(&args.edgemeta)?;
    let broker = format!(
        "  auth:\n    allow_anonymous: true\n    users:\n      {USER}: {{ password_hash: \"{hash}\" }}\n"
    );
    let node = Server::edgemeta_broker(&args.edgemeta, dir.path(), &broker, "").await?;
    let em = storm(args, node.port, node.pid()).await?;
    drop(node);
    let passwords = dir.path().join("passwords");
    let made = Command::new("mosquitto_passwd")
        .args(["-c", "-b"])
        .arg(&passwords)
        .args([USER, PASSWORD])
        .stdout(Stdio::null())
        .status()
        .context("mosquitto_passwd")?;
    if !made.success() {
        bail!("mosquitto_passwd failed");
    }
    let extra = format!("password_file {}\n", passwords.display());
    let port = super::free_port()?;
    let mosquitto =
        Server::mosquitto_with(&args.mosquitto, dir.path(), "mosquitto", port, &extra).await?;
    let mq = storm(args, mosquitto.port, mosquitto.pid()).await?;
    drop(mosquitto);
    let (total, conns, length) = sizes(args);
    let rise = |s: &Storm| s.rss_kib.2.saturating_sub(s.rss_kib.1);
    let mb = |kib: u64| kib as f64 / 1024.0;
    let rss = |s: &Storm| {
        format!(
            "+{:.1} (start {:.1}, before {:.1}, peak {:.1})",
            mb(rise(s)),
            mb(s.rss_kib.0),
            mb(s.rss_kib.1),
            mb(s.rss_kib.2)
        )
    };
    rows.push(Row {
        name: format!(
            "Auth storm: {total} wrong-password CONNECTs over {} s from {conns} connections: RSS rise over the storm (MB)",
            length.as_secs()
        ),
        edgemeta: rss(&em),
        mosquitto: rss(&mq),
        target: "≤ 20 MB".into(),
        verdict: verdict(rise(&em) <= 20 * 1024, ""),
    });
    let latency = |s: &Storm| {
        let p = percentiles_ms(&s.honest_ms);
        format!(
            "{:.1} / {:.1} / {:.1} ({} logins, {} refused)",
            p.0,
            p.1,
            p.2,
            s.honest_ms.len(),
            s.honest_refused
        )
    };
    let em_p99 = percentiles_ms(&em.honest_ms).1;
    rows.push(Row {
        name: "Auth storm: honest login CONNACK p50 / p99 / max (ms)".into(),
        edgemeta: latency(&em),
        mosquitto: latency(&mq),
        target: "p99 ≤ 100 ms".into(),
        verdict: verdict(em_p99 <= 100.0 && em.honest_refused == 0, ""),
    });
    let guesses = |s: &Storm| format!("{} checked, {} busy, {} other", s.refused, s.busy, s.other);
    rows.push(Row {
        name: "Auth storm: how the guesses were refused".into(),
        edgemeta: guesses(&em),
        mosquitto: guesses(&mq),
        target: "—".into(),
        verdict: "—".into(),
    });
    Ok(())
}

/// A hash of [`PASSWORD`] from `edgemeta passwd`, with the node's default argon2 parameters.
fn edgemeta_hash(binary: &Path) -> anyhow::Result<String> {
    let mut child = Command::new(binary)
        .arg("passwd")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("edgemeta passwd")?;
    use std::io::Write as _;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(format!("{PASSWORD}\n").as_bytes())?;
    let out = child.wait_with_output()?;
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

/// p50, p99 and max of `samples`.
fn percentiles_ms(samples: &[f64]) -> (f64, f64, f64) {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let at = |q: f64| {
        sorted
            .get(((sorted.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    (at(0.5), at(0.99), at(1.0))
}

/// One storm against the broker on `port` (process `pid`).
async fn storm(args: &Args, port: u16, pid: u32) -> anyhow::Result<Storm> {
    let (total, conns, length) = sizes(args);
    let start_rss = rss_of(pid)?;
    // The honest client has logged in before (a device reconnecting).
    let (_, code) = login(port, "honest", PASSWORD).await?;
    if code != 0 {
        bail!("the honest login was refused before the storm: {code:#x}");
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = rss_of(pid)?;
    let peak = Arc::new(AtomicU64::new(before));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                if let Ok(rss) = rss_of(pid) {
                    peak.fetch_max(rss, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let honest = {
        let done = done.clone();
        tokio::spawn(async move {
            let (mut latencies, mut refused) = (Vec::new(), 0);
            while !done.load(Ordering::Relaxed) {
                match login(port, "honest", PASSWORD).await {
                    Ok((elapsed, 0)) => latencies.push(elapsed.as_secs_f64() * 1e3),
                    _ => refused += 1,
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (latencies, refused)
        })
    };
    let started = Instant::now();
    // Each connection guesses in turn, one guess a gap; the first `total % conns` once more.
    let per_conn = total.div_ceil(conns);
    let gap = length / per_conn as u32;
    let guessers: Vec<_> = (0..conns)
        .map(|c| {
            let per_conn = total / conns + usize::from(c < total % conns);
            tokio::spawn(async move {
                let mut codes = Vec::new();
                // Spread the connections' starts over one gap.
                tokio::time::sleep(gap * c as u32 / conns as u32).await;
                for g in 0..per_conn {
                    let id = format!("guess-{c}-{g}");
                    let code = login(port, &id, &format!("wrong-{c}-{g}")).await;
                    codes.push(code.map_or(-1, |(_, code)| i32::from(code)));
                    let next = started + gap * (g as u32 + 1) + gap * c as u32 / conns as u32;
                    tokio::time::sleep_until(next.into()).await;
                }
                codes
            })
        })
        .collect();
    let mut codes = Vec::new();
    for guesser in guessers {
        codes.extend(guesser.await?);
    }
    // The honest client keeps going a little past the storm's last checks.
    tokio::time::sleep(Duration::from_millis(500)).await;
    done.store(true, Ordering::Relaxed);
    let (honest_ms, honest_refused) = honest.await?;
    sampler.await?;
    let count = |f: &dyn Fn(i32) -> bool| codes.iter().filter(|&&c| f(c)).count();
    Ok(Storm {
        rss_kib: (start_rss, before, peak.load(Ordering::Relaxed)),
        honest_ms,
        honest_refused,
        // 3.1.1: 4 bad user name or password, 5 not authorised; 3 server unavailable (busy).
        refused: count(&|c| c == 4 || c == 5),
        busy: count(&|c| c == 3),
        other: count(&|c| !(3..=5).contains(&c)),
    })
}

/// One MQTT 3.1.1 CONNECT as `USER` with `password`: the time to its CONNACK and its return
/// code; an admitted client disconnects at once.
async fn login(port: u16, id: &str, password: &str) -> anyhow::Result<(Duration, u8)> {
    let started = Instant::now();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
    stream.set_nodelay(true)?;
    let string = |s: &str| {
        let mut out = (s.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(s.as_bytes());
        out
    };
    let mut body = string("MQTT");
    body.extend_from_slice(&[4, 0b1100_0010, 0, 30]);
    body.extend(string(id));
    body.extend(string(USER));
    body.extend(string(password));
    let mut packet = vec![0x10, u8::try_from(body.len())?];
    packet.extend(body);
    stream.write_all(&packet).await?;
    let mut connack = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(10), stream.read_exact(&mut connack))
        .await
        .context("no CONNACK within 10 s")??;
    let elapsed = started.elapsed();
    if connack[3] == 0 {
        stream.write_all(&[0xE0, 0]).await?;
    }
    Ok((elapsed, connack[3]))
}
