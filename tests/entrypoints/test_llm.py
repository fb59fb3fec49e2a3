"""The offline API: chat with OpenAI-style content parts (data: URLs) equals generate on the rendered prompt."""
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


def test_chat_rejects_remote_urls(qwen2_vl_tiny):
    llm = LLM(model=qwen2_vl_tiny, device="cpu")
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]
    try:
        llm.chat(messages)
    except ValueError as e:
        assert "data: URL" in str(e)
    else:
        raise AssertionError("remote image URL accepted")
