"""`epdserve.rpc.ranges`, the numeric rules both fronts share: what each rule says, that a value
on each side of every bound is judged right, NaN and infinity refused, token ids judged whatever
their size (Python ints past int64 included), the first bad one named by its index, also in a prompt
of a million ids (how fast that is: benchmarks/range_check.py; timers stay out of tests)."""
from __future__ import annotations

import math

import pytest

from epdserve.rpc import common_pb2, serve_pb2
from epdserve.rpc.ranges import (
    INT32_MAX,
    SAMPLING,
    RangeError,
    check_request,
    check_sampling,
    check_token_ids,
)


def test_each_rule_says_what_it_allows():
    said = {name: rule.describe() for name, rule in SAMPLING.items()}
    assert said == {
        "max_tokens": "an integer in [1, 2147483647]",
        "temperature": "a finite number >= 0 (0 is greedy)",
        "top_p": "a finite number in (0, 1]",
        "top_k": "an integer in [0, 2147483647] (0 turns it off)",
        "seed": "an integer in [-9223372036854775808, 9223372036854775807]",
        "min_p": "a finite number in [0, 1] (0 turns it off)",
        "presence_penalty": "a finite number in [-2, 2] (0 turns it off)",
        "frequency_penalty": "a finite number in [-2, 2] (0 turns it off)",
        "repetition_penalty": "a finite number > 0 (1 turns it off)",
        "logprobs": "an integer in [0, 20] (top alternatives per token)",
        "resumed_outputs": "an integer in [0, 2147483647]",
        "n": "an integer in [1, 128] (choices of one prompt)",
    }


@pytest.mark.parametrize("name, good, bad", [
    ("max_tokens", [1, INT32_MAX], [0, -1]),
    ("temperature", [0.0, 1e-5, 1e300], [-1e-9, math.nan, math.inf]),
    ("top_p", [1e-9, 1.0], [0.0, 1.0000001, math.nan]),
    ("top_k", [0, INT32_MAX], [-1]),
    ("seed", [-(2**63), 2**63 - 1], []),
    ("min_p", [0.0, 1.0], [-0.1, 1.1, -math.inf, math.nan]),
    ("presence_penalty", [-2.0, 2.0], [-2.01, 2.01, math.nan]),
    ("frequency_penalty", [-2.0, 0.0], [2.5, -math.inf]),
    ("repetition_penalty", [1e-9, 1.0, 5.0], [0.0, -1.0, math.inf]),
    ("logprobs", [0, 20], [-1, 21]),
])
def test_bounds(name, good, bad):
    for v in good:
        check_sampling(common_pb2.SamplingParams(**{name: v}))
    for v in bad:
        with pytest.raises(RangeError) as e:
            check_sampling(common_pb2.SamplingParams(**{name: v}))
        assert e.value.field == f"sampling.{name}" and e.value.message.startswith(f"sampling.{name} must be ")


def test_logit_bias_keys_in_the_vocabulary_values_in_range():
    check_sampling(common_pb2.SamplingParams(logit_bias={0: -100.0, 5: 100.0}))
    with pytest.raises(RangeError, match=r"^sampling.logit_bias\[5\] must be a finite number in \[-100, 100\]"):
        check_sampling(common_pb2.SamplingParams(logit_bias={5: 100.5}))
    req = serve_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(logit_bias={2000: 1.0}))
    with pytest.raises(RangeError, match=r"keys must be token ids in \[0, 2000\) \(the model's vocabulary\), got 2000"):
        check_request(req, vocab_size=2000)


def test_token_ids_any_size_first_bad_named():
    check_token_ids("ids", [0, INT32_MAX])
    check_token_ids("ids", [0, 1999], vocab_size=2000)
    for ids, at in (([1, 2**70, -1], 1), ([5, -(2**70)], 1), ([3, 2000, 2001], 1), ([-1], 0)):
        with pytest.raises(RangeError) as e:
            check_token_ids("ids", ids, vocab_size=2000)
        assert e.value.field == f"ids[{at}]" and e.value.message.endswith(f"got {ids[at]}"), e.value.message
    with pytest.raises(RangeError, match=r"^sampling.stop_token_ids\[1\] must be a token id in \[0, 2147483647\]"):
        check_sampling(common_pb2.SamplingParams(stop_token_ids=[2, -2]))


def test_a_million_prompt_ids_are_checked_and_the_first_bad_one_named():
    req = serve_pb2.GenerateRequest(resume_token_ids=[1, 2])
    req.prompt_token_ids.ids.extend(range(1 << 20))
    check_request(req, vocab_size=1 << 20)  # every id in range: passes
    req.prompt_token_ids.ids.append(1 << 20)
    with pytest.raises(RangeError, match=rf"^prompt_token_ids\[{1 << 20}\] "):
        check_request(req, vocab_size=1 << 20)
