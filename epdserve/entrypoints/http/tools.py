"""Tool calls on the chat endpoint: what `tools` / `tool_choice` ask for (`ToolPlan.of`), the
conversation's tool turns as the Qwen (Hermes) format writes them (`tool_turn`), and the output's
`<tool_call>` blocks as OpenAI `tool_calls` (whole responses: `ToolPlan.message`; streams:
`ToolPlan.stream`, one per choice).

tool_choice: `auto` (the default with tools): the tools are rendered into the prompt
(epdserve.model.tool_calls) and the output's blocks parsed into `tool_calls` (finish_reason
`tool_calls` when there is one); `none`: the tools are left out of the prompt and nothing is
parsed (as vLLM's --exclude-tools-when-tool-choice-none); a named function
({"type": "function", "function": {"name": ...}}): the tools are rendered and the output is a
structured output on that function's `parameters` schema, returned as its one call's arguments
(finish_reason `stop`, as OpenAI answers a forced call); `required` is refused (400 naming
tool_choice).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from epdserve.engine.structured_output import StructuredOutput
from epdserve.model.tool_calls import CLOSE, OPEN, ToolCall, ToolCallStream, parse_tool_calls


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_dict(call: ToolCall, index: int | None = None) -> dict:
    d = {"id": _call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        d["index"] = index
    return d


def tool_turn(role: str, content: str, tool_calls: list[dict] | None) -> tuple[str, str]:
    """(role, text) of a conversation turn with tool content, as Qwen's templates render it: a
    `tool` message is the user's <tool_response>; an assistant's calls are <tool_call> blocks."""
    if role == "tool":
        return "user", f"<tool_response>\n{content}\n</tool_response>"
    text = content
    for c in tool_calls or []:
        f = c.get("function") or {}
        args = f.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        body = json.dumps({"name": f.get("name"), "arguments": args}, ensure_ascii=False)
        text += ("\n" if text else "") + f"{OPEN}\n{body}\n{CLOSE}"
    return role, text


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict]  # rendered into the prompt
    named: str | None = None  # tool_choice's function: the output is its arguments

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice) -> "ToolPlan | None":
        """The plan, or None (no tools, or tool_choice none). ValueError: (why, the field)."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise ValueError("tool_choice names a function but no tools are given", "tool_choice")
            return None
        names = []
        for i, t in enumerate(tools):
            f = t.get("function") if isinstance(t, dict) else None
            if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(f, dict)
                    and isinstance(f.get("name"), str) and f["name"]):
                raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                                 f"tools[{i}]")
            names.append(f["name"])
        if tool_choice in (None, "auto"):
            return cls(list(tools))
        if tool_choice == "none":
            return None
        if tool_choice == "required":
            raise ValueError("tool_choice 'required' is not supported; use 'auto' or a named function", "tool_choice")
        name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
        if name not in names:
            raise ValueError(f"tool_choice must be 'none', 'auto' or a function of tools ({', '.join(names)})",
                             "tool_choice")
        return cls(list(tools), name)

    def constraint(self) -> StructuredOutput | None:
        """A named function's arguments: a structured output on its parameters schema."""
        if self.named is None:
            return None
        f = next(t["function"] for t in self.tools if t["function"]["name"] == self.named)
        return StructuredOutput("json", json.dumps(f.get("parameters") or {"type": "object"}))

    def message(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """(the chat message, its finish_reason) of a whole output."""
        if self.named is not None:
            return {"role": "assistant", "content": None,
                    "tool_calls": [_call_dict(ToolCall(self.named, text))]}, finish_reason
        content, calls = parse_tool_calls(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return ({"role": "assistant", "content": content, "tool_calls": [_call_dict(c) for c in calls]},
                "tool_calls" if finish_reason == "stop" else finish_reason)

    def stream(self) -> "ToolDeltas":
        return ToolDeltas(self)


class ToolDeltas:
    """One streamed choice's deltas: `feed(text)` and `finish(reason)` return the chat deltas to
    send (content, or `tool_calls` entries, one whole call each; a named function's arguments
    stream as they come) and, from `finish`, the finish_reason."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.parser = ToolCallStream()
        self.index = 0  # the next call's index
        self.started = False  # named: the call's first delta (id, name) is out

    def feed(self, text: str) -> list[dict]:
        if self.plan.named is not None:
            out = []
            if not self.started:
                self.started = True
                first = _call_dict(ToolCall(self.plan.named, ""), 0)
                out.append({"tool_calls": [first]})
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        content, calls = self.parser.feed(text)
        return self._deltas(content, calls)

    def _deltas(self, content: str, calls: list[ToolCall]) -> list[dict]:
        out = [{"content": content}] if content else []
        for c in calls:
            out.append({"tool_calls": [_call_dict(c, self.index)]})
            self.index += 1
        return out

    def finish(self, finish_reason: str) -> tuple[list[dict], str]:
        if self.plan.named is not None:
            return self.feed(""), finish_reason
        rest, calls = self.parser.finish()
        out = self._deltas(rest, calls)
        return out, ("tool_calls" if self.index and finish_reason == "stop" else finish_reason)
