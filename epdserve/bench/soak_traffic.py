"""The soak's traffic: a fixed catalogue of requests of every kind, their expected outputs from the
offline engine, and how one of them is sent to a deployment.

Owns `SoakItem` (one request of the catalogue), `catalogue(...)` (the same items for the same
arguments), `expected_outputs(model, items)` (each greedy item's token ids per choice, from
epdserve's offline `LLM` on the same checkpoint: the engine the exactness tests check against
transformers) and `send(client, item, seed)` → `Sent` (what the client saw).

Kinds: `text`, `image` (procedural JPEG), `video` (a synthetic MP4, perf/clips.py), `n2` (greedy
n = 2: one sequence group), `json_schema` and `json_object` (greedy under a grammar), `upload`
(the image uploaded through the Files API first, the question referencing its file id, the upload
deleted afterwards), `multiturn` (turns of one conversation, perf/multiturn.py: each turn's prompt
is the previous turn's prompt, the offline engine's answer and a follow-up, so the prefix cache is
reused) and `sampled_json` (json_object at temperature 1 with a fresh seed per send: not compared
token for token, but a reply the grammar ended, `finish_reason == "stop"`, must parse as a JSON
object — issue 46's sampled-grammar stress). Every greedy kind is compared token for token.

What counts as answered and as lost: `LOST_DEFINITION` (the report quotes it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from epdserve.perf.workload import chat_prompt

GREEDY_KINDS = ("text", "image", "video", "n2", "json_schema", "json_object", "upload", "multiturn")
KINDS = (*GREEDY_KINDS, "sampled_json")
LOST_DEFINITION = ("a request is answered when the client call returned a complete result whose finish reason "
                   "is not 'error' (an upload-then-ask: the upload, the question and the delete all succeeded); "
                   "lost otherwise: after the Client's own retry policy (client/resume.py: a generation "
                   "that lost its scheduler is resumed for up to 60 s), as a user of the client sees it; "
                   "the soak adds no retry of its own")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["name", "count"]}


@dataclass(frozen=True)
class SoakItem:
    name: str
    kind: str
    prompt: str
    max_tokens: int
    images: tuple[bytes, ...] = ()
    videos: tuple[bytes, ...] = ()
    n: int = 1
    structured: dict | None = None  # vLLM's spelling: {"json": schema} / {"json_object": True}

    @property
    def greedy(self) -> bool:
        return self.kind != "sampled_json"

    def sampling(self, seed: int | None = None) -> dict:
        """The request's sampling fields (the client's keywords; the offline `SamplingParams`' too)."""
        if not self.greedy:
            return {"max_tokens": self.max_tokens, "temperature": 1.0, "seed": seed, "structured": self.structured}
        out = {"max_tokens": self.max_tokens, "temperature": 0.0}
        if self.structured is None:
            out["ignore_eos"] = True  # every token compared, never an early end
        else:
            out["structured"] = self.structured
        return out


@dataclass
class Sent:
    """What the client saw for one request: the token ids of each choice, or the error that lost it."""

    item: str
    kind: str
    choices: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def answered(self) -> bool:
        return not self.error


def catalogue(max_tokens: int = 12, sampled_max_tokens: int = 48, seed: int = 0) -> list[SoakItem]:
    """One or two items of each kind, the same bytes for the same arguments. The multiturn
    items' later turns are built by `with_turns` once the offline answers are known."""
    from epdserve.model.demo_images import jpeg_bytes, procedural_image
    from epdserve.perf.clips import synthetic_clip

    img = [jpeg_bytes(procedural_image(56 + 28 * k, 56, seed=seed * 1000 + k)) for k in range(3)]
    clip = synthetic_clip(64, 48, frames=8, fps=8, seed=seed)
    t = max_tokens
    return [
        SoakItem("text-0", "text", chat_prompt("Say something about the number 7."), t),
        SoakItem("text-1", "text", chat_prompt("Write a short line about rivers and stones, please."), t),
        SoakItem("image-0", "image", chat_prompt("Describe this picture briefly.", 1), t, (img[0],)),
        SoakItem("image-1", "image", chat_prompt("What colours do you see?", 1), t, (img[1],)),
        SoakItem("video-0", "video", chat_prompt("Describe what happens in this video.", 0, 1), t, (), (clip,)),
        SoakItem("n2-0", "n2", chat_prompt("Name two colours of this picture.", 1), t, (img[0],), n=2),
        SoakItem("json_schema-0", "json_schema", chat_prompt("Give a name and a count as JSON."), t,
                 structured={"json": SCHEMA}),
        SoakItem("json_object-0", "json_object", chat_prompt("Describe this picture as a JSON object.", 1), t,
                 (img[2],), structured={"json_object": True}),
        SoakItem("upload-0", "upload", chat_prompt("Describe this picture in one sentence.", 1), t, (img[2],)),
        SoakItem("sampled_json-0", "sampled_json", chat_prompt("Reply with a JSON object about cats."),
                 sampled_max_tokens, structured={"json_object": True}),
    ]


