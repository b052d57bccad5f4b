//! The cloud's kubelet API requests: edged's own MQTT connection to the cloud broker (opened
//! from the node, so nothing on the node listens beyond loopback) carries each stream
//! the controller opens (`edgemeta_protocol::stream`) to the loopback kubelet API and back.
//!
//! Not through the node's bridge: its cloud-bound traffic goes through the durable outbox and
//! its down traffic into the MetaManager's store, both wrong for bytes of a live connection.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use edgemeta_protocol::stream::{self as wire, Frame, Incoming};
use rumqttc::{AsyncClient, Event, LastWill, MqttOptions, Packet, QoS};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::EdgedConfig;

/// Requests rumqttc may hold; stream tasks wait for room (back-pressure, not loss).
const REQUEST_CAPACITY: usize = 1024;
/// How long to reach the loopback kubelet API.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the stream link goes, from `edged.stream` and the Node.
#[derive(Debug, Clone)]
pub struct Settings {
    pub host: String,
    pub port: u16,
    pub root: String,
    pub node: String,
    pub client_id: String,
    pub username: Option<String>,
    pub password: Option<String>,
    pub window: u32,
    pub max_streams: usize,
    pub keep_alive: Duration,
    pub reconnect_min: Duration,
    pub reconnect_max: Duration,
}

impl Settings {
    /// `None` when there is no cloud broker or no Node name: streams are off.
    pub fn from_config(config: &EdgedConfig) -> Option<Settings> {
        let stream = &config.stream;
        if stream.broker_url.is_empty() || config.node.name.is_empty() {
            return None;
        }
        let url =
            edgemeta_protocol::MqttUrl::parse(stream.broker_url.trim_end_matches('/')).ok()?;
        let root = if stream.root.is_empty() {
            "kubeedge".to_owned()
        } else {
            stream.root.clone()
        };
        let client_id = if stream.client_id.is_empty() {
            format!("edgemeta-{}-stream", config.node.name)
        } else {
            stream.client_id.clone()
        };
        Some(Settings {
            host: url.host.trim_matches(['[', ']']).to_owned(),
            port: url.port.unwrap_or(1883),
            root,
            node: config.node.name.clone(),
            client_id,
            username: stream.username.clone(),
            password: stream.password.clone(),
            window: stream.window_bytes,
            max_streams: stream.max_streams,
            keep_alive: Duration::from_secs(config.keep_alive_s.max(5)),
            reconnect_min: EdgedConfig::ms(config.reconnect_min_ms),
            reconnect_max: EdgedConfig::ms(config.reconnect_max_ms),
        })
    }
}

/// A stream's frames go to `<root>/<node>/stream/up/<id>`.
struct UpPublisher {
    client: AsyncClient,
    topic: String,
}

impl wire::Publisher for UpPublisher {
    async fn publish(&self, payload: Vec<u8>) -> bool {
        self.client
            .publish(self.topic.clone(), QoS::AtLeastOnce, false, payload)
            .await
            .is_ok()
    }
}

/// An open stream: its task's queue and the controller that opened it.
struct Open {
    tx: mpsc::Sender<Incoming>,
    controller: String,
}

