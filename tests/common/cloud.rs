//! Helpers for the cloud bridge tests (`cloud_bridge.rs`, `cloud_durability.rs`): a node bridged
//! to a mosquitto "cloud", traffic in both directions, and the checks these tests share.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::task::JoinHandle;

use super::{
    envelope, free_port, send, topic, unique_id, wait_until, Client, CloudBroker, CloudOptions,
    Msg, Node, Options,
};

/// Where the cloud bridge announces its session state on the local broker.
pub const CONNECTION: &str = "ke/meta/edgehub/connect/node/connection";

/// A node bridged to `cloud` with a fresh node id and otherwise default settings.
pub async fn bridged(cloud: &CloudBroker) -> (Node, CloudOptions) {
    bridged_with(cloud, Options::default()).await
}

/// A node with `options`, bridged to `cloud` with a fresh node id (replaces `options.cloud`).
pub async fn bridged_with(cloud: &CloudBroker, options: Options) -> (Node, CloudOptions) {
    let bridge = CloudOptions::to(cloud);
    let node = Node::start_with(Options {
        cloud: Some(bridge.clone()),
        ..options
    })
    .await;
    // Until the bridge's first SUBSCRIBE is acknowledged, the cloud broker drops what it is sent
    // for this node; from then on it queues it, also across reconnects.
    if cloud.is_running() {
        await_log(&node, SUBSCRIBED).await;
    }
    (node, bridge)
}

/// What the bridge logs once the cloud broker acknowledged its subscription.
pub const SUBSCRIBED: &str = "subscribed to the cloud's down topics";

/// A node whose cloud is a port nobody listens on, with `store_setup` run on its store first.
/// Remote queries may wait 30 s, so a node that waited for the cloud would be caught.
pub async fn cut_off_node(store_setup: &str) -> Node {
    Node::start_with(Options {
        cloud: Some(CloudOptions {
            port: free_port(),
            node_id: unique_id("node"),
            backoff_min_ms: 50,
            backoff_max_ms: 500,
        }),
        remote_query_timeout_ms: 30_000,
        store_setup: Some(store_setup.to_owned()),
        ..Options::default()
    })
    .await
}

/// A cloud-side client (persistent session, so mosquitto queues for it across restarts)
/// subscribed to `filter`.
pub async fn cloud_client(cloud: &CloudBroker, filter: &str) -> Client {
    let mut client = cloud.client(&unique_id("controller")).await;
    client.subscribe(filter).await;
    client
}

/// Publishes, as the cloud's edgecontroller, an `insert` of `resource` to the node's type-level
/// down topic (the name in `route.resource`); returns its msg_id.
pub async fn cloud_insert(
    controller: &Client,
    bridge: &CloudOptions,
    resource: &str,
    content: Value,
) -> String {
    let (id, payload) = envelope("edgecontroller", "insert", resource, content);
    controller
        .publish(
            &bridge.down(&topic("edgecontroller/insert", resource)),
            payload,
        )
        .await;
    id
}

/// Waits for the node's "OK" to the cloud for insert `id` of `resource` (on the type-level up
/// topic, about `resource`), then checks that the store holds `value`: an ack must mean the
/// change was committed.
pub async fn expect_applied(
    controller: &mut Client,
    bridge: &CloudOptions,
    node: &Node,
    resource: &str,
    id: &str,
    value: &str,
) {
    let ack = controller
        .expect_reply_about(&bridge.up("meta/response"), resource, id)
        .await;
    assert_eq!(ack.content(), json!("OK"));
    assert_eq!(node.stored(resource).await.as_deref(), Some(value));
}

/// Publishes `total` pod status updates from edged (`{"seq": n}`, round-robin over `resources`
/// pods) in a task, pausing `pause` after every `every` messages if given; yields the client
/// and the ids sent.
pub fn spawn_status_stream(
    edged: Client,
    total: usize,
    resources: usize,
    pace: Option<(usize, Duration)>,
) -> JoinHandle<(Client, HashSet<String>)> {
    tokio::spawn(async move {
        let mut ids = HashSet::new();
        for seq in 0..total {
            let resource = format!("default/podstatus/p{}", seq % resources);
            let (id, payload) = envelope("edged", "update", &resource, json!({"seq": seq}));
            edged
                .publish(&topic("ke/meta/edged/update", &resource), payload)
                .await;
            ids.insert(id);
            if let Some((every, pause)) = pace {
                if seq % every == every - 1 {
                    // pacing: the stream is spread out so that cloud restarts fall inside it.
                    tokio::time::sleep(pause).await;
                }
            }
        }
        (edged, ids)
    })
}

