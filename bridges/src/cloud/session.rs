//! One connection to the cloud broker, from CONNECT until it is lost or the bridge is cancelled.
//! Each gets a fresh rumqttc event loop, so rumqttc's own replay (which it silently drops on a
//! fresh broker session) is never relied on: the outbox resends everything unacknowledged.

use std::sync::Arc;
use std::time::Duration;

use edgemeta_metamanager::{Ingress, OutboxHandle};
use edgemeta_protocol::Backoff;
use rumqttc::{
    AsyncClient, ConnectReturnCode, Event, EventLoop, MqttOptions, Outgoing, Packet, QoS,
};
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::egress::Egress;
use super::ingress::{self, DownQueue};
use super::live::Live;
use super::signal::{LinkState, Signal};
use super::Tasks;
use crate::topic_map::TopicMap;
use crate::Error;

/// How long a cancelled session waits for its DISCONNECT to go out, so shutdown stays bounded.
const DISCONNECT_GRACE: Duration = Duration::from_millis(500);

/// rumqttc's request queue beyond the outbox window: the acks of the cloud messages ingress has
/// in hand (its two queues), the subscription, the birth message and heartbeats.
const REQUEST_ROOM: usize = 2 * super::ingress::DOWN_QUEUE + 64;

/// How a session ended.
pub(super) enum SessionEnd {
    Cancelled,
    /// The connection could not be made or was lost; the bridge tries again after a backoff.
    Lost {
        error: Error,
        was_connected: bool,
    },
    /// One of the session's tasks panicked; the bridge stops.
    Failed(Error),
}

pub(super) struct Session<'a> {
    pub(super) options: MqttOptions,
    pub(super) window: usize,
    pub(super) map: &'a TopicMap,
    pub(super) ingress: &'a Ingress,
    pub(super) outbox: &'a OutboxHandle,
    pub(super) signal: &'a Signal,
    pub(super) status: &'a Arc<super::CloudStatus>,
    pub(super) live: &'a Live,
}

impl Session<'_> {
    pub(super) async fn run(self, cancel: &CancellationToken, backoff: &mut Backoff) -> SessionEnd {
        // rumqttc takes no request at all, acks included, while `inflight` publishes are
        // unacknowledged, and numbers publishes 1..=inflight in turn, holding everything back
        // on a number still in use. The session never has more than the outbox window and its
        // birth message unacknowledged, so two above that neither happens: an ack never waits
        // behind publishes, whatever the cloud sends at once.
        let window = self.window.min(usize::from(u16::MAX - 2));
        let mut options = self.options.clone();
        options.set_inflight(u16::try_from(window + 2).expect("window is at most u16::MAX - 2"));
        // A full request queue only delays a publish (see `Egress::fill`), never fails one;
        // this much room lets a window of publishes and a burst of acks queue side by side.
        let (client, mut eventloop) = AsyncClient::new(options, window + REQUEST_ROOM);
        if let Some(end) = connect(&mut eventloop, cancel).await {
            return end;
        }
        backoff.reset();
        self.status.set_connected(true);
        self.signal.send(LinkState::Connected).await;
        // The queue is empty here, so these awaited requests take their place at once.
        // Subscriptions are not restored by rumqttc: subscribe on every connection.
        if let Err(e) = client
            .subscribe(self.map.down_filter(), QoS::AtLeastOnce)
            .await
        {
            return lost(e.into());
        }
        // The birth message, retained: the cloud's controller resyncs this node (protocol §5).
        // It goes out before any outbox entry, so `exchange` knows the first publish is it.
        let birth = super::signal::envelope(LinkState::Connected);
        if let Err(e) = client
            .publish(self.map.connection(), QoS::AtLeastOnce, true, birth)
            .await
        {
            return lost(e.into());
        }
        // The newest heartbeats, right behind the birth: the Node is Ready again at once.
        send_heartbeats(&client, self.map, self.live, self.live.take_newest());
        // Not a child of `cancel`: on shutdown the acks of what is already committed may still
        // go out with the DISCONNECT; the session stops its tasks itself once that is done.
        let stop = CancellationToken::new();
        let mut tasks = Tasks::default();
        // A cloud message refused for now is submitted again with the reconnects' back-off.
        let mut retry = backoff.clone();
        retry.reset();
        let mut down = ingress::start(
            &mut tasks,
            self.ingress.clone(),
            client.clone(),
            self.map.clone(),
            retry,
            self.status.clone(),
            &stop,
        );
        let mut egress = Egress::new(self.outbox, self.map, self.window);
        let exchanged = exchange(
            cancel,
            &client,
            &mut eventloop,
            &mut egress,
            &mut down,
            (self.live, self.map),
        )
        .await;
        // Whatever ended the session, what the cloud acknowledged need not be sent again.
        let _ = egress.flush().await;
        let end = match exchanged {
            Ok(()) => {
                let _ = client.try_disconnect();
                let _ = tokio::time::timeout(DISCONNECT_GRACE, async {
                    while eventloop.poll().await.is_ok() {}
                })
                .await;
                SessionEnd::Cancelled
            }
            Err(error) => lost(error),
        };
        // Unacknowledged cloud messages are redelivered to the next session.
        stop.cancel();
        match tasks.join().await {
            Ok(()) => end,
            Err(error) => SessionEnd::Failed(error),
        }
    }
}