/// Runs the stream link until `cancel`: connects (with back-off), and relays every stream the
/// controller opens to the kubelet API at `kubelet`. Streams end with their session.
pub async fn run(settings: Settings, kubelet: SocketAddr, cancel: CancellationToken) {
    let state = wire::node_state_topic(&settings.root, &settings.node);
    let mut options = MqttOptions::new(
        settings.client_id.clone(),
        settings.host.clone(),
        settings.port,
    );
    options.set_clean_session(true);
    options.set_keep_alive(settings.keep_alive);
    options.set_max_packet_size(64 * 1024, 64 * 1024);
    options.set_last_will(LastWill::new(&state, "offline", QoS::AtLeastOnce, true));
    if let Some(user) = &settings.username {
        options.set_credentials(user.clone(), settings.password.clone().unwrap_or_default());
    }
    let (client, mut eventloop) = AsyncClient::new(options, REQUEST_CAPACITY);
    let down_filter = format!("{}/{}/stream/down/+", settings.root, settings.node);
    let controllers_filter = wire::controller_state_topic(&settings.root, "+");
    let mut streams: HashMap<String, Open> = HashMap::new();
    // Each stream's task, returning its id: an ended stream leaves the table at the next event
    // (a frame sent, a ping at the latest), and every task is aborted when the link stops.
    let mut tasks: JoinSet<String> = JoinSet::new();
    let mut backoff =
        edgemeta_protocol::Backoff::new(settings.reconnect_min, settings.reconnect_max);
    let mut session = CancellationToken::new();
    loop {
        while let Some(ended) = tasks.try_join_next() {
            if let Ok(id) = ended {
                // Not a newer stream that reused the id while this one was ending.
                if streams.get(&id).is_some_and(|open| open.tx.is_closed()) {
                    streams.remove(&id);
                }
            }
        }
        // `poll` is not cancel-safe: nothing but the link's own end may interrupt it.
        let event = tokio::select! {
            _ = cancel.cancelled() => break,
            event = eventloop.poll() => event,
        };
        match event {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                backoff.reset();
                info!(node = %settings.node, "stream link connected to the cloud broker");
                let _ = client.try_subscribe(down_filter.clone(), QoS::AtLeastOnce);
                let _ = client.try_subscribe(controllers_filter.clone(), QoS::AtLeastOnce);
                let _ = client.try_publish(state.clone(), QoS::AtLeastOnce, true, "online");
            }
            Ok(Event::Incoming(Packet::Publish(publish))) => {
                if let Some(id) = wire::parse_down(&settings.root, &settings.node, &publish.topic) {
                    let frame = match Frame::decode(&publish.payload) {
                        Ok(frame) => frame,
                        Err(e) => {
                            warn!(error_code = "EM-EDGED-STREAM", topic = %publish.topic, error = %e, "malformed stream frame dropped");
                            continue;
                        }
                    };
                    let id = id.to_owned();
                    match frame {
                        Frame::Open { window, controller } => {
                            let up = UpPublisher {
                                client: client.clone(),
                                topic: wire::up_topic(&settings.root, &settings.node, &id),
                            };
                            // Both ends count credit against the same window: the controller's, up to ours.
                            if !(1024..=settings.window).contains(&window) {
                                let refused =
                                    format!("window {window} outside 1024..={}", settings.window);
                                let _ = client.try_publish(
                                    up.topic,
                                    QoS::AtLeastOnce,
                                    false,
                                    Frame::Close(&refused).encode(),
                                );
                                continue;
                            }
                            if streams.len() >= settings.max_streams || streams.contains_key(&id) {
                                let _ = client.try_publish(
                                    up.topic,
                                    QoS::AtLeastOnce,
                                    false,
                                    Frame::Close("too many streams open on this node").encode(),
                                );
                                continue;
                            }
                            let (tx, rx) = mpsc::channel(wire::QUEUED_FRAMES);
                            streams.insert(
                                id.clone(),
                                Open {
                                    tx,
                                    controller: controller.to_owned(),
                                },
                            );
                            tasks.spawn(serve_stream(
                                id,
                                up,
                                rx,
                                kubelet,
                                window,
                                session.child_token(),
                            ));
                        }
                        other => {
                            let Some(incoming) = Incoming::from_frame(&other) else {
                                continue;
                            };
                            if let Some(open) = streams.get(&id) {
                                if open.tx.try_send(incoming).is_err() {
                                    // Overran its queue: dropping the sender aborts it.
                                    warn!(error_code = "EM-EDGED-STREAM", stream = %id, "stream queue overran; aborting the stream");
                                    streams.remove(&id);
                                }
                            }
                        }
                    }
                } else if let Some(controller) = publish
                    .topic
                    .strip_prefix(&controllers_filter[..controllers_filter.len() - 1])
                {
                    if publish.payload.as_ref() == b"offline" {
                        // The controller is gone: so are the connections it relayed.
                        let before = streams.len();
                        streams.retain(|_, open| open.controller != controller);
                        debug!(
                            controller,
                            ended = before - streams.len(),
                            "controller offline; its streams end"
                        );
                    }
                }
            }
            Ok(_) => {}
            Err(e) => {
                if !streams.is_empty() {
                    info!(streams = streams.len(), "stream link lost; its streams end");
                }
                streams.clear();
                session.cancel();
                session = CancellationToken::new();
                let delay = backoff.next_delay();
                warn!(error_code = "EM-EDGED-STREAM-DISCONNECTED", error = %e, retry_ms = delay.as_millis() as u64, "stream link to the cloud broker lost");
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
    session.cancel();
    tasks.abort_all();
    let _ = client.try_publish(state, QoS::AtLeastOnce, true, "offline");
    let _ = client.try_disconnect();
    let _ = tokio::time::timeout(Duration::from_millis(300), async {
        while eventloop.poll().await.is_ok() {}
    })
    .await;
}

/// One stream: a fresh loopback connection to the kubelet API, relayed both ways.
async fn serve_stream(
    id: String,
    up: UpPublisher,
    rx: mpsc::Receiver<Incoming>,
    kubelet: SocketAddr,
    window: u32,
    session: CancellationToken,
) -> String {
    use wire::Publisher as _;
    let socket = match tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio::net::TcpStream::connect(kubelet),
    )
    .await
    {
        Ok(Ok(socket)) => socket,
        Ok(Err(e)) => {
            let _ = up
                .publish(Frame::Close(&format!("kubelet API unreachable: {e}")).encode())
                .await;
            return id;
        }
        Err(_) => {
            let _ = up
                .publish(Frame::Close("kubelet API unreachable: timed out").encode())
                .await;
            return id;
        }
    };
    // The controller waits for this before it sends the request: the stream is up.
    if !up.publish(Frame::Credit(0).encode()).await {
        return id;
    }
    debug!(stream = %id, "stream opened");
    tokio::select! {
        _ = session.cancelled() => {}
        ended = wire::relay(socket, rx, &up, window) => {
            if let Err(reason) = ended {
                debug!(stream = %id, reason, "stream aborted");
            }
        }
    }
    id
}
