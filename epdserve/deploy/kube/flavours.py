"""Flavours: what differs between a CPU, a CUDA and an Ascend deployment of the same mode.

A `Flavour` names the `--device` instances run with, the device plugin's extended resource each
instance requests (one accelerator per instance; none on CPU), the image built from
`deploy/docker/`, the command that starts `epdserve` in that image, and its CPU / memory and, on an accelerator, its
instance's KV cache (sized to the device; the CPU flavour leaves the instance's own default).

Resource names: CUDA `nvidia.com/gpu` (NVIDIA's device plugin). Ascend `huawei.com/Ascend910`:
Ascend's device plugin (MindCluster) reports resources as `huawei.com/` + the chip family
(ascend-device-plugin pkg/common/constants.go: `ResourceNamePrefix = "huawei.com/"`,
`Ascend910 = "Ascend910"`; MindCluster's Ascend Docker Runtime guide requests
`huawei.com/Ascend910: 1`), which covers Atlas 800I A2 / A3's 910B / 910C chips. Clusters that
publish other names (HAMi's `huawei.com/Ascend910B3`, a virtual NPU) set `--accelerator-resource`.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Flavour:
    name: str
    device: str  # `epdserve instance --device`
    resource: str | None  # the device plugin's extended resource, one per instance
    image: str  # default image (deploy/docker/)
    command: tuple[str, ...]  # what runs `epdserve` in the image; the args follow
    kv_cache_mb: int | None  # an instance's --kv-cache-mb; None: the instance's own default (engine/config.py)
    cpu: str  # an instance's CPU request = limit
    memory: str  # an instance's memory request = limit
    env: dict[str, str] = field(default_factory=dict)  # fixed environment of every instance
    supplemental_groups: tuple[int, ...] = ()  # groups that own the device nodes
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict, ...] = ()


# CANN's HCCL settings for P-D pairs, as scripts/atlas_node.sh sets them (see its comments); the
# interface comes from HCCL_IF_IP (the pod IP, downward API), the port range from Ports.
# HCCL_EXEC_TIMEOUT 600 s, finite: a receive left running by a torn-down pair holds its blocks
# until then + 30 s (NpuPlatform.stuck_work_bound_s); 0 would be "never" (held for ever).
_HCCL_ENV = {"HCCL_CONNECT_TIMEOUT": "120", "HCCL_EXEC_TIMEOUT": "600", "P2P_HCCL_BUFFSIZE": "20",
             "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True", "TASK_QUEUE_ENABLE": "1"}

FLAVOURS: dict[str, Flavour] = {
    "cpu": Flavour("cpu", "cpu", None, "epdserve:cpu", ("epdserve",), kv_cache_mb=None, cpu="2", memory="4Gi",
                   env={"OMP_WAIT_POLICY": "PASSIVE"}),
    "cuda": Flavour("cuda", "cuda", "nvidia.com/gpu", "epdserve:cuda", ("epdserve",), kv_cache_mb=16384,
                    cpu="8", memory="64Gi",
                    tolerations=({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},)),
    # Dockerfile.ascend's cann-env sources CANN's set_env.sh (and ATB's), then execs its arguments.
    # The device nodes belong to HwHiAiUser's group (gid 1000 on Ascend's driver install).
    "ascend": Flavour("ascend", "npu", "huawei.com/Ascend910", "epdserve:ascend", ("cann-env", "epdserve"),
                      kv_cache_mb=16384, cpu="16", memory="128Gi", env=_HCCL_ENV, supplemental_groups=(1000,),
                      node_selector={"accelerator": "huawei-Ascend910"},
                      tolerations=({"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"},)),
}


def get_flavour(name: str) -> Flavour:
    try:
        return FLAVOURS[name]
    except KeyError:
        raise ValueError(f"flavour must be one of {', '.join(FLAVOURS)}, got {name!r}") from None
