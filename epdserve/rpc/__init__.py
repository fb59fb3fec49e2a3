"""The wire: generated protobuf/gRPC modules of package `epdserve.v1`, and gRPC server helpers.

Importing this package imports `epdserve.proto_gen`, which finds the generated modules (shipped in
a wheel, or generated once per interpreter into a cache folder for a source checkout: its codegen).
Use the modules from here, never from epdserve.proto_gen directly:

    from epdserve.rpc import common_pb2, serve_pb2, serve_pb2_grpc, instance_pb2, instance_pb2_grpc

- common.proto   SamplingParams, Media, Usage, StageTimings, Load, InstanceStatus, ...
- serve.proto    the public `EPDServe` service (clients -> scheduler)
- instance.proto `Registry` (instances -> scheduler) and `Instance` (scheduler -> instances)
- servers.py     health + reflection on a server and its serving status
- ranges.py      the numeric ranges of a public generation request, the rules both fronts check
- video_spec.py  a video's per-request sampling options ↔ the `VideoSpec` message
- choice_streams.py  one stream of n choices (OpenAI's `n`) as n streams, as both fronts read it

Of epdserve it imports only proto_gen, net and request_errors: nothing of the engine or above (the
conversion of sampling params to the engine's type is `epdserve.instance.sampling_wire`).
"""
from epdserve.proto_gen.epdserve.v1 import (
    common_pb2,
    instance_pb2,
    instance_pb2_grpc,
    serve_pb2,
    serve_pb2_grpc,
)

SERVE_SERVICE = "epdserve.v1.EPDServe"
REGISTRY_SERVICE = "epdserve.v1.Registry"
INSTANCE_SERVICE = "epdserve.v1.Instance"

__all__ = [
    "INSTANCE_SERVICE",
    "REGISTRY_SERVICE",
    "SERVE_SERVICE",
    "common_pb2",
    "instance_pb2",
    "instance_pb2_grpc",
    "serve_pb2",
    "serve_pb2_grpc",
]
