"""A DMI mapper in Python grpcio, from KubeEdge's api.proto (stubs generated at start into
argv[3]), as mapper-framework's template behaves: it serves DeviceMapperService on its own unix
socket and registers with the node (withData) over the node's socket.

    python3 dmi_mapper.py <node socket> <own socket> <stub dir> [protocol]

Every call it gets, and the answer to every command, is one JSON line on stdout. Commands, one
per stdin line:
    register                              MapperRegister again
    report <ns> <name> <prop> <value>     ReportDeviceStatus
    state <ns> <name> <state>             ReportDeviceStates
    raw <hex>                             ReportDeviceStatus with these bytes as the body
    big <ns> <name> <bytes>               ReportDeviceStatus with a value this long
    held                                  the devices it holds, with their desired values
    slow <seconds>                        the next UpdateDevice takes that long before it is
                                          applied (it says "slow" when it starts waiting)
    burst <ns> <name> <count>             that many reports at once: how many were taken
    twins <ns> <name> <count>             one report with that many twins
    try <s> <ns> <name> <prop> <value>    ReportDeviceStatus with a deadline of <s> seconds
    fresh <s> <ns> <name> <prop> <value>  the same on a new channel of its own connection
    hold <count>                          that many ReportDeviceStatus calls opened whose
                                          request is not sent until `release`
    release                               sends none and ends them: their status codes
"""

import json
import os
import subprocess
import sys
import threading
import time
from concurrent import futures

NODE, OWN, STUBS = sys.argv[1], sys.argv[2], sys.argv[3]
PROTOCOL = sys.argv[4] if len(sys.argv) > 4 else "modbus"
PROTO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "dmi", "proto")

if not os.path.exists(os.path.join(STUBS, "api_pb2_grpc.py")):
    import grpc_tools

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", PROTO_DIR, "-I", include,
         "--python_out", STUBS, "--grpc_python_out", STUBS, "api.proto"],
        check=True,
    )
sys.path.insert(0, STUBS)

import grpc  # noqa: E402
from google.protobuf import wrappers_pb2  # noqa: E402

import api_pb2  # noqa: E402
import api_pb2_grpc  # noqa: E402

lock = threading.Lock()
devices = {}
models = {}
# Seconds the next UpdateDevice waits before it is applied (the `slow` command).
slow = [0.0]


def say(**event):
    with lock:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()


def unwrap(any_value):
    for kind in (wrappers_pb2.StringValue, wrappers_pb2.FloatValue, wrappers_pb2.BoolValue,
                 wrappers_pb2.Int32Value, wrappers_pb2.Int64Value):
        holder = kind()
        if any_value.Is(holder.DESCRIPTOR):
            any_value.Unpack(holder)
            return holder.value
    return None


def describe(device):
    spec = device.spec
    return {
        "name": device.name,
        "namespace": device.namespace,
        "model": spec.deviceModelReference,
        "desired": {p.name: (p.desired.value if p.HasField("desired") else None)
                    for p in spec.properties},
        "protocol": spec.protocol.protocolName,
        "config": {k: unwrap(v) for k, v in spec.protocol.configData.data.items()},
        "visitors": {p.name: {k: unwrap(v) for k, v in p.visitors.configData.data.items()}
                     for p in spec.properties},
    }