/// Waits for the next connection signal and checks its envelope; returns its state.
pub async fn next_signal(watcher: &mut Client) -> String {
    let m = watcher.expect(CONNECTION).await;
    let body = m.json();
    assert_eq!(body["route"]["source"], "edgehub", "{body}");
    assert_eq!(body["route"]["operation"], "connect", "{body}");
    assert_eq!(body["route"]["resource"], "node/connection", "{body}");
    assert!(body["header"]["msg_id"].is_string(), "{body}");
    m.content().as_str().unwrap_or_default().to_owned()
}

/// Skips connection signals until `state` arrives (a flapping link may report the other state
/// in between), within `limit`.
pub async fn await_signal(watcher: &mut Client, state: &str, limit: Duration, node: &Node) {
    let deadline = Instant::now() + limit;
    loop {
        assert!(
            Instant::now() < deadline,
            "no {state} signal within {limit:?}; node log:\n{}",
            tail(&node.log(), 40)
        );
        if next_signal(watcher).await == state {
            return;
        }
    }
}

/// Waits (60 s at most) for a [`spawn_status_stream`] to finish; yields its client, to keep
/// until what it queued is sent, and the ids it sent.
pub async fn stream_finished(
    producer: JoinHandle<(Client, HashSet<String>)>,
) -> (Client, HashSet<String>) {
    tokio::time::timeout(Duration::from_secs(60), producer)
        .await
        .expect("the producer finished within 60 s")
        .expect("producer")
}

/// Drains the cloud-side client into `into` until every id in `want` was seen, failing after
/// `limit` with how many are missing, the node's outbox length and its log; then checks the
/// order per resource ([`assert_ordered_per_resource`]) and returns the number of duplicates.
pub async fn expect_delivered(
    cloud_side: &mut Client,
    want: &HashSet<String>,
    limit: Duration,
    into: &mut Vec<Msg>,
    node: &Node,
) -> usize {
    let mut seen: HashSet<String> = into.iter().map(Msg::msg_id).collect();
    wait_until(
        format_args!("all {} messages in the cloud", want.len()),
        limit,
        async || {
            let missing = want.iter().filter(|id| !seen.contains(*id)).count();
            if missing == 0 {
                return Ok(());
            }
            let report = format!(
                "{missing} missing; {} entries in the outbox; node log:\n{}",
                node.outbox_len().await,
                tail(&node.log(), 60)
            );
            for m in cloud_side.drain(Duration::from_millis(250)).await {
                seen.insert(m.msg_id());
                into.push(m);
            }
            Err(report)
        },
    )
    .await;
    assert_ordered_per_resource(into)
}

