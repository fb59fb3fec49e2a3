"""Multi-turn workload: turn structure, images re-sent, history grown from the answers, seeded; per-turn metrics."""
import pytest

from epdserve.perf.multiturn import MultiturnConfig, build_conversations, clean_answer, history_prompt
from epdserve.perf.serving_metrics import SLO, RequestRecord
from epdserve.perf.turn_metrics import turn_metrics
from epdserve.perf.workload import PLACEHOLDER

SMALL = MultiturnConfig(conversations=4, turns=3, resolution_scale=0.1, output_len_mean=10, output_len_std=3,
                        output_len_min=5, output_len_max=15)


def test_turns_resend_the_images_and_grow_the_history_with_the_answers():
    conv = build_conversations(SMALL)[0]
    assert conv.turns == 3 and len(conv.max_tokens) == 3 and 1 <= len(conv.images) <= 2
    answers = ["The first answer.", "The second <|im_end|> answer."]
    reqs = [conv.request(t, answers) for t in range(3)]
    for t, r in enumerate(reqs):
        assert r.turn == t + 1 and r.request_id.endswith(f"-t{t + 1}") and r.max_tokens == conv.max_tokens[t]
        assert r.images == conv.images and r.prompt.count(PLACEHOLDER) == len(conv.images)  # re-sent every turn
        assert r.prompt.endswith("<|im_start|>assistant\n") and r.prompt.count("<|im_start|>user") == t + 1
        assert r.chat[-1] == ("user", conv.questions[t]) and len(r.chat) == 2 * t + 1
    # each turn's prompt extends the previous one with its answer and the next question
    assert reqs[1].prompt.startswith(reqs[0].prompt + "The first answer.<|im_end|>\n<|im_start|>user\n")
    assert reqs[2].prompt.startswith(reqs[1].prompt + "The second  answer.<|im_end|>\n")  # markers dropped
    assert reqs[2].chat[:4] == [("user", conv.questions[0]), ("assistant", "The first answer."),
                                ("user", conv.questions[1]), ("assistant", "The second  answer.")]
    assert reqs[0].repeated_images == 0 and reqs[1].repeated_images == len(conv.images)
    with pytest.raises(ValueError):
        conv.request(2, answers[:1])  # turn 3 needs both earlier answers


def test_same_seed_same_conversations_other_seed_differs():
    a, b = build_conversations(SMALL), build_conversations(SMALL)
    key = [(c.conversation_id, c.images, c.questions, c.max_tokens) for c in a]
    assert key == [(c.conversation_id, c.images, c.questions, c.max_tokens) for c in b]
    c = build_conversations(SMALL.with_(seed=1))
    assert [x.images for x in a] != [x.images for x in c]
    assert len({im for conv in a for im in conv.images}) == sum(len(conv.images) for conv in a)  # all distinct
    assert {len(conv.images) for conv in build_conversations(SMALL.with_(conversations=12))} == {1, 2}


def test_config_checks_and_summary():
    with pytest.raises(ValueError):
        MultiturnConfig(turns=0)
    with pytest.raises(ValueError):
        MultiturnConfig(images_min=0)
    cfg = SMALL.with_(resolution_mix={"720p": 1.0})
    assert cfg.resolution_mix == (("720p", 1.0),) and cfg.num_requests == 12
    assert "4 conversations x 3 turns" in cfg.summary() and cfg.to_dict()["resolution_mix"] == {"720p": 1.0}
    assert clean_answer(" <|vision_start|>a<|image_pad|> b ") == "a b"
    with pytest.raises(ValueError):
        history_prompt(["q1", "q2"], [], 1)


def _rec(turn, ttft, ok=True, cached=None, prompt=100):
    r = RequestRecord(f"c-t{turn}", t0=0.0, turn=turn, success=ok, prompt_tokens=prompt, cached_tokens=cached)
    if ok:
        r.chunk_times, r.chunk_tokens, r.end = [ttft, ttft + 0.01, ttft + 0.02], [1, 1, 1], ttft + 0.02
    return r


def test_turn_metrics_split_first_and_later_turns():
    recs = [_rec(1, 1.0), _rec(1, 1.2), _rec(2, 0.2), _rec(2, 0.4), _rec(3, 0.3), _rec(3, 0.0, ok=False)]
    tm = turn_metrics(recs, SLO(ttft_ms=500, tpot_ms=None))
    assert [p["turn"] for p in tm["per_turn"]] == [1, 2, 3]
    assert tm["per_turn"][0]["ttft_ms"]["p50"] == pytest.approx(1100)
    assert tm["per_turn"][2]["requests"] == 2 and tm["per_turn"][2]["completed"] == 1
    assert tm["first"]["ttft_ms"]["p50"] == pytest.approx(1100) and tm["later"]["ttft_ms"]["p50"] == pytest.approx(300)
    assert tm["later_over_first"] == pytest.approx(300 / 1100)
    assert tm["first"]["slo_attainment"] == 0.0 and tm["later"]["slo_attainment"] == pytest.approx(0.75)
    assert "cached_tokens" not in tm["later"] and "cached_share" not in tm["per_turn"][0]  # not reported: absent


def test_turn_metrics_cached_tokens_when_reported():
    recs = [_rec(1, 1.0, cached=0, prompt=100), _rec(2, 0.2, cached=96, prompt=160), _rec(2, 0.2, cached=64, prompt=160)]
    tm = turn_metrics(recs, SLO())
    assert tm["per_turn"][0]["cached_tokens_mean"] == 0 and tm["per_turn"][1]["cached_tokens_mean"] == 80
    assert tm["later"]["cached_share"] == pytest.approx(160 / 320)
