"""`StructuredOutput`: the constraint one request's output must follow (a JSON schema, any JSON
object, a regex, one of a list of choices, or an EBNF grammar), as the engine receives it.

Plain data, validated on construction (kind known, spec non-empty, a schema or choice list that
is JSON); compiling it into a token grammar is engine/grammar.py's. The front ends map OpenAI's
`response_format` and vLLM's `structured_outputs` / `guided_*` extras onto it
(entrypoints/http/protocol.py); the wire carries it in common.SamplingParams.structured.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """kind: json (spec: a JSON schema's text), json_object (any JSON object; spec unused),
    regex (spec: the pattern), choice (spec: a JSON list of strings: the output is exactly one),
    grammar (spec: xgrammar's EBNF, root rule `root`). `replay_prompt_tokens`: a resumed attempt's
    prompt ends with that many tokens of output the grammar has consumed (the engine replays them
    into the matcher); not part of the constraint (the compiled grammar is shared)."""

    kind: str
    spec: str = ""
    replay_prompt_tokens: int = 0

    def __post_init__(self):
        if self.replay_prompt_tokens < 0:
            raise ValueError("replay_prompt_tokens must be >= 0")
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"a {self.kind} structured output needs its {self.kind}")
        if self.kind == "json":
            try:
                schema = json.loads(self.spec)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("the JSON schema must be a JSON object")
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise ValueError("choice must be a non-empty list of non-empty strings")

    @classmethod
    def choice(cls, choices: list[str]) -> "StructuredOutput":
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def from_options(cls, options: dict) -> "StructuredOutput":
        """From vLLM's `structured_outputs` spelling: exactly one of `json` (a schema, as a dict or
        its text), `json_object` (true), `regex`, `choice` (a list of strings), `grammar`.
        ValueError names what is wrong."""
        if not isinstance(options, dict):
            raise ValueError("structured_outputs must be an object with one of json, json_object, regex, choice, grammar")
        given = {k: v for k, v in options.items() if v is not None and v is not False}
        unknown = sorted(set(given) - set(KINDS))
        if unknown:
            raise ValueError(f"structured_outputs: unknown or unsupported key(s) {unknown}; supported: {', '.join(KINDS)}")
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}, got {sorted(given) or 'none'}")
        (kind, value), = given.items()
        if kind == "json":
            return cls("json", value if isinstance(value, str) else json.dumps(value))
        if kind == "json_object":
            return cls("json_object")
        if kind == "choice":
            if not isinstance(value, list):
                raise ValueError("choice must be a list of strings")
            return cls.choice(value)
        if not isinstance(value, str):
            raise ValueError(f"{kind} must be a string")
        return cls(kind, value)