/// Per resource, the first delivery of each message carries a larger `seq` than the previous
/// first delivery (redeliveries, recognised by a repeated `msg_id`, are skipped). Also checks
/// that a repeated `msg_id` always repeats the same message. Returns the number of duplicates.
fn assert_ordered_per_resource(received: &[Msg]) -> usize {
    let mut first: HashMap<String, (String, i64)> = HashMap::new();
    let mut last_seq: HashMap<String, i64> = HashMap::new();
    let mut duplicates = 0;
    for m in received {
        let body = m.json();
        let resource = body["route"]["resource"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let seq = body["content"]["seq"]
            .as_i64()
            .unwrap_or_else(|| panic!("no seq in {body}"));
        if let Some((r, s)) = first.get(&m.msg_id()) {
            assert_eq!(
                (r, *s),
                (&resource, seq),
                "msg_id {} reused for a different message",
                m.msg_id()
            );
            duplicates += 1;
            continue;
        }
        first.insert(m.msg_id(), (resource.clone(), seq));
        if let Some(previous) = last_seq.insert(resource.clone(), seq) {
            assert!(
                seq > previous,
                "{resource}: seq {seq} first arrived after seq {previous}"
            );
        }
    }
    duplicates
}

/// Sends `count` pod status reports as edged (`default/podstatus/p<i>`), each a message for the
/// cloud, and waits until the outbox holds them (nothing acknowledged them meanwhile).
pub async fn queue_pod_statuses(node: &Node, count: i64) {
    let edged = node.client().await;
    for i in 0..count {
        send(
            &edged,
            "edged",
            "update",
            &format!("default/podstatus/p{i}"),
            json!({"phase": "Running"}),
        )
        .await;
    }
    await_outbox(node, count, super::WAIT).await;
}

/// Waits until the node's outbox is empty (everything acknowledged by the cloud was deleted).
pub async fn await_empty_outbox(node: &Node, limit: Duration) {
    await_outbox(node, 0, limit).await;
}

/// Waits until the node's outbox holds `len` entries.
pub async fn await_outbox(node: &Node, len: i64, limit: Duration) {
    wait_until(
        format_args!("{len} entries in the outbox"),
        limit,
        || async {
            let now = node.outbox_len().await;
            if now == len {
                Ok(())
            } else {
                Err(format!(
                    "{now} entries; node log:\n{}",
                    tail(&node.log(), 40)
                ))
            }
        },
    )
    .await;
}

/// Waits (at most [`super::WAIT`]) until the node's log contains `needle`, e.g. an event code.
pub async fn await_log(node: &Node, needle: &str) {
    node.await_log(needle).await;
}

/// Queries `resource` as edged and returns the documents in the answer, sorted, failing unless
/// it came within 2 s: with the cloud unreachable, the node must answer from its store, not wait
/// for the cloud.
pub async fn local_query(edged: &mut Client, resource: &str) -> Vec<String> {
    let started = Instant::now();
    let id = send(edged, "edged", "query", resource, Value::Null).await;
    let reply = edged
        .expect_reply_about("ke/edged/meta/response", resource, &id)
        .await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "{resource} took {took:?}");
    eprintln!("{resource}: answered in {took:?}");
    let content = reply.content();
    let mut documents: Vec<String> = serde_json::from_value(content.clone())
        .unwrap_or_else(|e| panic!("{resource}: not a list of strings ({e}): {content}"));
    documents.sort();
    documents
}

/// The last `n` lines of a log, for failure messages.
pub fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A TCP relay between the node and the cloud broker whose node → cloud direction the test can
/// hold: what the node sends then waits in the relay (and the sockets' buffers), unread, while
/// the cloud's messages still reach the node. The node's publishes go unacknowledged meanwhile,
/// as over a link that stalled one way.
pub struct Valve {
    /// Where the node connects.
    pub port: u16,
    open: tokio::sync::watch::Sender<bool>,
    relay: JoinHandle<()>,
}

impl Valve {
    pub async fn to(cloud: &CloudBroker) -> Valve {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the valve");
        let port = listener.local_addr().expect("valve address").port();
        let cloud_port = cloud.port;
        let (open, opened) = tokio::sync::watch::channel(true);
        let relay = tokio::spawn(async move {
            let mut pipes = tokio::task::JoinSet::new();
            while let Ok((node_side, _)) = listener.accept().await {
                let Ok(cloud_side) =
                    tokio::net::TcpStream::connect(("127.0.0.1", cloud_port)).await
                else {
                    continue;
                };
                let (mut from_node, mut to_node) = node_side.into_split();
                let (mut from_cloud, mut to_cloud) = cloud_side.into_split();
                pipes.spawn(async move {
                    let _ = tokio::io::copy(&mut from_cloud, &mut to_node).await;
                });
                let mut opened = opened.clone();
                pipes.spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        let n = match from_node.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if opened.wait_for(|open| *open).await.is_err()
                            || to_cloud.write_all(&buf[..n]).await.is_err()
                        {
                            break;
                        }
                    }
                    let _ = to_cloud.shutdown().await;
                });
            }
        });
        Valve { port, open, relay }
    }

    /// Holds what the node sends from now on.
    pub fn hold(&self) {
        self.open.send_replace(false);
    }

    /// Lets it through, in order.
    pub fn release(&self) {
        self.open.send_replace(true);
    }
}

impl Drop for Valve {
    fn drop(&mut self) {
        self.relay.abort();
    }
}
