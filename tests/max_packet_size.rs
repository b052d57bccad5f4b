//! MQTT 5's Maximum Packet Size towards a client, with paho-mqtt for Python (a client we did not
//! write): measured on the PUBLISH as sent, packet id included [MQTT-3.1.2-25], so a client that
//! announces one gets its QoS 1 and 2 messages, and only what is larger is dropped, for it alone.

mod common;

use common::{paho_script, Node};

#[tokio::test]
async fn a_client_that_announces_a_maximum_packet_size_gets_qos_1_and_2_and_only_the_oversize_is_dropped(
) {
    let node = Node::start().await;
    let (printed, stderr) = paho_script("max_packet.py", &[&node.port.to_string()]).await;
    assert_eq!(
        printed.trim(),
        "limited [(1, 10), (1, 30), (2, 20)] plain [(1, 10), (1, 30), (1, 1000), (2, 20)]",
        "stderr: {stderr}"
    );
}
