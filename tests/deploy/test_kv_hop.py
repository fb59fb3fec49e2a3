"""The launcher's choice of P->D KV hop (deploy/kv_hop.py): host when a P and a D share an
accelerator (NCCL cannot pair two ranks on one device), the device's backend otherwise, the
operator's --kv-hop when given; and the instance's setting reaching its KVTransferConfig."""
from epdserve.deploy.local.kv_hop import choose_kv_hop
from epdserve.instance.config import InstanceConfig


def test_p_and_d_on_one_gpu_stage_through_host_memory():
    c = choose_kv_hop(["P+E", "D"], ["0", "0"], "cuda", [])
    assert (c.hop, c.forced) == ("host", "host") and "device 0" in c.why


def test_p_and_d_on_their_own_gpus_use_the_device_backend():
    c = choose_kv_hop(["E", "P", "D"], ["0", "1", "2"], "cuda", [])
    assert (c.hop, c.forced) == ("device", None)
    # E-P-D on two GPUs: E and D share one, P is alone
    assert choose_kv_hop(["E", "P", "D"], ["0", "1", "0"], "cuda", []).hop == "device"
    # ED-P on one GPU: ED and P share it
    assert choose_kv_hop(["ED", "P"], ["0", "0"], "cuda", []).hop == "host"


def test_modes_without_a_kv_pair_have_no_hop_and_cpu_keeps_gloo():
    assert choose_kv_hop(["EPD"], ["0"], "cuda", []).hop == "none"
    assert choose_kv_hop(["E", "PD"], ["0", "0"], "cuda", []).hop == "none"
    assert choose_kv_hop(["P+E", "D"], [None, None], "cpu", []).hop == "device"


def test_an_explicit_flag_wins_and_is_not_added_again():
    c = choose_kv_hop(["P+E", "D"], ["0", "0"], "cuda", ["--kv-hop", "device"])
    assert (c.hop, c.forced) == ("device", None)
    c = choose_kv_hop(["P+E", "D"], [None, None], "cpu", ["--kv-hop=host"])
    assert (c.hop, c.forced) == ("host", None)
    assert choose_kv_hop(["P+E", "D"], ["0", "0"], "npu", ["--kv-hop", "auto"]).forced == "host"


def test_the_instance_setting_resolves_auto_to_the_device_hop():
    assert InstanceConfig(roles="D", model="m").kv_transfer().hop == "device"
    assert InstanceConfig(roles="D", model="m", kv_hop="host").kv_transfer().hop == "host"


def test_tensor_parallel_groups_that_meet_on_a_device_stage_through_host_memory():
    """A TP instance's id is its group ("0,1"): a P on 0,1 and a D on 1,2 share device 1."""
    c = choose_kv_hop(["P", "D"], ["0,1", "1,2"], "cuda", [])
    assert (c.hop, c.forced) == ("host", "host") and "device 1" in c.why
    assert choose_kv_hop(["P", "D"], ["0,1", "2,3"], "cuda", []).hop == "device"
