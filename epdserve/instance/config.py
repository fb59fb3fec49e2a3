"""`InstanceConfig`: everything one instance process needs, validated on construction.

`add_instance_args(parser)` / `from_args(args)` map it to and from the `epdserve instance`
command line (the launcher builds that command line from its own config).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from epdserve.engine.roles import normalize_roles
from epdserve.instance.affinity import parse_core_list
from epdserve.instance.colocation import POLICIES, check_policy

SWITCH_OVERLAP = ("auto", "on", "off")


@dataclass
class InstanceConfig:
    roles: str
    model: str
    scheduler: str | None = None  # host:port of the scheduler's Registry (several: comma-separated); None: standalone
    mm_store: str | None = None  # redis:// URL; None: features stay in the process
    device: str = "cpu"
    dtype: str = "auto"
    host: str = "127.0.0.1"  # the address others reach this instance (and its KV rendezvous) at
    bind_host: str | None = None  # interface the gRPC server binds (default: host)
    port: int = 0  # 0: a free port
    instance_id: str | None = None  # default: opaque, "<roles>-<random>" (instance/identity.py)
    cores: list[int] | None = None  # CPU cores of this instance (default: all it may use)
    split_cores: bool = True  # co-located workers partition the device (CPU cores; NPU AI/Vector Cores)
    encode_core_share: float = 0.5  # E worker's share of the device when co-located
    stream_interval_ms: float = 0.0  # hold a running request's stream messages this long to send tokens together
    colocation: str = "split"  # co-location policy: split | yield | slo (instance/colocation.py)
    core_lease: str | None = None  # slo on CPU: the lease arbiter's socket (the launcher's); None: own, if co-located
    slo_tpot_ms: float = 100.0  # slo: decode steps are paced to keep TPOT under this
    kv_cache_bytes: int = 256 << 20
    block_size: int | None = None  # tokens per KV block; default: the platform's (CPU/CUDA 16, NPU 128)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    encode_token_budget: int = 1024  # E: vision tokens encoded per engine step (EngineConfig.encode_token_budget)
    feature_wait_s: float = 5.0  # P: bounded wait for features E was asked to send
    kv_timeout_s: float = 30.0
    kv_connect_timeout_s: float = 60.0
    grpc_threads: int = 128
    feature_cache_bytes: int = 4 << 30  # P: image features kept in this process (LRU by bytes)
    switch_overlap: str = "auto"  # role switch: new workers beside the draining old ones (instance/role_switch.py)

    def __post_init__(self):
        self.roles = normalize_roles(self.roles)
        if not self.model:
            raise ValueError("model is required")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if not 0.0 < self.encode_core_share < 1.0:
            raise ValueError(f"encode_core_share must be in (0, 1), got {self.encode_core_share}")
        check_policy(self.colocation)
        if self.switch_overlap not in SWITCH_OVERLAP:
            raise ValueError(f"switch_overlap must be one of {', '.join(SWITCH_OVERLAP)}, got {self.switch_overlap!r}")
        if self.slo_tpot_ms <= 0:
            raise ValueError(f"slo_tpot_ms must be > 0, got {self.slo_tpot_ms}")
        if self.stream_interval_ms < 0:
            raise ValueError(f"stream_interval_ms must be >= 0, got {self.stream_interval_ms}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        for name in ("kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens", "grpc_threads", "feature_cache_bytes",
                     "encode_token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.feature_wait_s < 0 or self.kv_timeout_s <= 0 or self.kv_connect_timeout_s <= 0:
            raise ValueError("feature_wait_s must be >= 0 and the KV timeouts > 0")
        if self.scheduler is not None and (not self.schedulers or any(":" not in s for s in self.schedulers)):
            raise ValueError(f"scheduler must be host:port (several: comma-separated), got {self.scheduler!r}")

    @property
    def schedulers(self) -> list[str]:
        """Every scheduler this instance registers with (it serves them all)."""
        return [s.strip() for s in (self.scheduler or "").split(",") if s.strip()]


def add_instance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--roles", required=True, help="stages this process runs: E, P, D, EP, ED, PD or EPD")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--scheduler", default=None,
                   help="scheduler host:port to register with; several, comma-separated, to serve them all "
                        "(omit: standalone)")
    p.add_argument("--mm-store", default=None, help="MM Store URL, redis://host:port[/db]")
    p.add_argument("--device", default="cpu", help="cpu | cuda[:N] | npu[:N] | auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--host", default="127.0.0.1", help="address others reach this instance at")
    p.add_argument("--bind-host", default=None,
                   help="interface to bind (default: --host); beyond loopback it needs EPDSERVE_CLUSTER_TOKEN or "
                        "mutual TLS, else the instance refuses to start (see --insecure)")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: a free port)")
    p.add_argument("--instance-id", default=None)
    p.add_argument("--cores", default=None, help="CPU cores of this instance, e.g. 0-7,16 (default: all allowed)")
    p.add_argument("--no-core-split", action="store_true",
                   help="co-located workers share the device unpartitioned (default: disjoint CPU core sets, "
                        "or NPU stream core limits)")
    p.add_argument("--encode-core-share", type=float, default=0.5,
                   help="E worker's share of the cores (CPU) or AI/Vector Cores (NPU) when co-located")
    p.add_argument("--stream-interval-ms", type=float, default=0.0,
                   help="after a request's first token, gather its tokens for up to this long into one stream "
                        "message (fewer messages per token through scheduler and client; the first token is never "
                        "held). 0 (default): send at once, joining only tokens already queued")
    p.add_argument("--colocation", choices=POLICIES, default="split",
                   help="how E shares the device with P/D: split = fixed shares (disjoint cores, NPU stream core "
                        "limits); yield = every core for whoever has work, E at the lowest priority (SCHED_IDLE "
                        "threads on CPU, a low-priority stream on NPU) so P/D steps take the cores back at once. "
                        "slo = every core for one stage at a time in SLO order (CPU: a lease on the machine's cores; "
                        "a decode step due by its TPOT pacing first, then prefill, then encode, which give way at "
                        "the next layer; on NPU unlimited streams, P/D first; experimental: 0.31-0.37x monolithic's "
                        "goodput for EP-D, E-P-D, ED-P on a 2-core CPU host, README 'Co-location policy'). "
                        "Applies to co-located workers and to an E-only instance sharing its machine")
    p.add_argument("--core-lease", default=None, metavar="PATH",
                   help="slo on CPU: the Unix socket of the machine's core-lease arbiter (epdserve launch passes "
                        "its own); omitted, an instance with co-located workers runs an arbiter for them alone")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0,
                   help="slo: the TPOT SLO decode steps are paced to keep (default 100 ms)")
    p.add_argument("--kv-cache-mb", type=int, default=256, help="KV cache size per P/D worker (MiB)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: the platform's: 16 on CPU/CUDA, 128 on NPU, as its kernels want)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--encode-token-budget", type=int, default=1024,
                   help="E: vision tokens (after the spatial merge) encoded per engine step, across requests, "
                        "least recently served request first, so a many-image request or a long video does not hold "
                        "E while others wait; a video over it is encoded a few temporal patches per step (exact for "
                        "Qwen2-VL / Qwen2.5-VL / Qwen3-VL; other models encode each item whole), an image alone over "
                        "it in a step of its own (default 1024)")
    p.add_argument("--feature-wait-s", type=float, default=5.0, help="P: wait this long for E's features, then recompute")
    p.add_argument("--kv-timeout-s", type=float, default=30.0)
    p.add_argument("--kv-connect-timeout-s", type=float, default=60.0)
    p.add_argument("--grpc-threads", type=int, default=128, help="calls this instance serves at once (default 128)")
    p.add_argument("--feature-cache-mb", type=int, default=4096,
                   help="P: image features kept in this process, LRU (MiB, default 4096); the MM Store holds the rest")
    p.add_argument("--switch-overlap", choices=SWITCH_OVERLAP, default="auto",
                   help="role switches (SwitchRoles): on = start the new roles' workers beside the old ones, which "
                        "finish what they hold while the new ones take new work (no gap for the stages kept, but two "
                        "KV caches for the switch's duration); off = drain first, then rebuild (the stages wait out "
                        "the drain); auto (default) = on for CPU instances, on an accelerator when its spare memory "
                        "holds 1.25x the new workers' KV caches; never under --colocation slo (one core lease per "
                        "instance)")


def from_args(a: argparse.Namespace) -> InstanceConfig:
    return InstanceConfig(
        roles=a.roles, model=a.model, scheduler=a.scheduler, mm_store=a.mm_store, device=a.device,
        dtype=a.dtype, host=a.host, bind_host=a.bind_host, port=a.port, instance_id=a.instance_id,
        cores=parse_core_list(a.cores) if a.cores else None, split_cores=not a.no_core_split,
        encode_core_share=a.encode_core_share, colocation=a.colocation, core_lease=a.core_lease, slo_tpot_ms=a.slo_tpot_ms,
        stream_interval_ms=a.stream_interval_ms, kv_cache_bytes=a.kv_cache_mb << 20, block_size=a.block_size,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len, encode_token_budget=a.encode_token_budget, feature_wait_s=a.feature_wait_s,
        kv_timeout_s=a.kv_timeout_s,
        kv_connect_timeout_s=a.kv_connect_timeout_s, grpc_threads=a.grpc_threads,
        feature_cache_bytes=a.feature_cache_mb << 20, switch_overlap=a.switch_overlap,
    )
