"""A launched split deployment with int8 weights (issue 49): P-D mode (a P+E instance and a D
instance, processes, a real MM Store and the P→D KV hop), both `--quantization int8`: greedy
outputs equal transformers' `generate` on the checkpoint holding the dequantized weights, and both
instances registered the method in their KV layout record."""
import pytest

from epdserve import Client
from tests.engine.test_quantization import dequantized_checkpoint
from tests.hf_oracle import HFOracle, assert_same_greedy
from tests.scheduler.harness import PH, image, instance_deployment

pytestmark = pytest.mark.slow


def test_a_p_d_deployment_with_int8_weights_equals_transformers_on_the_dequantized_weights(qwen2_vl_tiny, tmp_path):
    prompts = [("int8 weights, a text prompt of a few words", []), (f"int8 weights and {PH}", [image(7)])]
    with instance_deployment(qwen2_vl_tiny, (("p0", "P+E"), ("d0", "D")), "--quantization", "int8") as (sched, _, _):
        layouts = sched.call(lambda: [sched.server.registry.get(i).kv_layout for i in ("p0", "d0")])
        assert [lay.quantization for lay in layouts] == ["int8", "int8"]
        with Client(sched.address, timeout=300) as c:
            outs = [c.generate(p, images=imgs, max_tokens=8, ignore_eos=True) for p, imgs in prompts]
    oracle = HFOracle(dequantized_checkpoint(qwen2_vl_tiny, tmp_path / "dequantized"))
    for (prompt, imgs), out in zip(prompts, outs):
        want, margins = oracle.generate_with_margins(prompt, imgs, 8)
        assert_same_greedy(out.token_ids, want, margins, f"P-D int8 {prompt!r}")


def test_a_p_d_deployment_serves_an_msmodelslim_static_w8a8_checkpoint_as_it_is(qwen2_vl_tiny, tmp_path):
    """The msModelSlim static W8A8 checkpoint of tests/engine/test_prequantized_static.py, loaded and
    served by a launched P-D without --quantization: both instances register w8a8-static, and the
    outputs equal transformers on its dequantized weights with inputs fake-quantized per tensor."""
    from tests.engine.test_prequantized_static import calibrate, oracle_for, static_checkpoint
    from tests.engine.test_quantization import W8A8_NEAR_TIE

    calib = calibrate(qwen2_vl_tiny)
    ckpt = static_checkpoint(qwen2_vl_tiny, tmp_path / "ms", calib)
    prompts = [("static w8a8, a text prompt of a few words", []), (f"static w8a8 and {PH}", [image(5)])]
    with instance_deployment(ckpt, (("p0", "P+E"), ("d0", "D"))) as (sched, _, _):
        layouts = sched.call(lambda: [sched.server.registry.get(i).kv_layout for i in ("p0", "d0")])
        assert [lay.quantization for lay in layouts] == ["w8a8-static", "w8a8-static"]
        with Client(sched.address, timeout=300) as c:
            outs = [c.generate(p, images=imgs, max_tokens=8, ignore_eos=True) for p, imgs in prompts]
    oracle = oracle_for(qwen2_vl_tiny, tmp_path / "oracle", calib)
    for (prompt, imgs), out in zip(prompts, outs):
        want, margins = oracle.generate_with_margins(prompt, imgs, 8)
        assert_same_greedy(out.token_ids, want, margins, f"P-D static W8A8 {prompt!r}", W8A8_NEAR_TIE)
