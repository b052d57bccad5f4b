//! The one path served alone, driven by rumqttc's MQTT 5 client over TCP: sessions kept while a
//! device is away and freed when they expire, and the client's Receive Maximum honoured.

use std::sync::Arc;
use std::time::Duration;

use edgemeta_broker::{serve_connection, Hub, HubLimits, Shared};
use rumqttc::v5::mqttbytes::v5::Packet;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
use tokio::net::TcpListener;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

/// The one path on a free port, with its timers.
async fn start() -> (u16, Arc<Hub>, CancellationToken) {
    let hub = Arc::new(Hub::new(HubLimits {
        queue_bytes: 1 << 20,
        retained_bytes: 1 << 20,
        max_away_sessions: 10_000,
        queues_bytes: 64 << 20,
        reader_stall: std::time::Duration::from_secs(2),
    }));
    let cancel = CancellationToken::new();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(hub.clone().run_timers(cancel.clone()));
    let (accepting, stop) = (Arc::new(Shared::open_to_all(hub.clone())), cancel.clone());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(serve_connection(stream, accepting.clone(), stop.clone()));
        }
    });
    (port, hub, cancel)
}

fn client(id: &str, port: u16, clean_start: bool, expiry: Option<u32>) -> (AsyncClient, EventLoop) {
    let mut options = MqttOptions::new(id, "127.0.0.1", port);
    options.set_clean_start(clean_start);
    options.set_session_expiry_interval(expiry);
    options.set_keep_alive(Duration::from_secs(30));
    AsyncClient::new(options, 1024)
}

/// Polls until `done` says the event it waits for came.
async fn until(eventloop: &mut EventLoop, mut done: impl FnMut(&Packet) -> bool) {
    timeout(WAIT, async {
        loop {
            if let Event::Incoming(packet) = eventloop.poll().await.expect("connection") {
                if done(&packet) {
                    return;
                }
            }
        }
    })
    .await
    .expect("timed out");
}

/// Publishes `n` QoS 1 messages numbered 0.. to `topic`, each PUBACKed.
async fn publish(port: u16, topic: &str, n: usize) {
    publish_paced(port, topic, n, None).await;
}

