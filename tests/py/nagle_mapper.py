"""A paho-mqtt (Python) mapper as people write one: Nagle's algorithm left on (paho does not set
TCP_NODELAY), twin reports at QoS 1 one after another, each sent 5 ms after the last one's
result and PUBACK, and every result acknowledged. Prints how many were answered, the median time
from a report's publish to its result and PUBACK, and how many took 35 ms or more.
Usage: nagle_mapper.py <port> <device id> <reports> [<CA file>: over TLS to localhost]"""
import json
import statistics
import sys
import threading
import time
import uuid

import paho.mqtt.client as mqtt

port, device, count = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
ca_file = sys.argv[4] if len(sys.argv) > 4 else None
topic = f"$hw/events/device/{device}/twin/update"
results, acked, ready = {}, set(), threading.Condition()


def on_subscribe(_client, _userdata, _mid, _reasons, _properties):
    with ready:
        results["subscribed"] = True
        ready.notify_all()


def on_message(_client, _userdata, message):
    event = json.loads(message.payload).get("event_id")
    with ready:
        results[event] = time.monotonic()
        ready.notify_all()


def on_publish(_client, _userdata, mid, _reason, _properties):
    with ready:
        acked.add(mid)
        ready.notify_all()


client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"py-{uuid.uuid4().hex[:12]}")
client.on_subscribe = on_subscribe
client.on_message = on_message
client.on_publish = on_publish
if ca_file:
    client.tls_set(ca_certs=ca_file)
client.connect("localhost" if ca_file else "127.0.0.1", port, keepalive=60)
client.loop_start()
client.subscribe(topic + "/result", qos=1)
with ready:
    ready.wait_for(lambda: "subscribed" in results, timeout=10)
waits = []
for value in range(count):
    event = f"nagle-{value}"
    report = {"event_id": event, "timestamp": int(time.time() * 1000),
              "twin": {"power": {"actual": {"value": str(value)}, "metadata": {"type": "int"}}}}
    sent = time.monotonic()
    mid = client.publish(topic, json.dumps(report), qos=1).mid
    with ready:
        if ready.wait_for(lambda: event in results and mid in acked, timeout=10):
            waits.append(time.monotonic() - sent)
    # The result's PUBACK leaves on paho's thread after on_message: let it go first.
    time.sleep(0.005)
client.loop_stop()
client.disconnect()
held = sum(1 for wait in waits if wait >= 0.035)
if waits:
    print(f"answered {len(waits)} of {count}; median {statistics.median(waits) * 1000:.1f} ms; "
          f"35 ms or more: {held}")
else:
    print(f"answered 0 of {count}")
