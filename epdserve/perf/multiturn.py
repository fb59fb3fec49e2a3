"""Seeded multi-turn chat workloads over images: the prefix cache's traffic.

Owns `MultiturnConfig` (the knobs: conversations, turns, think time, images, answer and question
lengths), `Conversation` (one conversation's images, questions and answer lengths, fixed by the
seed) and its `request(turn, answers)` (that turn's request: the whole history with the earlier
turns' actual answers, the images re-sent), `build_conversations` (config → the same
conversations on every call), `history_prompt` (the Qwen2-VL chat template around a history) and
`clean_answer` (an answer as it goes back into the history).

A conversation opens with 1-2 images (`images_min`..`images_max`) and a caption instruction; every
later turn appends the model's answer and a follow-up question, and sends the images again, as a
chat client re-sends its history. Answers are not known in advance: a conversation's turns are
sent one after another (bench/multiturn_runner.py), each built from the answers so far.
"""
from __future__ import annotations

import random
import re
import zlib
from dataclasses import asdict, dataclass, replace

from epdserve.perf.workload import CAPTION_INSTRUCTIONS, PLACEHOLDER, SYSTEM, BenchRequest, clipped_normal, resolution_size

MULTITURN = "multiturn"
FOLLOW_UPS = (
    "Which part of the image did you find hardest to describe, and why?",
    "Now compare the left half of the image with the right half.",
    "List the colours you mentioned, from the most to the least common.",
    "What would change if the picture were taken at night?",
    "Summarise your previous answer in one sentence, then add a detail you left out.",
    "Which shapes overlap, and where?",
)
_SPECIAL = re.compile(r"<\|[^|<>]*\|>")  # chat-template and vision markers: never part of a history's text


@dataclass(frozen=True)
class MultiturnConfig:
    """`conversations` conversations of `turns` turns; a conversation waits `think_time_s` after an
    answer before its next turn; conversations start on the arrival schedule (bench serve's
    --request-rate: conversations per second)."""

    name: str = MULTITURN
    conversations: int = 8
    turns: int = 4
    think_time_s: float = 2.0
    images_min: int = 1
    images_max: int = 2
    resolution_mix: tuple[tuple[str, float], ...] = (("360p", 0.5), ("720p", 0.5))
    resolution_scale: float = 0.25  # 160x90 and 320x180: the CPU presets' scaling (perf/presets.py)
    output_len_mean: float = 24.0  # answer tokens per turn (clipped normal; max_tokens + ignore_eos)
    output_len_std: float = 6.0
    output_len_min: int = 8
    output_len_max: int = 48
    question_words_mean: float = 12.0  # follow-up questions: a fixed sentence plus this many corpus words
    question_words_std: float = 4.0
    seed: int = 0

    def __post_init__(self):
        if self.conversations < 1 or self.turns < 1:
            raise ValueError("conversations and turns must be >= 1")
        if self.think_time_s < 0:
            raise ValueError("think_time_s must be >= 0")
        if not 1 <= self.images_min <= self.images_max:
            raise ValueError(f"need 1 <= images_min <= images_max, got {self.images_min}..{self.images_max}")
        if not 1 <= self.output_len_min <= self.output_len_max:
            raise ValueError("need 1 <= output_len_min <= output_len_max")
        if self.output_len_std < 0 or self.question_words_std < 0 or self.resolution_scale <= 0:
            raise ValueError("standard deviations must be >= 0 and resolution_scale > 0")
        if not self.resolution_mix or any(w < 0 for _, w in self.resolution_mix) or \
                sum(w for _, w in self.resolution_mix) <= 0:
            raise ValueError("resolution_mix needs at least one positive weight")
        for res, _ in self.resolution_mix:
            resolution_size(res)

    @property
    def num_requests(self) -> int:
        return self.conversations * self.turns

    def with_(self, **changes) -> MultiturnConfig:
        if isinstance(changes.get("resolution_mix"), dict):
            changes["resolution_mix"] = tuple(changes["resolution_mix"].items())
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["resolution_mix"] = dict(self.resolution_mix)
        return d

    def summary(self) -> str:
        img = f"{self.images_min}" if self.images_min == self.images_max else f"{self.images_min}-{self.images_max}"
        mix = "/".join(f"{n}:{w:g}" for n, w in self.resolution_mix)
        return (f"{self.conversations} conversations x {self.turns} turns, {img} image(s) each ({mix} "
                f"x{self.resolution_scale:g}) re-sent every turn, answers {self.output_len_mean:g}+-"
                f"{self.output_len_std:g} tokens [{self.output_len_min}, {self.output_len_max}], think time "
                f"{self.think_time_s:g} s; conversations start on the arrival schedule")


