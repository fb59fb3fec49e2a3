"""A request body pydantic refused, as one readable sentence for the 400 (`explain`).

pydantic lists every failed branch of a union (``messages.0.content.str: Input should be a valid
string`` for a content part it could not read); the user needs the branch they meant. The rules:
a body that is not JSON (or not an object) says so; a path is written as the client wrote it
(``messages[0].content[1].type``, union branches left out); of a union's branches, the one whose
value had the right shape and got furthest is reported; when none had the right shape, the field's
allowed shapes are named ("prompt must be a string, a list of token ids, ..."); a dict's key
that is wrong says so (``logit_bias.x (the key): ...``). One error is reported, with a count of
the others.
"""
from __future__ import annotations

from pydantic import ValidationError

# field -> what it may be, for a value that fits none of its union's branches
SHAPES = {
    "content": "a string or a list of content parts ({\"type\": \"text\" | \"image_url\" | \"video_url\", ...})",
    "prompt": "a string, a list of token ids, a list of strings or a list of token-id lists",
    "stop": "a string or a list of strings",
}
_BUILTIN_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "bytes"}
_KEY = "[key]"  # pydantic's loc element after a dict key that failed validation


def _is_tag(x) -> bool:
    """Whether a loc element names a union branch (pydantic: "str", "list[int]", "ContentPart")."""
    return isinstance(x, str) and x != _KEY and (x in _BUILTIN_TAGS or "[" in x or x[:1].isupper())


def _path(loc) -> str:
    out = ""
    for x in loc:
        if _is_tag(x) or x == _KEY:
            continue
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out


def _shape_mismatch(err: dict) -> bool:
    return err["type"].endswith(("_type", "_parsing")) or err["type"] in ("model_attributes_type",)


def _sentence(err: dict) -> tuple[str, str | None]:
    path = _path(err["loc"])
    if err["type"] == "missing":
        return f"{path} is required", path
    what = f"{path} (the key)" if err["loc"][-1:] == (_KEY,) else path
    return (f"{what}: {err['msg']}" if path else err["msg"]), path or None


def explain(e: ValidationError) -> tuple[str, str | None]:
    """(message, param) of the 400 for `e`."""
    errors = e.errors(include_url=False, include_context=False, include_input=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"the request body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}", None
    if not first["loc"] and _shape_mismatch(first):
        return "the request body must be a JSON object", None
    loc = tuple(first["loc"])
    at = next((i for i, x in enumerate(loc) if _is_tag(x)), None)
    if at is None:
        chosen = first
    else:  # a union: its branches' errors, by branch
        prefix = loc[:at]
        branches: dict[str, list[dict]] = {}
        for err in errors:
            el = tuple(err["loc"])
            if el[:at] == prefix and len(el) > at and _is_tag(el[at]):
                branches.setdefault(el[at], []).append(err)
        fitting = [errs for errs in branches.values() if not any(_shape_mismatch(x) for x in errs)]
        if not fitting:
            path = _path(prefix)
            what = SHAPES.get(prefix[-1] if prefix else "", " or ".join(branches))
            return f"{path} must be {what}", path or None
        chosen = max((x for errs in fitting for x in errs), key=lambda x: len(x["loc"]))
    message, param = _sentence(chosen)
    others = len(errors) - 1 if at is None else 0
    if others:
        message += f" (and {others} more error{'s' if others > 1 else ''})"
    return message, param