class Mapper(api_pb2_grpc.DeviceMapperServiceServicer):
    def RegisterDevice(self, request, context):
        d = request.device
        key = f"{d.namespace}/{d.name}"
        if f"{d.namespace}/{d.spec.deviceModelReference}" not in models:
            say(call="RegisterDevice", refused="unknown model", **describe(d))
            context.abort(grpc.StatusCode.NOT_FOUND, "model not found")
        devices[key] = d
        say(call="RegisterDevice", **describe(d))
        return api_pb2.RegisterDeviceResponse(deviceName=d.name, deviceNamespace=d.namespace)

    def UpdateDevice(self, request, context):
        d = request.device
        with lock:
            wait, slow[0] = slow[0], 0.0
        if wait:
            say(event="slow", seconds=wait, **describe(d))
            time.sleep(wait)
        devices[f"{d.namespace}/{d.name}"] = d
        say(call="UpdateDevice", at=time.time(), **describe(d))
        return api_pb2.UpdateDeviceResponse()

    def RemoveDevice(self, request, context):
        devices.pop(f"{request.deviceNamespace}/{request.deviceName}", None)
        say(call="RemoveDevice", name=request.deviceName, namespace=request.deviceNamespace)
        return api_pb2.RemoveDeviceResponse()

    def CreateDeviceModel(self, request, context):
        m = request.model
        models[f"{m.namespace}/{m.name}"] = m
        say(call="CreateDeviceModel", name=m.name, namespace=m.namespace,
            properties=[p.name for p in m.spec.properties])
        return api_pb2.CreateDeviceModelResponse(deviceModelName=m.name,
                                                 deviceModelNamespace=m.namespace)

    def UpdateDeviceModel(self, request, context):
        m = request.model
        models[f"{m.namespace}/{m.name}"] = m
        say(call="UpdateDeviceModel", name=m.name, namespace=m.namespace)
        return api_pb2.UpdateDeviceModelResponse()

    def RemoveDeviceModel(self, request, context):
        models.pop(f"{request.modelNamespace}/{request.modelName}", None)
        say(call="RemoveDeviceModel", name=request.modelName, namespace=request.modelNamespace)
        return api_pb2.RemoveDeviceModelResponse()


def register(stub):
    info = api_pb2.MapperInfo(name="py-mapper", version="v1.0", api_version="v1beta1",
                              protocol=PROTOCOL, address=OWN.encode(), state="ok")
    reply = stub.MapperRegister(api_pb2.MapperRegisterRequest(withData=True, mapper=info),
                                timeout=20)
    devices.clear()
    models.clear()
    for m in reply.modelList:
        models[f"{m.namespace}/{m.name}"] = m
    for d in reply.deviceList:
        devices[f"{d.namespace}/{d.name}"] = d
    say(call="MapperRegister", devices=[describe(d) for d in reply.deviceList],
        models=[m.name for m in reply.modelList])


def report_request(ns, name, prop, value):
    twin = api_pb2.Twin(propertyName=prop,
                        reported=api_pb2.TwinProperty(value=value, metadata={"type": "int"}))
    return api_pb2.ReportDeviceStatusRequest(deviceName=name, deviceNamespace=ns,
                                             reportedDevice=api_pb2.DeviceStatus(twins=[twin]))


def node_channel(own_connection=False):
    # grpcio (C-core >= 1.57) names a unix socket's path, percent-encoded, as the :authority,
    # which the node's HTTP/2 (h2) refuses as malformed (grpc/grpc#38142, hyperium/h2#487);
    # grpc-go, and so mapper-framework, sends "localhost", as this does.
    options = [("grpc.default_authority", "localhost")]
    if own_connection:
        # Channels of one process share connections unless told not to.
        options.append(("grpc.use_local_subchannel_pool", 1))
    return grpc.insecure_channel(f"unix://{NODE}", options=options)


def timed(call, request, timeout):
    start = time.time()
    try:
        call(request, timeout=timeout)
        return {"ok": True, "seconds": time.time() - start}
    except grpc.RpcError as error:
        return dict(status(error), seconds=time.time() - start)


def status(error):
    return {"ok": False, "code": error.code().name, "message": error.details()}


