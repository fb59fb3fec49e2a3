"""The numeric ranges of a public generation request: the one set of rules both fronts check.

What each number of a `SamplingParams` and each token id of a `GenerateRequest` may be: what its
proto field holds (int32 counts and token ids, int64 seed), narrowed to what the engine means by
it (max_tokens >= 1; top_k >= 0, 0 off; top_p in (0, 1]; min_p in [0, 1]; temperature finite and
>= 0; token ids >= 0 and, for a prompt or a logit_bias key, inside the model's vocabulary;
presence/frequency penalties in [-2, 2], repetition_penalty > 0, logit_bias values in [-100, 100],
logprobs 0..20, n (choices) 1..128 as the HTTP front's; NaN and infinity nowhere).

`check_request(req, vocab_size)` raises `RangeError` naming the first field out of range
("sampling.top_k must be an integer in [0, 2147483647] (0 turns it off), got -3"): the
scheduler's dispatcher answers it INVALID_ARGUMENT before any work is spent on the request. The
HTTP front takes its pydantic bounds from the same `Range`s (a body out of range is a 400 before a
proto is built: protobuf refuses an int that overflows its field) and checks what it built with
`check_sampling` / `check_token_ids` under its own field names. The engine's finer rule (a
temperature between 0 and 1e-5 overflows float32) stays in `SamplingParams`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from epdserve.request_errors import InvalidRequestError

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Range:
    """lo..hi (both included, unless `lo_open`); `integer` or a finite float; `note`: what a special
    value means ("0 turns it off")."""

    lo: float
    hi: float
    integer: bool = True
    lo_open: bool = False
    note: str = ""

    def holds(self, v) -> bool:
        if not self.integer and not math.isfinite(v):
            return False
        return (v > self.lo if self.lo_open else v >= self.lo) and v <= self.hi

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        if self.hi == math.inf:
            text = f"{kind} {'>' if self.lo_open else '>='} {self.lo:g}"
        else:
            lo, hi = (f"{self.lo:d}", f"{self.hi:d}") if self.integer else (f"{self.lo:g}", f"{self.hi:g}")
            text = f"{kind} in {'(' if self.lo_open else '['}{lo}, {hi}]"
        return f"{text} ({self.note})" if self.note else text


MAX_TOKENS = Range(1, INT32_MAX)
TOP_K = Range(0, INT32_MAX, note="0 turns it off")
SEED = Range(INT64_MIN, INT64_MAX)
TEMPERATURE = Range(0, math.inf, integer=False, note="0 is greedy")
TOP_P = Range(0, 1, integer=False, lo_open=True)
MIN_P = Range(0, 1, integer=False, note="0 turns it off")
TOKEN_ID = Range(0, INT32_MAX)
PENALTY = Range(-2, 2, integer=False, note="0 turns it off")
REPETITION_PENALTY = Range(0, math.inf, integer=False, lo_open=True, note="1 turns it off")
LOGIT_BIAS = Range(-100, 100, integer=False)
LOGPROBS = Range(0, 20, note="top alternatives per token")
RESUMED_OUTPUTS = Range(0, INT32_MAX)
CHOICES = Range(1, 128, note="choices of one prompt")

# SamplingParams' optional numbers (stop_token_ids: token ids)
SAMPLING = {"max_tokens": MAX_TOKENS, "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K, "seed": SEED,
            "min_p": MIN_P, "presence_penalty": PENALTY, "frequency_penalty": PENALTY,
            "repetition_penalty": REPETITION_PENALTY, "logprobs": LOGPROBS, "resumed_outputs": RESUMED_OUTPUTS,
            "n": CHOICES}


class RangeError(InvalidRequestError):
    """`field` (as the client wrote it: "sampling.top_k", "prompt_token_ids[3]") is out of range."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def check_sampling(p, prefix: str = "sampling.") -> None:
    """Every number `p` (a common.SamplingParams) carries, named `prefix` + its field."""
    for name, rule in SAMPLING.items():
        if p.HasField(name) and not rule.holds(getattr(p, name)):
            raise RangeError(prefix + name, f"{prefix}{name} must be {rule.describe()}, got {getattr(p, name)}")
    check_token_ids(prefix + "stop_token_ids", p.stop_token_ids)
    check_logit_bias(p.logit_bias, prefix + "logit_bias")


def check_logit_bias(bias, field: str, vocab_size: int | None = None) -> None:
    """Keys are token ids (in the vocabulary when it is known), values in LOGIT_BIAS."""
    hi = INT32_MAX if vocab_size is None else vocab_size - 1
    for t, b in bias.items():
        if not 0 <= t <= hi:
            where = f"[0, {vocab_size}) (the model's vocabulary)" if vocab_size is not None else f"[0, {INT32_MAX}]"
            raise RangeError(field, f"{field} keys must be token ids in {where}, got {t}")
        if not LOGIT_BIAS.holds(b):
            raise RangeError(f"{field}[{t}]", f"{field}[{t}] must be {LOGIT_BIAS.describe()}, got {b}")


def check_token_ids(field: str, ids, vocab_size: int | None = None) -> None:
    """Token ids in [0, vocab_size) (the model's vocabulary), or any token id an int32 holds."""
    if not len(ids):
        return
    hi = INT32_MAX if vocab_size is None else vocab_size - 1
    try:
        a = np.array(ids, dtype=np.int64)  # vectorised: a prompt may hold a million ids (docs/measurements.md)
    except OverflowError:  # a Python int past int64 (no proto holds one)
        i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t <= hi)
    else:
        out = (a < 0) | (a > hi)
        if not out.any():
            return
        i = int(out.argmax())
        t = int(a[i])
    where = f"[0, {vocab_size}) (the model's vocabulary)" if vocab_size is not None else f"[0, {INT32_MAX}]"
    raise RangeError(f"{field}[{i}]", f"{field}[{i}] must be a token id in {where}, got {t}")


def check_request(req, vocab_size: int) -> None:
    """Every number of `req` (a serve.GenerateRequest): its sampling, prompt and resume token ids."""
    check_sampling(req.sampling)
    check_logit_bias(req.sampling.logit_bias, "sampling.logit_bias", vocab_size)
    if req.WhichOneof("input") == "prompt_token_ids":
        check_token_ids("prompt_token_ids", req.prompt_token_ids.ids, vocab_size)
    check_token_ids("resume_token_ids", req.resume_token_ids, vocab_size)