def conversation(max_tokens: int, turns: int = 3, seed: int = 0):
    """The multiturn kind's conversation (perf/multiturn.py), answers `max_tokens` long."""
    from epdserve.perf.multiturn import MultiturnConfig, build_conversations

    cfg = MultiturnConfig(conversations=1, turns=turns, images_min=1, images_max=1, output_len_mean=max_tokens,
                          output_len_std=0, output_len_min=max_tokens, output_len_max=max_tokens, seed=seed)
    return build_conversations(cfg)[0]


def turn_item(conv, turn: int, answers: list[str]) -> SoakItem:
    req = conv.request(turn, answers)
    return SoakItem(f"multiturn-t{turn + 1}", "multiturn", req.prompt, req.max_tokens, tuple(req.images))


def offline_prompt(item: SoakItem):
    if not item.images and not item.videos:
        return item.prompt
    data = {}
    if item.images:
        data["image"] = list(item.images)
    if item.videos:
        data["video"] = list(item.videos)
    return {"prompt": item.prompt, "multi_modal_data": data}


def offline_params(item: SoakItem):
    from epdserve.engine.sampling_params import SamplingParams
    from epdserve.engine.structured_output import StructuredOutput

    s = item.sampling()
    if s.get("structured") is not None:
        s["structured"] = StructuredOutput.from_options(s["structured"])
    return SamplingParams(n=item.n, **s)


def expected_outputs(model: str, items: list[SoakItem], turns: int = 3, seed: int = 0
                     ) -> tuple[list[SoakItem], dict[str, list[list[int]]]]:
    """(the items with the multiturn turns added, {greedy item name: token ids of each choice})
    from the offline engine on `model`. A turn's prompt carries the offline answers before it."""
    import gc

    from epdserve.entrypoints.llm import LLM

    greedy = [it for it in items if it.greedy]
    llm = LLM(model)
    try:
        outs = llm.generate([offline_prompt(it) for it in greedy], [offline_params(it) for it in greedy])
        expected = {}
        for it, o in zip(greedy, outs):
            if o.error:
                raise RuntimeError(f"the offline engine refused {it.name}: {o.error}")
            expected[it.name] = [c.token_ids for c in o.outputs]
        conv, answers, added = conversation(items[0].max_tokens if items else 12, turns, seed), [], []
        for t in range(turns):
            it = turn_item(conv, t, answers)
            o = llm.generate([offline_prompt(it)], [offline_params(it)])[0]
            expected[it.name] = [c.token_ids for c in o.outputs]
            answers.append(o.outputs[0].text)
            added.append(it)
    finally:
        del llm
        gc.collect()
    return [*items, *added], expected


def send(client, item: SoakItem, seed: int = 0) -> Sent:
    """Send `item` once with `client` (a `Client`); every exception is the request's loss."""
    from epdserve.client import EPDServeError, FileId

    out = Sent(item.name, item.kind)
    upload = None
    try:
        images = list(item.images)
        if item.kind == "upload":
            upload = client.upload(images[0], f"{item.name}.jpg").file_id
            images = [FileId(upload)]
        kwargs = item.sampling(seed)
        if item.videos:
            kwargs["videos"] = list(item.videos)
        if item.n > 1:
            results = client.generate_choices(item.prompt, images, n=item.n, **kwargs)
        else:
            results = [client.generate(item.prompt, images, **kwargs)]
        out.choices = [list(r.token_ids) for r in results]
        out.texts = [r.text for r in results]
        out.finish_reasons = [r.finish_reason for r in results]
        if "error" in out.finish_reasons:
            out.error = "finish_reason=error"
        if upload is not None:
            client.delete_upload(upload)
    except EPDServeError as e:
        out.error = e.code.name
    except Exception as e:  # counted as lost, never a silently dead client thread
        out.error = f"{type(e).__name__}: {e}"
    return out


def invalid_json(sent: Sent) -> bool:
    """A `sampled_json` reply the grammar ended (finish "stop") that does not parse as a JSON object."""
    for text, reason in zip(sent.texts, sent.finish_reasons):
        if reason != "stop":
            continue
        try:
            if not isinstance(json.loads(text), dict):
                return True
        except ValueError:
            return True
    return False