def main():
    channel = node_channel()
    stub = api_pb2_grpc.DeviceManagerServiceStub(channel)
    # The calls `hold` opened and the event that ends their requests.
    held, release = [], threading.Event()
    # As mapper-framework's template: register first, then serve.
    register(stub)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    api_pb2_grpc.add_DeviceMapperServiceServicer_to_server(Mapper(), server)
    server.add_insecure_port(f"unix://{OWN}")
    server.start()
    say(event="serving")
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            if words[0] == "register":
                register(stub)
            elif words[0] == "report":
                ns, name, prop, value = words[1:5]
                twin = api_pb2.Twin(propertyName=prop,
                                    reported=api_pb2.TwinProperty(value=value,
                                                                  metadata={"type": "int"}),
                                    observedDesired=api_pb2.TwinProperty(value=""))
                start = time.time()
                stub.ReportDeviceStatus(api_pb2.ReportDeviceStatusRequest(
                    deviceName=name, deviceNamespace=ns,
                    reportedDevice=api_pb2.DeviceStatus(twins=[twin])), timeout=20)
                say(answer="report", ok=True, seconds=time.time() - start)
            elif words[0] == "state":
                ns, name, state = words[1:4]
                stub.ReportDeviceStates(api_pb2.ReportDeviceStatesRequest(
                    deviceName=name, deviceNamespace=ns, state=state), timeout=20)
                say(answer="state", ok=True)
            elif words[0] == "raw":
                call = channel.unary_unary("/v1beta1.DeviceManagerService/ReportDeviceStatus",
                                           request_serializer=None, response_deserializer=None)
                call(bytes.fromhex(words[1]), timeout=20)
                say(answer="raw", ok=True)
            elif words[0] == "big":
                ns, name, size = words[1], words[2], int(words[3])
                twin = api_pb2.Twin(propertyName="temp",
                                    reported=api_pb2.TwinProperty(value="9" * size))
                stub.ReportDeviceStatus(api_pb2.ReportDeviceStatusRequest(
                    deviceName=name, deviceNamespace=ns,
                    reportedDevice=api_pb2.DeviceStatus(twins=[twin])), timeout=20)
                say(answer="big", ok=True)
            elif words[0] == "burst":
                ns, name, count = words[1], words[2], int(words[3])
                twin = api_pb2.Twin(propertyName="temp",
                                    reported=api_pb2.TwinProperty(value="7"))
                request = api_pb2.ReportDeviceStatusRequest(
                    deviceName=name, deviceNamespace=ns,
                    reportedDevice=api_pb2.DeviceStatus(twins=[twin]))
                calls = [stub.ReportDeviceStatus.future(request, timeout=20) for _ in range(count)]
                codes = {}
                for call in calls:
                    try:
                        call.result()
                        codes["OK"] = codes.get("OK", 0) + 1
                    except grpc.RpcError as error:
                        codes[error.code().name] = codes.get(error.code().name, 0) + 1
                say(answer="burst", codes=codes)
            elif words[0] == "twins":
                ns, name, count = words[1], words[2], int(words[3])
                twins = [api_pb2.Twin(propertyName=f"p{i}",
                                      reported=api_pb2.TwinProperty(value="1"))
                         for i in range(count)]
                stub.ReportDeviceStatus(api_pb2.ReportDeviceStatusRequest(
                    deviceName=name, deviceNamespace=ns,
                    reportedDevice=api_pb2.DeviceStatus(twins=twins)), timeout=20)
                say(answer="twins", ok=True)
            elif words[0] == "try":
                request = report_request(*words[2:6])
                say(answer="try", **timed(stub.ReportDeviceStatus, request, float(words[1])))
            elif words[0] == "fresh":
                request = report_request(*words[2:6])
                own = node_channel(own_connection=True)
                answer = timed(api_pb2_grpc.DeviceManagerServiceStub(own).ReportDeviceStatus,
                               request, float(words[1]))
                own.close()
                say(answer="fresh", **answer)
            elif words[0] == "hold":
                call = channel.stream_unary(
                    "/v1beta1.DeviceManagerService/ReportDeviceStatus",
                    request_serializer=api_pb2.ReportDeviceStatusRequest.SerializeToString,
                    response_deserializer=api_pb2.ReportDeviceStatusResponse.FromString)
                release.clear()

                def requests():
                    release.wait(60)
                    return
                    yield

                held.extend(call.future(requests(), timeout=60) for _ in range(int(words[1])))
                say(answer="hold", ok=True)
            elif words[0] == "release":
                release.set()
                codes = {}
                for call in held:
                    try:
                        call.result()
                        name = "OK"
                    except grpc.RpcError as error:
                        name = error.code().name
                    codes[name] = codes.get(name, 0) + 1
                held.clear()
                say(answer="release", codes=codes)
            elif words[0] == "slow":
                with lock:
                    slow[0] = float(words[1])
                say(answer="slow", ok=True)
            elif words[0] == "held":
                say(answer="held", devices=sorted(devices),
                    desired={k: describe(d)["desired"] for k, d in devices.items()})
        except grpc.RpcError as error:
            say(answer=words[0], **status(error))
    server.stop(0)


main()
