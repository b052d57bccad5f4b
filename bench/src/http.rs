//! Plain HTTP/1.1 on loopback, one request per connection: the node's MetaServer and the fake
//! API server speak it, and a request a row makes is too rare to need a client library.

use anyhow::{bail, Context as _};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// `method path` with a JSON `body`, if any, and `Connection: close`; the status code and the
/// body.
pub async fn request(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> anyhow::Result<(u16, Vec<u8>)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: application/json\r\nConnection: close\r\n"
    );
    if let Some(body) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await?;
    if let Some(body) = body {
        stream.write_all(body.as_bytes()).await?;
    }
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let head_end = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .with_context(|| format!("{method} {path}: no HTTP head"))?;
    let status = std::str::from_utf8(&response[..head_end.min(12)])
        .ok()
        .and_then(|line| line.strip_prefix("HTTP/1.1 "))
        .and_then(|code| code.get(..3))
        .and_then(|code| code.parse().ok())
        .with_context(|| {
            format!(
                "{method} {path}: {}",
                String::from_utf8_lossy(&response[..head_end])
            )
        })?;
    let head = String::from_utf8_lossy(&response[..head_end]).into_owned();
    let mut body = response.split_off(head_end + 4);
    // A body sent chunked (the fake API server's lists): the chunks' payloads, in order.
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body).with_context(|| format!("{method} {path}: chunked body"))?;
    }
    Ok((status, body))
}

/// `GET path`; the body of a 200.
pub async fn get(port: u16, path: &str) -> anyhow::Result<Vec<u8>> {
    let (status, body) = request(port, "GET", path, None).await?;
    if status != 200 {
        bail!("GET {path}: {status} {}", String::from_utf8_lossy(&body));
    }
    Ok(body)
}

/// The payload of a chunked body: each chunk's hex size line, its bytes and CRLF, up to the
/// chunk of size 0.
fn dechunk(mut body: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(body.len());
    loop {
        let line_end = body
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("no chunk size line")?;
        let size = std::str::from_utf8(&body[..line_end])?;
        let size = size.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size, 16).context("chunk size")?;
        body = &body[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        out.extend_from_slice(body.get(..size).context("a chunk cut short")?);
        body = body.get(size + 2..).context("a chunk cut short")?;
    }
}
