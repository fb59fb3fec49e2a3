"""Tool calls in the Qwen families' (Hermes) format: the tools section of the prompt, and the
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of the output parsed back.

- `render_tools(messages, tools)`: for a chat template that does not render tools itself (the
  Qwen2-VL / Qwen2.5-VL templates), the conversation with Qwen2.5's tools section appended to
  its system message (one added, "You are a helpful assistant.", when it has none) — the text
  Qwen2.5's and Qwen3's own templates write. A template that takes `tools` renders them itself
  (epdserve.model.chat passes them).
- `parse_tool_calls(text)`: (the text outside the blocks or None, the calls). A block whose
  body is not a JSON object with a string `name` stays in the text, as vLLM's hermes parser
  leaves it.
- `ToolCallStream`: the same, incrementally, for streamed output: `feed(text)` returns the
  content that is certainly not part of a block (a possible start of "<tool_call>" is held back)
  and the calls completed so far; `finish()` the rest.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
DEFAULT_SYSTEM = "You are a helpful assistant."
TOOLS_SECTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


def tools_section(tools: list[dict]) -> str:
    return TOOLS_SECTION.format(tools="".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools))


def render_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` with the tools section in their system message (see the module docstring)."""
    section = tools_section(tools)
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        content = out[0]["content"]
        if isinstance(content, list):
            out[0]["content"] = [*content, {"type": "text", "text": "\n\n" + section}]
        else:
            out[0]["content"] = (content or "") + "\n\n" + section
    else:
        out.insert(0, {"role": "system", "content": DEFAULT_SYSTEM + "\n\n" + section})
    return out


def _call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    stream = ToolCallStream()
    content, calls = stream.feed(text)
    more, rest = stream.finish()
    content += more
    calls += rest
    return (content.strip() or None) if calls else content, calls


class ToolCallStream:
    def __init__(self):
        self._buf = ""  # text not yet returned: a block in progress, or a possible start of one
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content, calls = "", []
        while True:
            start = self._buf.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._buf, OPEN)
                content += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                break
            end = self._buf.find(CLOSE, start)
            if end < 0:
                content += self._buf[:start]
                self._buf = self._buf[start:]
                break
            call = _call(self._buf[start + len(OPEN): end].strip())
            if call is None:
                content += self._buf[: end + len(CLOSE)]
            else:
                content += self._buf[:start]
                calls.append(call)
            self._buf = self._buf[end + len(CLOSE):]
        self.calls += len(calls)
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left: an unfinished block is text (the output ended inside it)."""
        rest, self._buf = self._buf, ""
        return rest, []


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