fn lost(error: Error) -> SessionEnd {
    SessionEnd::Lost {
        error,
        was_connected: true,
    }
}

/// Polls until the cloud broker accepted the CONNECT (`None`) or the session is over.
async fn connect(eventloop: &mut EventLoop, cancel: &CancellationToken) -> Option<SessionEnd> {
    let refused = |error: Error| SessionEnd::Lost {
        error,
        was_connected: false,
    };
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Some(SessionEnd::Cancelled),
            event = eventloop.poll() => match event {
                Ok(Event::Incoming(Packet::ConnAck(ack))) if ack.code == ConnectReturnCode::Success => return None,
                Ok(Event::Incoming(Packet::ConnAck(ack))) => return Some(refused(Error::Refused(ack.code))),
                Ok(_) => {}
                Err(e) => return Some(refused(e.into())),
            },
        }
    }
}

/// The connected part of a session: each event goes to the side that owns its state. Returns
/// `Ok` when cancelled.
async fn exchange(
    cancel: &CancellationToken,
    client: &AsyncClient,
    eventloop: &mut EventLoop,
    egress: &mut Egress<'_>,
    down: &mut DownQueue,
    (live, map): (&Live, &TopicMap),
) -> Result<(), Error> {
    // The birth message is the session's first publish; its packet id is not the outbox's.
    let mut birth_pending = true;
    let mut birth_pkid = None;
    loop {
        egress.fill(client).await?;
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = egress.changed(), if egress.caught_up() => egress.outbox_changed(),
            _ = live.changed() => send_heartbeats(client, map, live, live.take()),
            handed = down.hand_over(), if down.has_pending() => handed?,
            event = eventloop.poll(), if down.has_room() => match event? {
                // A heartbeat (QoS 0): no packet id, nothing of the outbox's.
                Event::Outgoing(Outgoing::Publish(0)) => {}
                Event::Outgoing(Outgoing::Publish(pkid)) if birth_pending => {
                    birth_pending = false;
                    birth_pkid = Some(pkid);
                }
                Event::Outgoing(Outgoing::Publish(pkid)) => egress.sent(pkid),
                Event::Incoming(Packet::PubAck(ack)) if birth_pkid == Some(ack.pkid) => birth_pkid = None,
                Event::Incoming(Packet::PubAck(ack)) => egress.acked(ack.pkid).await?,
                Event::Incoming(Packet::Publish(publish)) => down.received(publish),
                // From here on the cloud broker queues what it sends this node, also across
                // reconnects (persistent session): before, it would drop it.
                Event::Incoming(Packet::SubAck(_)) => info!("subscribed to the cloud's down topics"),
                _ => {}
            },
        }
    }
}

/// Publishes heartbeats taken from `live` at QoS 0: a lost one is replaced by the next. One
/// the request queue has no room for waits in `live` for the next heartbeat or session.
fn send_heartbeats(
    client: &AsyncClient,
    map: &TopicMap,
    live: &Live,
    beats: Vec<(String, Vec<u8>)>,
) {
    for (local, payload) in beats {
        if let Some(topic) = map.up(&local) {
            if client
                .try_publish(topic, QoS::AtMostOnce, false, payload.clone())
                .is_err()
            {
                live.keep(local, payload);
            }
        }
    }
}
