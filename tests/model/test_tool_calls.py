"""The Qwen (Hermes) tool-call format: the tools section written into a conversation's system
message, `<tool_call>` blocks parsed whole and incrementally (a marker split across deltas is
held back, a malformed block stays text), and the demo tokenizer's vocabulary as xgrammar sees
it (special tokens other than the stop tokens never allowed)."""
import json
import re

import pytest

from epdserve.model.tool_calls import DEFAULT_SYSTEM, ToolCall, ToolCallStream, parse_tool_calls, render_tools

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_the_tools_section_joins_the_system_message_or_brings_one():
    added = render_tools([{"role": "user", "content": "hi"}], [TOOL])
    assert added[0]["role"] == "system" and added[0]["content"].startswith(DEFAULT_SYSTEM + "\n\n# Tools")
    assert json.dumps(TOOL) in added[0]["content"] and added[1] == {"role": "user", "content": "hi"}
    joined = render_tools([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], [TOOL])
    assert joined[0]["content"].startswith("Be brief.\n\n# Tools") and len(joined) == 2


def test_blocks_parse_into_calls_and_the_rest_is_content():
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n' \
           '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me look." and calls == [ToolCall("f", '{"a": 1}'), ToolCall("g", "{}")]
    assert parse_tool_calls("plain <tool_ca") == ("plain <tool_ca", [])
    bad = "<tool_call>not json</tool_call>"
    assert parse_tool_calls(bad) == (bad, [])


@pytest.mark.parametrize("cut", range(1, 40))
def test_streamed_blocks_give_the_same_calls_wherever_the_deltas_split(cut):
    text = 'ok <tool_call>{"name": "f", "arguments": {"x": "y"}}</tool_call> done'
    s = ToolCallStream()
    pieces = [s.feed(text[:cut]), s.feed(text[cut:]), s.finish()]
    assert "".join(c for c, _ in pieces) == "ok  done"
    assert [c for _, calls in pieces for c in calls] == [ToolCall("f", '{"x": "y"}')]


def test_xgrammar_sees_the_demo_vocabulary(qwen2_vl_tiny):
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from epdserve.engine.grammar import tokenizer_info

    tok = AutoTokenizer.from_pretrained(qwen2_vl_tiny)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    info = tokenizer_info(tok, 2048, {eos})  # logits wider than the tokenizer: padding rows
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and info.stop_token_ids == [eos]
    special = set(tok.all_special_ids) - {eos}
    assert special <= set(info.special_token_ids) and set(range(len(tok), 2048)) <= set(info.special_token_ids)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex("[a-z]+"))
    mask = xgr.allocate_token_bitmask(1, 2048)
    matcher.fill_next_token_bitmask(mask)
    allowed = {i for i in range(2048) if (int(mask[0, i // 32]) >> (i % 32)) & 1}
    assert allowed and not allowed & (special | {eos})  # nothing matched yet: no stop, no special token
    assert all(re.fullmatch("[a-z]+", tok.convert_ids_to_tokens(i)) for i in allowed)  # byte-level: "Ġ" is a space
