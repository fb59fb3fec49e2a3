"""Another rank's part of a tensor-parallel instance's KV connector.

Rank 0 runs the connector (send_connector.py / recv_connector.py); its `span_ranks` hands it a
way to tell the instance's other ranks what they must do, and each of those ranks (engine/tp_rank.py)
applies the messages here to an endpoint over its own cache and KV heads:
    ("part", RankPart)   first: the class the rank builds over its cache (pickled by name, so the
                         engine never imports this package: the connector is its seam)
    ("setup", "send" | "recv", model KV heads, degree, (config, network parts))
        build this rank's KVSender / KVReceiver (`rank_config`: the config without rank 0's
        in-process store; the network rebuilt from its host, token and certificate files)
    ("connect", peer, rank 0's rendezvous)   join the pair as this rank (group rank + own rank)
    ("follow", [OpenedBatch])                send this rank's links of the batches rank 0 opened,
                                             in the forward that follows (sender.py `follow`)
    ("abort", reason)                        rank 0's forward failed midway
    ("close",)
The messages travel over the rank's private socket (pickled, as the forward's inputs do).
"""
from __future__ import annotations

from dataclasses import replace

from epdserve.transfer.kv.config import KVTransferConfig
from epdserve.kv_layout import KvShare
from epdserve.transfer.kv.network import PairNetwork
from epdserve.transfer.kv.receiver import KVReceiver
from epdserve.transfer.kv.sender import KVSender


def rank_config(config: KVTransferConfig) -> tuple[KVTransferConfig, dict | None]:
    """The config as another rank rebuilds it (its network without this process's store)."""
    net = config.network
    return replace(config, network=None), (net.for_other_rank() if net is not None else None)


class RankPart:
    """Another rank than 0's part of the connector: its endpoint (built by "setup"), the messages
    applied to it, and — as this rank's forward's connector — the layer hook that sends."""

    def __init__(self, cache, platform, rank: int):
        self.cache, self.platform, self.rank = cache, platform, rank
        self.endpoint: KVSender | KVReceiver | None = None

    def apply(self, message: tuple) -> None:
        kind, *body = message
        if kind == "setup":
            role, num_kv_heads, degree, (config, net) = body
            config = replace(config, network=PairNetwork.from_rank_parts(net) if net is not None else None)
            cls = KVSender if role == "send" else KVReceiver
            self.endpoint = cls(self.cache, self.platform, config, KvShare(num_kv_heads, degree, self.rank))
        elif self.endpoint is None:
            raise ValueError(f"KV message {kind!r} before setup")
        elif kind == "connect":
            peer, rdzv = body
            self.endpoint.connect(peer, rdzv.for_rank(rdzv.rank + self.rank))
        elif kind == "follow":
            self.endpoint.follow(body[0])
        elif kind == "abort":
            self.endpoint.abort_batch(body[0])
        elif kind == "close":
            self.endpoint.close()
        else:
            raise ValueError(f"unknown KV message {kind!r}")

    # ------------------------------------------------------------------ this rank's forward
    def start_load_kv(self) -> None:
        pass

    def wait_for_layer_load(self, layer: int) -> None:
        pass

    def save_kv_layer(self, layer: int) -> None:
        if isinstance(self.endpoint, KVSender):
            self.endpoint.save_layer(layer)

    def wait_for_save(self) -> None:
        pass

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
