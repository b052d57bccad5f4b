//! The floor of an idle MQTT connection in the one-path design: a tokio task per connection that
//! owns its socket, reads only when the socket is readable into a buffer that is empty while idle,
//! and sleeps on its keep-alive. Clients come from a child process of this example, so the figure
//! is the server's alone. Run: `cargo run --release -p edgemeta-broker --example
//! connection_floor -- 10000` (needs `ulimit -n` above the count).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

mod common;
use common::rss_kb;

#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// What a connected session keeps besides its task: its id and one subscription, as the design
/// stores them (a boxed string each, and a small struct).
struct Session {
    _client_id: Box<str>,
    _filter: Box<str>,
    _granted_qos: u8,
}

async fn serve(mut stream: TcpStream, keep_alive: Duration) {
    let _session = Session {
        _client_id: format!(
            "device-{}",
            stream.peer_addr().map(|a| a.port()).unwrap_or(0)
        )
        .into(),
        _filter: "devices/0000/cmd".into(),
        _granted_qos: 1,
    };
    let mut buf = BytesMut::new();
    loop {
        tokio::select! {
            ready = stream.readable() => {
                if ready.is_err() { return; }
                buf.reserve(256);
                match stream.try_read_buf(&mut buf) {
                    Ok(0) => return,
                    Ok(_) => {
                        // A real connection decodes here; an idle one gives its buffer back.
                        buf.clear();
                        if buf.capacity() > 4096 { buf = BytesMut::new(); }
                        let _ = stream.write_all(&[0xd0, 0]).await;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(_) => return,
                }
            }
            _ = tokio::time::sleep(keep_alive) => return,
        }
    }
}

fn clients(addr: SocketAddr, n: usize) {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        held.push(std::net::TcpStream::connect(addr).expect("connect"));
    }
    println!("clients connected");
    std::thread::sleep(Duration::from_secs(3600));
}

fn main() {
    let mut args = std::env::args().skip(1);
    let first = args.next().unwrap_or_else(|| "2000".into());
    if first == "client" {
        let addr = args.next().and_then(|a| a.parse().ok()).expect("address");
        let n = args.next().and_then(|a| a.parse().ok()).expect("count");
        return clients(addr, n);
    }
    let n: usize = first.parse().expect("count");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let _ = stream.set_nodelay(true);
                counter.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(serve(stream, Duration::from_secs(90)));
            }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let base = rss_kb();
        let exe = std::env::current_exe().expect("exe");
        let mut child = std::process::Command::new(exe)
            .args(["client", &addr.to_string(), &n.to_string()])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("client process");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while accepted.load(Ordering::Relaxed) < n && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let n = accepted.load(Ordering::Relaxed);
        let grown = rss_kb().saturating_sub(base);
        println!(
            "{n} idle connections: +{grown} KB, {:.2} KB per connection",
            grown as f64 / n as f64
        );
        let _ = child.kill();
        let _ = child.wait();
    });
}
