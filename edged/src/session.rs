//! The MQTT session to the node's broker: connects (clean session), subscribes to
//! `<root>/edged/#`, hands every message to the agent, and reconnects with back-off. Each new
//! subscription is announced as [`Inbound::Connected`], so the agent re-lists.

use std::time::Duration;

use edgemeta_protocol::Backoff;
use rumqttc::{AsyncClient, Event, EventLoop, Packet, QoS};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::message::{self, Incoming};

/// What the session tells the agent.
#[derive(Debug)]
pub enum Inbound {
    /// Subscribed on a new session: list everything again.
    Connected,
    /// The session was lost.
    Disconnected,
    Message(Box<Incoming>),
}

/// Drives `eventloop` until `cancel`.
pub async fn run(
    mut eventloop: EventLoop,
    client: AsyncClient,
    root: String,
    mut backoff: Backoff,
    inbound: mpsc::Sender<Inbound>,
    cancel: CancellationToken,
) {
    let filter = message::filter(&root);
    let mut connected = false;
    loop {
        let event = tokio::select! {
            _ = cancel.cancelled() => break,
            event = eventloop.poll() => event,
        };
        match event {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                backoff.reset();
                if let Err(e) = client.try_subscribe(filter.clone(), QoS::AtLeastOnce) {
                    warn!(error_code = "EM-EDGED-MQTT", error = %e, "cannot subscribe");
                }
            }
            Ok(Event::Incoming(Packet::SubAck(_))) => {
                connected = true;
                info!(filter = %filter, "edged subscribed to the node's broker");
                if inbound.send(Inbound::Connected).await.is_err() {
                    break;
                }
            }
            Ok(Event::Incoming(Packet::Publish(p))) => {
                match message::parse(&root, &p.topic, &p.payload) {
                    Ok(m) => {
                        if inbound.send(Inbound::Message(Box::new(m))).await.is_err() {
                            break;
                        }
                    }
                    Err(e) => warn!(error_code = e.code(), error = %e, "message dropped"),
                }
            }
            Ok(_) => {}
            Err(e) => {
                if connected {
                    connected = false;
                    warn!(error_code = "EM-EDGED-DISCONNECTED", error = %e, "lost the node's broker; reconnecting");
                    if inbound.send(Inbound::Disconnected).await.is_err() {
                        break;
                    }
                } else {
                    warn!(error_code = "EM-EDGED-CONNECT", error = %e, "cannot reach the node's broker");
                }
                let delay = backoff.next_delay();
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
    // Say goodbye if the session is up; bounded, the broker may be gone.
    if connected && client.try_disconnect().is_ok() {
        let _ = tokio::time::timeout(Duration::from_millis(500), async {
            while eventloop.poll().await.is_ok() {}
        })
        .await;
    }
}