/// [`publish`], never more than 5,000 ahead of `read` (a reader's count) when given one.
async fn publish_paced(
    port: u16,
    topic: &str,
    n: usize,
    read: Option<std::sync::Arc<std::sync::atomic::AtomicUsize>>,
) {
    let (publisher, mut events) = client("publisher", port, true, None);
    let sender = publisher.clone();
    let topic = topic.to_owned();
    tokio::spawn(async move {
        for i in 0..n {
            if let Some(read) = &read {
                // pacing: a reader that keeps up, however busy the machine, is what is tested.
                while i > read.load(std::sync::atomic::Ordering::Relaxed) + 5_000 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            sender
                .publish(topic.as_str(), QoS::AtLeastOnce, false, i.to_string())
                .await
                .unwrap();
        }
    });
    let mut acked = 0;
    until(&mut events, |p| {
        acked += usize::from(matches!(p, Packet::PubAck(_)));
        acked == n
    })
    .await;
    publisher.disconnect().await.unwrap();
    let _ = timeout(WAIT, async { while events.poll().await.is_ok() {} }).await;
}

/// Waits until the node holds `n` sessions.
async fn sessions_held(hub: &Hub, n: usize) {
    timeout(WAIT, async {
        while hub.sessions() != n {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{} sessions held, not {n}", hub.sessions()));
}

/// Subscribes `id` to `topic` with a session that outlives the connection, then leaves.
async fn subscribe_and_leave(port: u16, id: &str, clean_start: bool, expiry: u32, topic: &str) {
    let (sleeper, mut events) = client(id, port, clean_start, Some(expiry));
    sleeper.subscribe(topic, QoS::AtLeastOnce).await.unwrap();
    until(&mut events, |p| matches!(p, Packet::SubAck(_))).await;
    sleeper.disconnect().await.unwrap();
    let _ = timeout(WAIT, async { while events.poll().await.is_ok() {} }).await;
}

async fn kept_while_away(clean_start: bool) {
    let (port, hub, cancel) = start().await;
    subscribe_and_leave(port, "sleeper", clean_start, 60, "cmd/sleeper").await;
    publish(port, "cmd/sleeper", 1000).await;
    assert_eq!(
        hub.sessions(),
        1,
        "the sleeper's session is held while it is away"
    );

    let (_back, mut events) = client("sleeper", port, false, Some(60));
    let mut got = Vec::new();
    let mut present = None;
    until(&mut events, |p| {
        match p {
            Packet::ConnAck(ack) => present = Some(ack.session_present),
            Packet::Publish(p) => got.push(
                String::from_utf8_lossy(&p.payload)
                    .parse::<usize>()
                    .unwrap(),
            ),
            _ => {}
        }
        got.len() == 1000
    })
    .await;
    assert_eq!(present, Some(true));
    assert_eq!(got, (0..1000).collect::<Vec<_>>(), "all 1,000, in order");
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clean_start_0_with_an_expiry_gets_all_it_missed_in_order() {
    kept_while_away(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clean_start_1_with_an_expiry_gets_all_it_missed_in_order() {
    kept_while_away(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_session_is_freed_and_gets_nothing() {
    let (port, hub, cancel) = start().await;
    subscribe_and_leave(port, "brief", true, 1, "cmd/brief").await;
    // Held for its one second, then freed.
    sessions_held(&hub, 0).await;
    publish(port, "cmd/brief", 10).await;
    let (_back, mut events) = client("brief", port, false, Some(60));
    let mut present = None;
    until(&mut events, |p| {
        if let Packet::ConnAck(ack) = p {
            present = Some(ack.session_present);
        }
        present.is_some()
    })
    .await;
    assert_eq!(
        present,
        Some(false),
        "nothing of the expired session is left"
    );
    let nothing = timeout(Duration::from_millis(500), async {
        loop {
            if let Ok(Event::Incoming(Packet::Publish(_))) = events.poll().await {
                return;
            }
        }
    })
    .await;
    assert!(
        nothing.is_err(),
        "a message for the expired session arrived"
    );
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receive_maximum_5_is_never_exceeded_and_a_10000_burst_arrives_whole() {
    let (port, _hub, cancel) = start().await;
    let mut options = MqttOptions::new("slow", "127.0.0.1", port);
    options.set_receive_maximum(Some(5));
    options.set_manual_acks(true);
    let (slow, mut events) = AsyncClient::new(options, 1024);
    slow.subscribe("burst", QoS::AtLeastOnce).await.unwrap();
    until(&mut events, |p| matches!(p, Packet::SubAck(_))).await;
    tokio::spawn(publish(port, "burst", 10_000));

    let mut unacked = Vec::new();
    let mut most = 0;
    let mut got = 0;
    timeout(Duration::from_secs(120), async {
        while got < 10_000 {
            // The client acknowledges only when nothing more arrives for a moment, so the node
            // would overrun it if it ignored the client's Receive Maximum.
            match timeout(Duration::from_millis(5), events.poll()).await {
                Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                    got += 1;
                    unacked.push(p);
                    most = most.max(unacked.len());
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("connection: {e}"),
                Err(_) => {
                    for p in unacked.drain(..) {
                        slow.ack(&p).await.unwrap();
                    }
                }
            }
        }
    })
    .await
    .expect("the burst arrives");
    assert!(most <= 5, "{most} unacknowledged at once");
    assert_eq!(most, 5, "the window was used");
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_stops_taking_is_cut_off_and_the_others_get_everything() {
    let hub = Arc::new(Hub::new(HubLimits {
        // Room for about 26,000 of the burst's messages (about 10 bytes each), far less than the
        // 60,000 the stopped one is sent: once it is full the publisher waits for it, and it is
        // cut off when it has taken nothing of that within the 2 s window.
        queue_bytes: 256 << 10,
        retained_bytes: 1 << 20,
        max_away_sessions: 10_000,
        queues_bytes: 64 << 20,
        reader_stall: std::time::Duration::from_secs(2),
    }));
    let cancel = CancellationToken::new();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (accepting, stop) = (Arc::new(Shared::open_to_all(hub.clone())), cancel.clone());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(serve_connection(stream, accepting.clone(), stop.clone()));
        }
    });
    // The stopped reader: takes one message and never acknowledges it.
    let mut options = MqttOptions::new("stopped", "127.0.0.1", port);
    options.set_receive_maximum(Some(1));
    options.set_manual_acks(true);
    let (stopped, mut stopped_events) = AsyncClient::new(options, 1024);
    stopped.subscribe("burst", QoS::AtLeastOnce).await.unwrap();
    until(&mut stopped_events, |p| matches!(p, Packet::SubAck(_))).await;
    let (reader, mut reader_events) = client("reader", port, true, None);
    reader.subscribe("burst", QoS::AtLeastOnce).await.unwrap();
    until(&mut reader_events, |p| matches!(p, Packet::SubAck(_))).await;

    let read = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    tokio::spawn(publish_paced(port, "burst", 60_000, Some(read.clone())));
    let mut got = 0;
    until(&mut reader_events, |p| {
        got += usize::from(matches!(p, Packet::Publish(_)));
        read.store(got, std::sync::atomic::Ordering::Relaxed);
        got == 60_000
    })
    .await;
    // The node sends DISCONNECT 0x97 and closes; rumqttc 0.25 ends its event loop with an error
    // (it reports the packet as a decoding error), so the end itself is what is checked.
    let _ended = timeout(WAIT, async {
        loop {
            if let Err(e) = stopped_events.poll().await {
                return format!("{e:?}");
            }
        }
    })
    .await
    .expect("the stopped reader is cut off");
    assert_eq!(got, 60_000, "the other reader got everything");
    cancel.cancel();
}
