"""Offline Qwen2-VL style tokenizer for demo checkpoints.

Owns: a procedurally generated English corpus, a byte-level BPE trained on it with the
`tokenizers` library (Qwen2's pre-tokenizer split), the Qwen2-VL special tokens, and the
Qwen2-VL chat template. Nothing is downloaded; the same arguments give the same tokenizer.
"""
from __future__ import annotations

import random

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2's pre-tokenizer split (from Qwen2-VL-7B-Instruct's tokenizer.json): digits one by one.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The Qwen2-VL-7B-Instruct chat template: string or list-of-parts content, one
# <|vision_start|><|image_pad|><|vision_end|> per image part, default system turn.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SUBJECTS = (
    "the cat", "a dog", "the red car", "my friend", "the old man", "a young girl", "the teacher",
    "this picture", "the image", "the blue bird", "a small house", "the river", "the city",
    "our team", "the robot", "a green tree", "the window", "the mountain", "the ocean", "a child",
)
_VERBS = (
    "shows", "contains", "looks at", "runs to", "jumps over", "sits near", "describes", "holds",
    "paints", "follows", "watches", "finds", "carries", "opens", "builds", "reads", "likes",
)
_OBJECTS = (
    "a yellow circle", "two square boxes", "the bright sun", "a long road", "three apples",
    "the dark sky", "a wooden table", "the white wall", "some clouds", "a striped pattern",
    "the left corner", "a large triangle", "many colors", "the garden", "an empty chair",
)
_TAILS = (
    "in the morning", "at night", "near the center", "on the right side", "with great care",
    "very slowly", "again and again", "under the light", "before lunch", "after the rain",
)
_QUESTIONS = (
    "What is in this image?", "Describe the picture.", "What color is the shape?",
    "How many objects are there?", "Where is the circle?", "What do you see?",
    "Is it day or night?", "Tell me a short story.", "Summarize the scene.",
)
_SYLLABLES = (
    "ba", "ko", "ri", "mu", "te", "sa", "lo", "ne", "vi", "da", "pe", "gu", "zo", "fa", "chi",
    "tra", "ple", "ston", "mar", "quen", "dor", "lin", "est", "ing", "tion", "er", "ly", "ous",
)


def demo_corpus(num_lines: int, seed: int) -> list[str]:
    """Deterministic English-like text: template sentences, questions, numbers, made-up words."""
    if num_lines <= 0:
        raise ValueError(f"num_lines must be positive, got {num_lines}")
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        kind = i % 5
        if kind == 0:
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
            lines.append(s[0].upper() + s[1:])
        elif kind == 1:
            lines.append(f"{rng.choice(_QUESTIONS)} The answer is {rng.randint(0, 999)}.")
        elif kind == 2:
            words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(8)]
            lines.append(" ".join(words) + rng.choice((".", "!", "?", ",")))
        elif kind == 3:
            lines.append(f"system\nYou are a helpful assistant.\nuser\n{rng.choice(_QUESTIONS)}\n"
                         f"assistant\nI can see {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}.")
        else:
            lines.append(f"{rng.choice(_SUBJECTS).capitalize()}, {rng.choice(_OBJECTS)}; "
                         f"{rng.choice(_TAILS)} ({rng.randint(1, 60)} px)")
    return lines


def build_demo_tokenizer(vocab_size: int = 2000, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE and wrap it as a Qwen2-VL style `PreTrainedTokenizerFast`.

    `vocab_size` includes the special tokens; a small corpus may stop BPE early, so the
    result can be smaller: use `len(tokenizer)` as the model's vocabulary size.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must exceed the byte alphabet plus specials, got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    num_lines = max(2000, vocab_size * 4)
    tok.train_from_iterator(demo_corpus(num_lines, seed), trainer=trainer)
    # Specials go after the learned vocabulary, as in Qwen2 (ids >= the BPE vocab).
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=32768,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def special_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """Map each Qwen2-VL special token to its id in `tokenizer`."""
    ids = {}
    for token in SPECIAL_TOKENS:
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer lacks special token {token}")
        ids[token] = tid
    return ids
