"""Chat conversations in OpenAI's message shape → one prompt and its images (and videos), in order.

Owns `chat_to_prompt` (render a conversation with the checkpoint's chat template) and
`image_url_bytes`, the one reader of `image_url` / `video_url` parts: only `data:` URLs, since epdserve fetches
nothing from the network. Used by the offline `LLM.chat`, the scheduler's preprocessing of chat
requests and the client building one. Bad input raises `InvalidRequestError`.
"""
from __future__ import annotations

import base64
import binascii
from urllib.parse import unquote_to_bytes

from epdserve.model.tool_calls import render_tools
from epdserve.request_errors import InvalidRequestError

# content part types OpenAI defines that epdserve does not take -> what the refusal says
UNSUPPORTED_PARTS = {"input_audio": "audio input is not supported", "audio_url": "audio input is not supported",
                     "file": "file input is not supported", "refusal": "refusal parts are not supported as input"}
OFFLINE_PARTS = ("text", "image", "image_url", "video", "video_url")  # what chat_to_prompt takes


def unsupported_part(kind, supported: tuple[str, ...]) -> str:
    """The one sentence both fronts give for a content part of type `kind` they do not take."""
    return UNSUPPORTED_PARTS.get(kind) or f"content part type {kind!r} is not supported; supported: {', '.join(supported)}"


def chat_to_prompt(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                   tools: list[dict] | None = None) -> dict:
    """Render a conversation with the checkpoint's chat template; collect its images in order.
    `tools` (OpenAI tool definitions): given to a template that renders tools, else written into
    the system message in the Qwen (Hermes) format (epdserve.model.tool_calls).

    Returns the offline API's prompt shape: `{"prompt": str, "multi_modal_data": {"image": [...]}}`
    (plus `"video": [...]` when the conversation has videos). A content part is
    `{"type": "text", "text": ...}`, `{"type": "image", "image": <image>}`,
    `{"type": "image_url", "image_url": {"url": "data:..."}}`, `{"type": "video", "video": <video>}`
    or `{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}`.
    """
    images, videos, rendered = [], [], []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type")
                if kind == "text":
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in ("image_url", "image"):
                    images.append(_image_from_part(part))
                    parts.append({"type": "image"})
                elif kind in ("video_url", "video"):
                    videos.append(part["video"] if kind == "video" and "video" in part
                                  else image_url_bytes(part.get("video_url"), "video_url"))
                    parts.append({"type": "video"})
                else:
                    raise InvalidRequestError(unsupported_part(kind, OFFLINE_PARTS))
            rendered.append({"role": msg["role"], "content": parts})
        else:
            rendered.append({"role": msg["role"], "content": content or ""})
    kw = {}
    if tools and "tools" in (getattr(tokenizer, "chat_template", None) or ""):
        kw["tools"] = tools
    elif tools:
        rendered = render_tools(rendered, tools)
    text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)
    mm = {"image": images, "video": videos} if videos else {"image": images}
    return {"prompt": text, "multi_modal_data": mm}


def image_url_bytes(image_url, what: str = "image_url") -> bytes:
    """The bytes of an `image_url` (or `video_url`) value (`{"url": "data:..."}` or the URL itself).

    RFC 2397: `data:[<media type>][;base64],<data>`; without `;base64` the data is percent-encoded.
    """
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
        raise InvalidRequestError(f"{what} must be a data: URL (epdserve fetches nothing from the network)")
    header, payload = url.split(",", 1)
    try:
        return base64.b64decode(payload) if ";base64" in header else unquote_to_bytes(payload)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequestError(f"bad data: URL: {e}") from None


def _image_from_part(part: dict):
    if part.get("type") == "image" and "image" in part:
        return part["image"]
    return image_url_bytes(part.get("image_url"))
