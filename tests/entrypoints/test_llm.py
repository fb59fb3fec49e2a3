"""The offline API: chat with OpenAI-style content parts (data: URLs) equals generate on the rendered prompt;
a conversation that cannot be rendered fails alone, with `.error`."""
import base64

from epdserve import LLM, SamplingParams
from epdserve.model.demo_images import jpeg_bytes, procedural_image


def test_chat_with_data_url_image(qwen2_vl_tiny):
    llm = LLM(model=qwen2_vl_tiny, device="cpu")
    img = jpeg_bytes(procedural_image(84, 112, 3))
    url = "data:image/jpeg;base64," + base64.b64encode(img).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "what is this?"}]}]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    chat = llm.chat(messages, sp)[0]
    text = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]}],
        tokenize=False, add_generation_prompt=True)
    assert "<|image_pad|>" in text
    direct = llm.generate({"prompt": text, "multi_modal_data": {"image": [img]}}, sp)[0]
    assert chat.error is None and chat.num_vision_tokens > 0
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids


def test_a_conversation_that_cannot_render_fails_alone(qwen2_vl_tiny):
    llm = LLM(model=qwen2_vl_tiny, device="cpu")
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                          {"type": "text", "text": "what is this?"}]}]
    good = [{"role": "user", "content": "hello"}]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = llm.chat([remote, good, audio], sp)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "length", "error"]
    assert "data: URL" in outs[0].error and outs[2].error == "audio input is not supported"
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4
    assert outs[1].outputs[0].token_ids == llm.chat(good, sp)[0].outputs[0].token_ids
