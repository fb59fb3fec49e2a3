"""`LaunchSettings`: every `epdserve launch` option, declared once as a field (epdserve/settings.py).

Each field is a flag and a `--config` YAML key (either spelling). Its default is in the field;
the parser's defaults are all None ("not on the command line"), so `merged_options` can take a
flag, else the file's value, else the field's default. The instance settings launch offers
(`FORWARDED`) are `InstanceConfig`'s own fields: the same flag, help and default, passed on to
every `epdserve instance` by field when given (left out, the instance's default applies). The
scheduler settings it offers (`SCHEDULER_FORWARDED`: `SchedulerConfig`'s and the role controller's
fields) go to `epdserve scheduler` the same way; a setting both take (`--max-model-len`,
`--slo-tpot-ms`) is one flag passed on to both, and the SLO pair also reaches the planner of
`--mode auto` (`slo_of`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epdserve.commands import FlagsArg
from epdserve.engine.config import EngineConfig
from epdserve.instance.config import InstanceConfig
from epdserve.instance.modes import MODES
from epdserve.scheduler.config import SchedulerConfig
from epdserve.scheduler.controller import ControllerConfig
from epdserve.security.exposure import INSECURE_HELP
from epdserve.settings import add_flags, dest, flag_choices, flag_defaults, forward_argv, same_as, setting, settings_of
from epdserve.slo import SLO

STOP_MARGIN_S = 20.0  # beyond --drain-timeout: the instances' own margin (5), the scheduler (5), the MM Store (5)

# InstanceConfig fields launch offers, forwarded to every instance (max_model_len also to the scheduler)
FORWARDED = ("kv_cache_bytes", "max_num_seqs", "block_size", "max_model_len", "feature_wait_s", "pipelined_prefill",
             "encode_per_item",
             "encode_token_budget", "colocation", "stream_interval_ms", "slo_tpot_ms", "step_budget",
             "step_budget_bank", "step_budget_horizon",
             "enable_prefix_caching", "enforce_eager", "kv_hop", "tensor_parallel_size", "scheduling_policy")

# scheduler settings launch offers, by class, forwarded to the scheduler (max_model_len and slo_tpot_ms
# are instance settings too: one flag, passed on to both)
SCHEDULER_FORWARDED = ((SchedulerConfig, ("max_model_len", "routing")),
                       (ControllerConfig, ("slo_ttft_ms", "slo_tpot_ms")))

_INTERNAL = ("internal_port", "internal_host", "internal_tls_cert", "internal_tls_key", "insecure", "internal_tls_ca")
INTERNAL_GROUP = (
    "internal port (scheduler <-> instances)",
    "The Registry is never on the public --port. The cluster token comes from EPDSERVE_CLUSTER_TOKEN, else launch "
    "makes a random one; every child gets it in its environment: instances present it to register and the "
    "scheduler on every call to them.")


@dataclass
class LaunchSettings:
    mode: str | None = setting(
        None, choices=(*MODES, "auto"),
        help="deployment mode; auto: the planner picks the mode and E:P:D split for --expected-workload from a profile "
             "of the model, and the scheduler's controller moves instances between roles as the traffic changes "
             "(experimental: on a 2-core CPU host it ties P-D and made no switch, README 'Traffic that shifts, and "
             "--mode auto')")
    expected_workload: str | None = setting(
        None, help="auto: the traffic to plan the start for, a `bench serve` preset (default mixed)")
    expected_rate: float | None = setting(None, help="auto: its request rate (default: the preset's busier rate)")
    profile: str | None = setting(
        None, help="auto: `epdserve profile` JSON(s) of this model on this machine, comma-separated, one per "
                   "tensor-parallel degree used (default: measured once per degree and cached "
                   "in ~/.cache/epdserve/profiles)")
    model: str | None = setting(
        None, help="checkpoint directory (default: a built-in tiny random-weight demo checkpoint, built once into "
                   "$EPDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/epdserve, else ~/.cache/epdserve: it shows the "
                   "deployment working, its answers are noise)")
    encode: int = setting(1, help="E workers: in EP-D / ED-P the co-located ones count and the rest are "
                                  "E-only instances; monolithic ignores it")
    prefill: int = setting(1, help="P instances (EP / PD / EPD instances in those modes)")
    decode: int = setting(1, help="D instances (ED instances in ED-P)")
    encode_tensor_parallel_size: int = setting(
        1, check=(">=", 1),
        help="tensor-parallel degree of the E-only instances (E-P-D, E-PD, EP-D's extra encoders): the vision "
             "encoder is small, so E scales by --encode replicas at 1 (EPD-Serve; vLLM's mm_encoder_tp_mode "
             "\"data\"); the instances that hold the language model take --tensor-parallel-size, or the prefill "
             "or decode degree below. Each instance gets as many accelerators as its degree")
    prefill_tensor_parallel_size: int = setting(
        0, check=(">=", 0),
        help="tensor-parallel degree of the instances that prefill for a decode elsewhere (P, EP, P+E: the P "
             "pool of E-P-D, EP-D, ED-P, P-D); 0: --tensor-parallel-size. With the decode degree it must be a "
             "pair the P->D KV hop carries, else launch refuses before anything starts (docs/tensor-parallel.md, "
             "e.g. an Atlas 800I A2: E at 1 on NPUs 0-1, P at 2 on 2-3, D at 4 on 4-7)")
    decode_tensor_parallel_size: int = setting(
        0, check=(">=", 0),
        help="tensor-parallel degree of the instances that decode what was prefilled elsewhere (D, ED); 0: "
             "--tensor-parallel-size. Instances that prefill and decode (PD, EPD: monolithic, E-PD) always take "
             "--tensor-parallel-size")
    mm_store: str | None = setting(None, help="MM Store URL: redis://host:port, redis+cluster://h:p,h:p,... or "
                                              "redis+sentinel://h:p,.../service (default: a private local server)")
    mm_store_max_mb: int = setting(4096, help="memory bound of the private MM Store server, least recently used "
                                              "features evicted (MiB)")
    host: str = setting("127.0.0.1", help="address the scheduler binds and instances advertise")
    port: int = setting(0, help="scheduler's public port (default 0: a free port)")
    device: str = same_as(EngineConfig, "device")
    devices: str | None = setting(None, help="accelerator ids handed to instances round-robin, e.g. 0,1,2,3 "
                                            "(default: every visible device, one per instance)")
    pin_instances: bool = setting(False, help="CPU: give each instance a disjoint share of the cores (default: all "
                                              "share them)")
    instance_args: list[str] = setting(default_factory=list, action=FlagsArg,
                                       help="extra `epdserve instance` flags, one string (may start with --)")
    scheduler_args: list[str] = setting(
        default_factory=list, action=FlagsArg,
        help="extra `epdserve scheduler` flags, one string (may start with --), e.g. --scheduler-args "
             "\"--allow-remote-images\"; they override launch's own")
    log_dir: str | None = setting(None, help="where child logs go (kept); default: a temp dir")
    ready_timeout_s: float = setting(600.0, help="give up starting after this long (600)")
    http_port: int = setting(
        0, help="the scheduler also serves the OpenAI-compatible HTTP API here, by default on a free port (0), "
                "printed as http=URL in the ready line; -1: no HTTP front, gRPC only; the API key, if any, comes "
                "from EPDSERVE_API_KEY")
    served_model_name: str | None = setting(
        None, help="the model id the HTTP API lists in /v1/models and accepts in requests (default: --model as given)")
    tls_cert: str | None = setting(
        None, help="PEM certificate: the scheduler serves its public gRPC and HTTP ports over TLS; the launcher's "
                   "readiness probe trusts it (self-signed, or a chain file ending with its CA)")
    tls_key: str | None = setting(None, help="PEM private key of --tls-cert")
    internal_port: int | None = setting(
        None, help="the port of the scheduler's instance Registry (default: a free one); instances register there")
    internal_host: str | None = setting(
        None, help="interface of --internal-port, e.g. this machine's cluster-network address (default --host); "
                   "instances dial it (--host when it is 0.0.0.0 / ::)")
    internal_tls_cert: str | None = setting(
        None, help="mutual TLS between scheduler and instances: the PEM certificate the scheduler and every instance "
                   "present (its SAN must name --host)")
    internal_tls_key: str | None = setting(None, help="PEM private key of --internal-tls-cert")
    insecure: bool = setting(False, help=INSECURE_HELP)
    internal_tls_ca: str | None = setting(
        None, help="PEM CA both sides trust: the Registry and the instances' ports refuse a peer whose certificate "
                   "does not chain to it")
    drain_timeout: float = setting(
        10.0, help="on stop, instances let calls in flight finish for up to this many seconds; the "
                   f"launcher exits within this + {STOP_MARGIN_S:.0f} s, always")
    restart_backoff_s: float = setting(
        0.5, help="a dead child (instance, scheduler, MM Store server) is started again after this, "
                  "doubling with each exit in a row")
    restart_backoff_max_s: float = setting(10.0, help="cap of that backoff")
    max_restarts: int = setting(
        5, help="exits in a row (each within --restart-stable-s of its start) before a child counts as crash-looping "
                "and is left dead (the scheduler's ends the deployment)")
    restart_stable_s: float = setting(
        60.0, check=(">", 0), help="a child that ran this many seconds is healthy again: its count of exits in a row "
                                   "starts over")


def add_launch_flags(p) -> None:
    p.add_argument("--config", type=Path, default=None, help="YAML file (configs/<mode>.yaml); flags override it")
    names = [f.name for f, _ in settings_of(LaunchSettings) if f.name not in _INTERNAL]
    add_flags(p, LaunchSettings, names, unset_default=True)
    add_flags(p.add_argument_group("instance settings (passed on to every instance)"), InstanceConfig, FORWARDED,
              unset_default=True)
    g = p.add_argument_group("scheduler settings (passed on to the scheduler; --max-model-len and --slo-tpot-ms too)")
    taken = set(_forwarded_dests())
    for cls, names in SCHEDULER_FORWARDED:
        add_flags(g, cls, [n for n in names if _dest(cls, n) not in taken], unset_default=True)
        taken |= {_dest(cls, n) for n in names}
    add_flags(p.add_argument_group(*INTERNAL_GROUP), LaunchSettings, _INTERNAL, unset_default=True)


def option_defaults() -> dict[str, Any]:
    """{option: default} of every launch option (its dest, and its key in --config); a forwarded
    instance setting's default is None: not passed on, the instance's own applies."""
    forwarded = {k: None for k in [*_forwarded_dests(), *_scheduler_dests()]}
    return {**flag_defaults(LaunchSettings), **forwarded}


def option_choices() -> dict[str, tuple]:
    """{option: its allowed values} of the launch options that have a fixed set (a file's too)."""
    out = {**flag_choices(LaunchSettings)}
    forwarded = set(_forwarded_dests())
    out.update({k: v for k, v in flag_choices(InstanceConfig).items() if k in forwarded})
    for cls, names in SCHEDULER_FORWARDED:
        mine = {_dest(cls, n) for n in names}
        out.update({k: v for k, v in flag_choices(cls).items() if k in mine})
    return out


def merged_options(args, file: dict) -> dict[str, Any]:
    """Each option from the command line, else the file, else its default."""
    out = {}
    for key, default in option_defaults().items():
        cli = getattr(args, key, None)
        out[key] = cli if cli is not None else file.get(key, default)
    return out


def instance_argv(merged: dict[str, Any]) -> list[str]:
    """The forwarded instance settings that were given, as `epdserve instance` flags."""
    return forward_argv(InstanceConfig, merged, FORWARDED)


def scheduler_argv(merged: dict[str, Any]) -> list[str]:
    """The forwarded scheduler settings that were given, as `epdserve scheduler` flags."""
    return [a for cls, names in SCHEDULER_FORWARDED for a in forward_argv(cls, merged, names)]


def slo_of(merged: dict[str, Any]) -> SLO:
    """The SLO of the launch options (`--slo-ttft-ms`, `--slo-tpot-ms`; a pair not given: the default)."""
    given = {f.name: merged.get(dest(f, s)) for f, s in settings_of(SLO)}
    return SLO(**{k: v for k, v in given.items() if v is not None})


def _dest(cls: type, name: str) -> str:
    return next(dest(f, s) for f, s in settings_of(cls) if f.name == name)


def _forwarded_dests() -> list[str]:
    return [_dest(InstanceConfig, n) for n in FORWARDED]


def _scheduler_dests() -> list[str]:
    return [_dest(cls, n) for cls, names in SCHEDULER_FORWARDED for n in names]
