"""The device check's per-token counts (epdserve/checks/device/profile.py, issue 52 item 5): kernel
and graph launches told apart from other host events, the attention kernels named. A CUDA
profile cannot be taken here: the counting is fed the rows `torch.profiler`'s `key_averages()`
gives (a key, a count, a device type), named as CUPTI names them on CUDA; the CPU path runs the
real profiler."""
from __future__ import annotations

from types import SimpleNamespace

from epdserve.checks.device.profile import _counts, attention_kernels, ops_per_token

CPU, CUDA = SimpleNamespace(name="CPU"), SimpleNamespace(name="CUDA")


class Profile:
    def __init__(self, rows):
        self.rows = [SimpleNamespace(key=k, count=n, device_type=d) for k, n, d in rows]

    def key_averages(self):
        return self.rows


def test_launches_are_counted_apart_from_other_host_events():
    prof = Profile([("aten::mm", 10, CPU), ("cudaLaunchKernel", 7, CPU), ("cuLaunchKernelEx", 2, CPU),
                    ("cudaLaunchKernelExC", 1, CPU), ("cudaGraphLaunch", 3, CPU), ("cudaMemcpyAsync", 4, CPU),
                    ("ampere_bf16_gemm", 9, CUDA), ("_paged_decode_kernel", 3, CUDA)])
    assert _counts(prof) == {"device_kernels": 12, "aten_ops": 10, "host_events": 27, "kernel_launches": 10,
                             "graph_launches": 3}


def test_the_attention_kernels_are_named_by_what_ran_on_the_device():
    prof = Profile([("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", 2, CUDA),
                    ("_paged_decode_kernel", 5, CUDA), ("ampere_bf16_gemm", 9, CUDA),
                    ("aten::scaled_dot_product_attention", 2, CPU)])
    assert attention_kernels(prof) == ["_paged_decode_kernel",
                                        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>"]


def test_on_the_cpu_launch_figures_are_absent_not_zero():
    import torch

    w = torch.randn(64, 64)

    def generate(n):
        x = torch.randn(1, 64)
        for _ in range(n):
            x = torch.tanh(x @ w)

    out = ops_per_token(generate, "cpu", short=2, long=6)
    assert out["kernel_launches"] is None and out["graph_launches"] is None and out["attention_kernels"] is None
    assert out["aten_ops"] >= 2  # a matmul and a tanh per "token", nested ops counted
