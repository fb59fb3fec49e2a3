"""The role seams: prefill-only engine → KV blocks copied → decode-only engine equals the oracle.

This is the in-process version of the P→D hop (no transport): it proves that a prefill-only
engine keeps exportable KV and that a decode-only engine continues exactly from imported KV.
"""
from epdserve import SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.llm_engine import LLMEngine
from epdserve.engine.sequence import SeqStatus
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator

PH = "<|vision_start|><|image_pad|><|vision_end|>"


def _drain(eng):
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    return outs


def test_prefill_only_then_decode_only(qwen2_5_vl_tiny):
    p_eng = LLMEngine(EngineConfig(model=str(qwen2_5_vl_tiny), device="cpu", roles="EP"))
    d_eng = LLMEngine(EngineConfig(model=str(qwen2_5_vl_tiny), device="cpu", roles="D"))
    img = jpeg_bytes(procedural_image(112, 84, 9))
    prompt = f"describe {PH} in detail"
    sp = SamplingParams(max_tokens=9, ignore_eos=True)
    p_eng.add_request("r", prompt, [img], sp)
    (first,) = [o for o in _drain(p_eng) if o.finished]
    assert first.finish_reason == "prefill_done" and len(first.token_ids) == 1
    seq = p_eng._seqs["r"]
    assert seq.status is SeqStatus.KV_HELD
    p_blocks = p_eng.blocks.table("r")
    d_blocks = d_eng.add_prefilled_request("r", seq.prompt_token_ids, seq.rope_delta, first.token_ids[0], sp)
    assert len(d_blocks) == len(p_blocks)
    for layer in range(p_eng.adapter.num_layers):
        k, v = p_eng.kv_cache.read_blocks(layer, p_blocks)
        d_eng.kv_cache.write_blocks(layer, d_blocks, k, v)
    p_eng.release("r")
    assert p_eng.blocks.num_free == p_eng.blocks.num_blocks
    d_eng.kv_ready("r")
    outs = _drain(d_eng)
    final = [o for o in outs if o.finished][0]
    streamed = [t for o in outs for t in o.new_token_ids]
    expected = ReferenceGenerator(qwen2_5_vl_tiny).generate(prompt, [img], 9)
    assert final.token_ids == expected
    assert streamed == expected[1:]  # the first token came from the prefill side
    assert d_eng.blocks.num_free == d_eng.blocks.num_blocks
