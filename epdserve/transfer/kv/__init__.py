"""Layerwise P→D KV transfer over torch.distributed (gloo on CPU, NCCL on CUDA, HCCL on NPU).

Owns the prefill→decode hop: each P–D pair builds its own process group — every rank of both
instances, whatever their tensor-parallel degrees — over the prefill side's pair store (`PairStoreHost`, in process; decode peers reach it through the
prefill instance's authenticated `KvStore` RPC: `PairNetwork`, `PairRendezvous`,
`PairConnection`; no listening store); the prefill side's
`KVSender` sends each layer's KV of a batch while the next layer computes; the decode side's
`KVReceiver` receives it straight into blocks it reserved beforehand. The engine drives them
through its `KVConnector` seam: `LayerwiseSendConnector` (prefill role) and
`LayerwiseRecvConnector` (decode role). Progress is a `TransferState` polled by the engine loop
(no callbacks).

Lifecycle of one request's transfer, on both sides:
    BOOTSTRAPPING  registered (D: blocks reserved, waiting for P's batch header;
                   P: batch header published, no layer sent yet)
    TRANSFERRING   layers flowing
    DONE           D: every layer is in its blocks; P: D acknowledged that
    FAILED         peer died, stalled past the timeout, or rejected the request; the owner
                   frees the request's blocks (nothing of ours still reads or writes them)

One sentence per module:
- config.py          KVTransferConfig: timeouts, polling period, how pairs are reached
- network.py         PairNetwork: how this process reaches its P–D pairs (pair store, data sockets)
- pair_names.py      pair names "<P id>><D id>/g<n>", one per P–D pair and rebuild
- host_hop.py        the host-staged hop: gloo between host buffers, for a P and a D on one accelerator
- pair.py            PairConnection: one rank's side of a pair's process group and its header store
- links.py           which P rank sends which KV heads to which D rank, for any two degrees
- pair_store.py      PairStoreHost: the in-process key-value store a prefill instance keeps for its pairs
- store_view.py      PairStore: one pair's namespace of a pair store, as a torch.distributed.Store
- store_client.py    PairStoreClient: another process's view of a PairStoreHost, over the KvStore RPC
- store_service.py   the KvStore RPC's server side: one request applied to a PairStoreHost
- rendezvous.py      RendezvousServer: a pair store on a gRPC port of its own (tools, not instances)
- messages.py        typed messages: the pair rendezvous and the per-batch header
- layout.py          the wire order of a batch's KV and the tensor views that feed it
- endpoint.py        PairEndpoint: what sender and receiver share, one channel per peer, the rank's KV share
- sender.py          KVSender: the prefill side, each batch's KV layer by layer to its decode peers
- receiver.py        KVReceiver: the decode side, a request's KV layer by layer into reserved blocks
- send_connector.py  LayerwiseSendConnector: the prefill role of the engine's KV connector
- recv_connector.py  LayerwiseRecvConnector: the decode role of the engine's KV connector
- rank_part.py       RankPart: a tensor-parallel instance's other ranks' part of either connector
- state.py           transfer and pair states the engine loop polls, and TransferCounters
- checks.py          deterministic KV contents and digests, to check a transfer bit for bit
"""
import importlib

# name -> the module that defines it, imported on first use (PEP 562): `kv.config` (the settings
# `--help` reads) must load without torch, which the other modules import.
_WHERE = {
    "KVTransferConfig": "config", "BatchHeader": "messages", "PairRendezvous": "messages",
    "RequestEntry": "messages", "PairNetwork": "network", "PairConnection": "pair", "PairStoreHost": "pair_store",
    "StoreFull": "pair_store", "KVReceiver": "receiver", "RecvRequest": "receiver",
    "LayerwiseRecvConnector": "recv_connector", "RendezvousServer": "rendezvous",
    "LayerwiseSendConnector": "send_connector", "StalePairError": "send_connector", "KVSender": "sender",
    "SendRequest": "sender", "PairState": "state", "TransferState": "state", "TransferStatus": "state",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