def history_prompt(questions: list[str], answers: list[str], num_images: int) -> str:
    """The Qwen2-VL chat template around a history: the images in the first user turn, then each
    question followed by its answer; open for the answer to the last question."""
    if len(answers) != len(questions) - 1:
        raise ValueError(f"{len(questions)} questions need {len(questions) - 1} answers, got {len(answers)}")
    parts = [SYSTEM]
    for i, q in enumerate(questions):
        media = PLACEHOLDER * num_images if i == 0 else ""
        parts.append(f"<|im_start|>user\n{media}{q}<|im_end|>\n<|im_start|>assistant\n")
        if i < len(answers):
            parts.append(f"{answers[i]}<|im_end|>\n")
    return "".join(parts)


def clean_answer(text: str) -> str:
    """An answer as it goes back into the history: chat and vision markers removed (they would
    open turns or media the history does not have), surrounding space trimmed."""
    return _SPECIAL.sub("", text).strip()


@dataclass
class Conversation:
    conversation_id: str
    images: list[bytes]
    image_labels: list[str]
    questions: list[str]  # one per turn
    max_tokens: list[int]  # the answer length of each turn
    think_time_s: float = 0.0

    @property
    def turns(self) -> int:
        return len(self.questions)

    def request(self, turn: int, answers: list[str]) -> BenchRequest:
        """Turn `turn` (0-based) given the answers to the turns before it (their text, as received)."""
        if not 0 <= turn < self.turns:
            raise ValueError(f"turn {turn} of a {self.turns}-turn conversation")
        answers = [clean_answer(a) for a in answers[:turn]]
        if len(answers) != turn:
            raise ValueError(f"turn {turn} needs the {turn} earlier answers, got {len(answers)}")
        chat = [m for q, a in zip(self.questions, answers) for m in (("user", q), ("assistant", a))]
        chat.append(("user", self.questions[turn]))
        return BenchRequest(request_id=f"{self.conversation_id}-t{turn + 1}",
                            prompt=history_prompt(self.questions[: turn + 1], answers, len(self.images)),
                            images=list(self.images), image_labels=list(self.image_labels),
                            repeated_images=len(self.images) if turn else 0, max_tokens=self.max_tokens[turn],
                            turn=turn + 1, chat=chat)


def build_conversations(cfg: MultiturnConfig) -> list[Conversation]:
    """The workload's conversations, in start order; the same config always gives the same bytes."""
    from epdserve.model.demo_images import jpeg_bytes, procedural_image
    from epdserve.model.demo_tokenizer import demo_corpus

    rng = random.Random(cfg.seed)
    names = [n for n, _ in cfg.resolution_mix]
    weights = [w for _, w in cfg.resolution_mix]
    words = " ".join(demo_corpus(200, seed=cfg.seed + 29)).split(" ")
    image_seed = (cfg.seed * 1_000_003 + zlib.crc32(cfg.name.encode()) * 7919) % (1 << 62)
    out, n_images = [], 0
    for c in range(cfg.conversations):
        conv = Conversation(f"{cfg.name}-{cfg.seed}-c{c}", [], [], [], [], cfg.think_time_s)
        for _ in range(rng.randint(cfg.images_min, cfg.images_max)):
            label = rng.choices(names, weights)[0]
            w, h = resolution_size(label, cfg.resolution_scale)
            conv.images.append(jpeg_bytes(procedural_image(w, h, seed=image_seed + n_images), quality=85))
            conv.image_labels.append(label)
            n_images += 1
        for t in range(cfg.turns):
            if t == 0:
                conv.questions.append(rng.choice(CAPTION_INSTRUCTIONS))
            else:
                n = clipped_normal(rng, cfg.question_words_mean, cfg.question_words_std, 0, 1e9)
                start = rng.randrange(0, max(1, len(words) - n))
                tail = " ".join(words[start : start + n])
                conv.questions.append(f"{rng.choice(FOLLOW_UPS)} {tail}".rstrip())
            conv.max_tokens.append(clipped_normal(rng, cfg.output_len_mean, cfg.output_len_std,
                                                  cfg.output_len_min, cfg.output_len_max))
        out.append(conv)
    return out

