"""Which accelerator each launched instance sees: its own by default (round-robin over the visible
devices), the named ones with --devices, nothing to set on CPU. No accelerator exists here, so
the accelerator platforms report a device count of 4 (the only thing the assignment reads)."""
from epdserve.deploy.local.deployment import instance_device_env
from epdserve.platform.cpu import CpuPlatform
from epdserve.platform.cuda import CudaPlatform
from epdserve.platform.npu import NpuPlatform


class _FourNpus(NpuPlatform):
    def device_count(self) -> int:
        return 4


class _EightNpus(NpuPlatform):
    def device_count(self) -> int:
        return 8


class _FourGpus(CudaPlatform):
    def device_count(self) -> int:
        return 4


def test_each_instance_gets_its_own_device_by_default():
    got = [instance_device_env(_FourNpus(), [], k) for k in range(6)]
    assert got == [{"ASCEND_RT_VISIBLE_DEVICES": d} for d in "012301"]
    assert instance_device_env(_FourGpus(), [], 2) == {"CUDA_VISIBLE_DEVICES": "2"}


def test_named_devices_round_robin():
    got = [instance_device_env(_FourNpus(), ["4", "6"], k)["ASCEND_RT_VISIBLE_DEVICES"] for k in range(3)]
    assert got == ["4", "6", "4"]


def test_cpu_sets_nothing():
    assert instance_device_env(CpuPlatform(), [], 0) == {}
    assert CpuPlatform().device_count() == 1


def test_a_tensor_parallel_instance_gets_one_device_per_rank():
    """Issue 48 item 1: an instance at tensor_parallel_size N sees N devices of its own (rank r on the
    r-th), groups handed out round-robin; fewer devices than its degree is an error naming both."""
    import pytest

    from epdserve.deploy.local.deployment import Deployment, DeploymentSpec

    got = [instance_device_env(_FourGpus(), [], k, degree=2)["CUDA_VISIBLE_DEVICES"] for k in range(3)]
    assert got == ["0,1", "2,3", "0,1"]
    assert instance_device_env(_FourNpus(), ["4", "5", "6", "7"], 1, degree=2) == {"ASCEND_RT_VISIBLE_DEVICES": "6,7"}
    assert instance_device_env(_FourNpus(), [], 0, degree=4) == {"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"}
    with pytest.raises(ValueError, match="tensor_parallel_size 8 needs 8 devices; 4 visible"):
        instance_device_env(_FourGpus(), [], 0, degree=8)
    with pytest.raises(ValueError, match="needs 4 devices; 2 named by --devices"):
        instance_device_env(_FourGpus(), ["0", "1"], 0, degree=4)
    spec = DeploymentSpec(mode="monolithic", model="m", device="cpu", instance_args=["--tensor-parallel-size", "2"])
    assert Deployment(spec)._degree == 2 and Deployment(DeploymentSpec(mode="E-PD", model="m", device="cpu"))._degree == 1


def test_each_stage_takes_its_own_degree_and_its_own_devices():
    """Issue 48 item 1: in E-PD with the language model at TP2, the E-only instances run at
    --encode-tensor-parallel-size (1 by default) on a device each and the PD instance on two of its
    own; a split pool (P, D) takes its degree too."""
    from epdserve.deploy.local.deployment import Deployment, DeploymentSpec

    assert [instance_device_env(_FourGpus(), [], k, [1, 1, 2])["CUDA_VISIBLE_DEVICES"] for k in range(3)] == \
        ["0", "1", "2,3"]
    # past the devices, the next instance starts over from the first (instances share, as at degree 1)
    assert [instance_device_env(_FourGpus(), [], k, [2, 1, 2])["CUDA_VISIBLE_DEVICES"] for k in range(3)] == \
        ["0,1", "2", "0,1"]
    spec = DeploymentSpec(mode="E-PD", model="m", device="cpu", encode=2,
                          instance_args=["--tensor-parallel-size", "2"])
    dep = Deployment(spec)
    assert dep._degrees == [1, 1, 2]  # E, E, PD in start order
    e_argv, pd_argv = dep._instance_argv("E"), dep._instance_argv("PD")
    assert e_argv[len(e_argv) - 1 - e_argv[::-1].index("--tensor-parallel-size") + 1] == "1"  # the last one wins
    assert pd_argv.count("--tensor-parallel-size") == 1 and pd_argv[pd_argv.index("--tensor-parallel-size") + 1] == "2"
    wide = Deployment(DeploymentSpec(mode="E-PD", model="m", device="cpu", encode_tensor_parallel_size=2,
                                     instance_args=["--tensor-parallel-size", "4"]))
    assert wide._degrees == [2, 4]
    split = Deployment(DeploymentSpec(mode="P-D", model="m", device="cpu", instance_args=["--tensor-parallel-size", "2"]))
    assert split._degrees == [2, 2]  # the KV hop carries any pair of degrees


def test_prefill_and_decode_each_take_their_own_degree_and_devices():
    """Issue 48 item 1, the Atlas 800I A2 example of docs/tensor-parallel.md: E-P-D on 8 NPUs with E at
    1 (x2), P at --prefill-tensor-parallel-size 2 and D at --decode-tensor-parallel-size 4: E0 on NPU 0,
    E1 on 1, P on 2,3, D on 4-7, each started with its own --tensor-parallel-size."""
    from epdserve.deploy.local.deployment import Deployment, DeploymentSpec

    dep = Deployment(DeploymentSpec(mode="E-P-D", model="m", device="cpu", encode=2, prefill_tensor_parallel_size=2,
                                    decode_tensor_parallel_size=4))
    assert dep._degrees == [1, 1, 2, 4]  # E, E, P, D in start order
    eight = [instance_device_env(_EightNpus(), [], k, dep._degrees)["ASCEND_RT_VISIBLE_DEVICES"] for k in range(4)]
    assert eight == ["0", "1", "2,3", "4,5,6,7"]
    for roles, want in (("E", "1"), ("P", "2"), ("D", "4")):
        argv = dep._instance_argv(roles)
        last = len(argv) - 1 - argv[::-1].index("--tensor-parallel-size") if "--tensor-parallel-size" in argv else None
        assert (argv[last + 1] if last is not None else "1") == want, (roles, argv)
    # 0 (the default) is --tensor-parallel-size; PD / EPD instances always take it
    same = Deployment(DeploymentSpec(mode="E-P-D", model="m", device="cpu", decode_tensor_parallel_size=4,
                                     instance_args=["--tensor-parallel-size", "2"]))
    assert same._degrees == [1, 2, 4]
    coupled = Deployment(DeploymentSpec(mode="E-PD", model="m", device="cpu", prefill_tensor_parallel_size=2,
                                        decode_tensor_parallel_size=4, instance_args=["--tensor-parallel-size", "8"]))
    assert coupled._degrees == [1, 8]
