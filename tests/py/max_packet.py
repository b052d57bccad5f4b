"""Maximum Packet Size with paho-mqtt (Python, MQTT 5): a reader that announces 256 bytes and one
that announces none subscribe at QoS 1 and 2; a publisher sends a small QoS 1, a small QoS 2, a
QoS 1 of 1,000 bytes and a last small QoS 1. Prints what each reader received, by payload length.
Usage: max_packet.py <port>"""
import sys
import time
import uuid

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

port = int(sys.argv[1])
topic = f"mps/{uuid.uuid4().hex[:8]}"


def reader(name, maximum):
    got = []
    subscribed = []
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{name}-{uuid.uuid4().hex[:8]}",
                         protocol=mqtt.MQTTv5)
    client.on_message = lambda _c, _u, m: got.append((m.qos, len(m.payload)))
    client.on_subscribe = lambda *_: subscribed.append(True)
    properties = None
    if maximum is not None:
        properties = Properties(PacketTypes.CONNECT)
        properties.MaximumPacketSize = maximum
    client.connect("127.0.0.1", port, keepalive=30, properties=properties)
    client.loop_start()
    client.subscribe(f"{topic}/#", qos=2)
    deadline = time.monotonic() + 10
    while not subscribed and time.monotonic() < deadline:
        time.sleep(0.01)
    return client, got


limited, limited_got = reader("limited", 256)
plain, plain_got = reader("plain", None)
publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"pub-{uuid.uuid4().hex[:8]}",
                        protocol=mqtt.MQTTv5)
publisher.connect("127.0.0.1", port, keepalive=30)
publisher.loop_start()
for qos, size in [(1, 10), (2, 20), (1, 1000), (1, 30)]:
    publisher.publish(f"{topic}/m", b"x" * size, qos=qos).wait_for_publish(10)
deadline = time.monotonic() + 10
while (len(plain_got) < 4 or len(limited_got) < 3) and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.3)
print(f"limited {sorted(limited_got)} plain {sorted(plain_got)}", flush=True)
for client in (limited, plain, publisher):
    client.loop_stop()
    client.disconnect()
