# Publishes ROUNDS QoS 0 messages of ~430 B to each of DEVICES `$hw/events/device/d<i>/twin/update/result`
# topics over one raw MQTT 3.1.1 connection (no client library needed).
# usage: mqtt_flood.py PORT DEVICES ROUNDS
import socket, struct, sys
def enc_len(n):
    out=b''
    while True:
        d=n%128; n//=128
        if n: d|=0x80
        out+=bytes([d])
        if not n: return out
def s(x): return struct.pack('>H',len(x))+x
port=int(sys.argv[1]); devices=int(sys.argv[2]); rounds=int(sys.argv[3])
c=socket.create_connection(('127.0.0.1',port))
body=s(b'MQTT')+bytes([4,2])+struct.pack('>H',60)+s(b'mempub')
c.sendall(bytes([0x10])+enc_len(len(body))+body); c.recv(4)
payload=b'{"event_id":"x","timestamp":1,"twin":{"temperature":{"actual":{"value":"25","metadata":{"timestamp":1}},"optional":false,"metadata":{"type":"int"}}}}'*3
buf=b''
for r in range(rounds):
    for i in range(devices):
        t=('$hw/events/device/d%d/twin/update/result'%i).encode()
        v=s(t)+payload
        buf+=bytes([0x30])+enc_len(len(v))+v
    c.sendall(buf); buf=b''
c.sendall(bytes([0xe0,0]))
