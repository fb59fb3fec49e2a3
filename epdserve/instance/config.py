"""`InstanceConfig`: everything one instance process needs, validated on construction.

Its fields are the `epdserve instance` flags (epdserve/settings.py): `add_instance_args(parser)`
adds them, `from_args(args)` reads them back, and `epdserve launch` forwards the ones it offers by
field. Fields `same_as` an `EngineConfig` field are the engine's setting, handed on unchanged; the
`kv_*` fields are `KVTransferConfig`'s settings, handed to the KV pairs (`kv_transfer`).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from epdserve.engine.config import EngineConfig
from epdserve.roles import normalize_roles
from epdserve.instance.affinity import parse_core_list
from epdserve.instance.colocation import POLICIES, check_policy
from epdserve.settings import add_flags, check_settings, from_flags, read_env, same_as, setting, shared_values
from epdserve.transfer.kv.config import KVTransferConfig

if TYPE_CHECKING:  # network.py imports torch.distributed; `--help` must not
    from epdserve.transfer.kv.network import PairNetwork

SWITCH_OVERLAP = ("auto", "on", "off")
COLOCATION_HELP = (
    "how E shares the device with P/D: split = fixed shares (disjoint cores, NPU stream core limits); yield = every "
    "core for whoever has work, E at the lowest priority (SCHED_IDLE threads) so P/D steps take the CPU cores back "
    "at once; on NPU unlimited streams with no precedence (torch_npu streams carry no priority, "
    "docs/npu-colocation.md). Applies to co-located workers and to an E-only instance sharing its machine")
SWITCH_OVERLAP_HELP = (
    "role switches (SwitchRoles): on = start the new roles' workers beside the old ones, which finish what they hold "
    "while the new ones take new work (no gap for the stages kept, but two KV caches for the switch's duration); "
    "off = drain first, then rebuild (the stages wait out the drain); auto (default) = on for CPU instances, on an "
    "accelerator when its spare memory holds 1.25x the new workers' KV caches")


@dataclass
class InstanceConfig:
    roles: str = setting(help="stages this process runs: E, P, D, EP, ED, PD or EPD", required=True)
    model: str = same_as(EngineConfig, "model")
    scheduler: str | None = setting(
        None, help="the scheduler's internal address host:port to register with; several, comma-separated, to "
                   "serve them all (omit: standalone)")
    mm_store: str | None = setting(None, help="MM Store URL: redis://host:port[/db], redis+cluster://h:p,h:p,... "
                                              "or redis+sentinel://h:p,.../service (omit: features stay in the process)")
    device: str = same_as(EngineConfig, "device")
    dtype: str = same_as(EngineConfig, "dtype")
    host: str = setting("127.0.0.1", help="address others reach this instance (and its KV rendezvous) at")
    bind_host: str | None = setting(
        None, help="interface to bind (default: --host); beyond loopback it needs EPDSERVE_CLUSTER_TOKEN or "
                   "mutual TLS, else the instance refuses to start (see --insecure)")
    port: int = setting(0, check=(">=", 0), help="gRPC port (0: a free port)")
    instance_id: str | None = setting(None, help="default: opaque, <roles>-<random> (instance/identity.py)")
    cores: list[int] | None = setting(None, help="CPU cores of this instance, e.g. 0-7,16 (default: all allowed)",
                                      type=parse_core_list)
    split_cores: bool = setting(True, negate="--no-core-split",
                                help="co-located workers share the device unpartitioned (default: disjoint CPU core "
                                     "sets, or NPU stream core limits)")
    encode_core_share: float = setting(
        0.5, help="E worker's share of the cores (CPU) or AI/Vector Cores (NPU) when co-located")
    device_core_share: float | None = setting(
        None, help="NPU: this process's share of its device's AI Cores and Vector Cores (torch.npu.set_device_limit, "
                   "once per process), e.g. 0.3 for an E process beside a P process at 0.7 on one NPU; not set where "
                   "one of its operators ignores core limits (docs/npu-colocation.md). Default: the whole device")
    npu_core_limits: bool = setting(
        False, help="NPU: set core limits (set_device_limit, then set_stream_limit) although the stages' aten "
                    "operators are not verified to keep to them; op-plugin documents the API for Atlas A2/A3 training "
                    "products and warns that limited streams running non-Ascend C operators may hang. Opt in only "
                    "after `epdserve bench colocation --device npu` passes on this hardware. Default: off")
    stream_interval_ms: float = setting(
        0.0, check=(">=", 0),
        help="after a request's first token, gather its tokens for up to this long into one stream message "
                  "(fewer messages per token through scheduler and client; the first token is never held). "
                  "0 (default): send at once, joining only tokens already queued")
    colocation: str = setting("split", choices=POLICIES, help=COLOCATION_HELP)
    slo_tpot_ms: float = same_as(EngineConfig, "slo_tpot_ms")
    step_budget: bool = same_as(EngineConfig, "step_budget")
    step_budget_bank: float = same_as(EngineConfig, "step_budget_bank")
    step_budget_horizon: int = same_as(EngineConfig, "step_budget_horizon")
    enforce_eager: bool = same_as(EngineConfig, "enforce_eager")
    tensor_parallel_size: int = same_as(EngineConfig, "tensor_parallel_size")
    quantization: str | None = same_as(EngineConfig, "quantization")
    grammar_cache_bytes: int = same_as(EngineConfig, "grammar_cache_bytes")
    max_grammar_bytes: int = same_as(EngineConfig, "max_grammar_bytes")
    grammar_compile_timeout_s: float = same_as(EngineConfig, "grammar_compile_timeout_s")
    enable_prefix_caching: bool = same_as(EngineConfig, "enable_prefix_caching")
    kv_cache_bytes: int = same_as(EngineConfig, "kv_cache_bytes")
    block_size: int | None = same_as(EngineConfig, "block_size")
    max_num_seqs: int = same_as(EngineConfig, "max_num_seqs")
    scheduling_policy: str = same_as(EngineConfig, "scheduling_policy")
    max_num_batched_tokens: int = same_as(EngineConfig, "max_num_batched_tokens")
    max_model_len: int | None = same_as(EngineConfig, "max_model_len")
    encode_token_budget: int = same_as(EngineConfig, "encode_token_budget")
    feature_wait_s: float = same_as(EngineConfig, "feature_wait_s")
    pipelined_prefill: bool = same_as(EngineConfig, "pipelined_prefill")
    encode_per_item: bool = same_as(EngineConfig, "encode_per_item")
    kv_timeout_s: float = same_as(KVTransferConfig, "timeout_s")
    kv_connect_timeout_s: float = same_as(KVTransferConfig, "connect_timeout_s")
    kv_hop: str = same_as(KVTransferConfig, "hop")
    kv_pair_rebuilds: int = same_as(KVTransferConfig, "max_pair_rebuilds")
    kv_pair_rebuild_window_s: float = same_as(KVTransferConfig, "pair_rebuild_window_s")
    grpc_threads: int = setting(128, check=(">=", 1), help="calls this instance serves at once")
    feature_cache_bytes: int = setting(
        4 << 30, flag="--feature-cache-mb", check=(">=", 1), to_field=lambda mb: mb << 20, from_field=lambda b: b >> 20,
        help="P: image features kept in this process, LRU, MiB; the MM Store holds the rest")
    switch_overlap: str = setting("auto", choices=SWITCH_OVERLAP, help=SWITCH_OVERLAP_HELP)

    def __post_init__(self):
        self.roles = normalize_roles(self.roles)
        if not self.model:
            raise ValueError("model is required")
        check_policy(self.colocation)
        read_env(self)  # dtype not given: $EPDSERVE_DTYPE
        check_settings(self)  # the bounds and choices declared on the fields (the engine's carried by same_as)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if not 0.0 < self.encode_core_share < 1.0:
            raise ValueError(f"encode_core_share must be in (0, 1), got {self.encode_core_share}")
        if self.device_core_share is not None and not 0.0 < self.device_core_share <= 1.0:
            raise ValueError(f"device_core_share must be in (0, 1], got {self.device_core_share}")
        if self.scheduler is not None and (not self.schedulers or any(":" not in s for s in self.schedulers)):
            raise ValueError(f"scheduler must be host:port (several: comma-separated), got {self.scheduler!r}")

    def kv_transfer(self, network: PairNetwork | None = None) -> KVTransferConfig:
        """The config of this instance's KV pairs: its `kv_*` settings (`same_as` KVTransferConfig's),
        reached through `network`."""
        return KVTransferConfig(**shared_values(self, KVTransferConfig), network=network)

    @property
    def schedulers(self) -> list[str]:
        """Every scheduler this instance registers with (it serves them all)."""
        return [s.strip() for s in (self.scheduler or "").split(",") if s.strip()]


def add_instance_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, InstanceConfig)


def from_args(a: argparse.Namespace) -> InstanceConfig:
    return from_flags(InstanceConfig, a)
