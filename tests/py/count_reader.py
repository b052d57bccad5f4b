"""A paho-mqtt (Python) reader: subscribes to a filter, counts what arrives, and prints the count
once nothing came for a quiet spell or its connection ended.
Usage: count_reader.py <port> <filter> <qos> <quiet seconds>"""
import sys
import time
import uuid

import paho.mqtt.client as mqtt

port, topic_filter, qos, quiet = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
state = {"got": 0, "last": None, "ended": None}


def on_connect(client, _userdata, _flags, _reason, _properties):
    client.subscribe(topic_filter, qos=qos)


def on_subscribe(_client, _userdata, _mid, _reasons, _properties):
    print("subscribed", flush=True)


def on_message(_client, _userdata, _message):
    state["got"] += 1
    state["last"] = time.monotonic()


def on_disconnect(_client, _userdata, _flags, reason, _properties):
    state["ended"] = str(reason)


client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"py-{uuid.uuid4().hex[:12]}")
client.on_connect = on_connect
client.on_subscribe = on_subscribe
client.on_message = on_message
client.on_disconnect = on_disconnect
client.connect("127.0.0.1", port, keepalive=60)
client.loop_start()
deadline = time.monotonic() + 300
while time.monotonic() < deadline and state["ended"] is None:
    time.sleep(0.05)
    if state["last"] is not None and time.monotonic() - state["last"] > quiet:
        break
print(f"received {state['got']} ended {state['ended']}", flush=True)
client.loop_stop()
