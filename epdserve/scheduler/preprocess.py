"""Tokenization and placeholder expansion, once per request, at the scheduler.

`RequestPreprocessor` loads only the checkpoint's tokenizer, image processor and config (never
the weights) and turns a public `GenerateRequest` into a `PreparedRequest`: expanded prompt
token ids (one `<|image_pad|>` per vision token), one `PreparedMedia` per image (MM Store key,
bytes, grid, token count) and validated sampling parameters. Every image sent as bytes is
decoded and preprocessed here, so a corrupt image fails its request with INVALID_ARGUMENT
before anything is routed, its message naming it ("image 2 is not a readable image (12 bytes):
..."; images and videos counted from 1, each kind apart, in the order the request lists them); so is every video (`Media.video` set, or a chat's video part), whose placeholder
expands to its per-temporal-patch timestamps and pad tokens (media then in prompt order). Media sent by key are looked up in `MediaIndex` (what this
scheduler learned from earlier requests), each under the cache salt of the request that sent
its bytes (its tenant's, `security/tenants.py`): a key another tenant sent answers exactly as a
key never seen does (INVALID_ARGUMENT, "unknown media key"), so keys neither cross tenants nor
tell which exist. Media sent by file id are the
caller's tenant's uploads (uploads.py: key, grid and bytes, never decoded again; NOT_FOUND when
the tenant has no such file).

Thread-safe: `prepare` runs in worker threads (it is CPU work), the index takes a lock.
"""
from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from epdserve.engine.sampling_params import SamplingParams
from epdserve.instance.sampling_wire import sampling_from_proto, sampling_to_proto
from epdserve.model.chat import chat_to_prompt
from epdserve.model.loader import eos_token_ids
from epdserve.model.loader import max_model_len as context_length
from epdserve.model.processor import MultimodalProcessor
from epdserve.request_errors import InvalidRequestError, MediaError, readable
from epdserve.rpc import common_pb2, serve_pb2
from epdserve.rpc.video_spec import video_options_from_proto
from epdserve.scheduler.errors import RequestError
from epdserve.seams.media_keys import MediaKeySecret, media_key

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass
class PreparedMedia:
    key: str
    data: bytes  # empty when the client sent only the key
    grid_thw: list[int]
    num_tokens: int
    kind: str = "image"  # or "video"
    expansion: list[int] | None = None  # a video's placeholder replacement
    video: common_pb2.VideoSpec | None = None  # a video's sampling options, passed on to E and P


@dataclass
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    media: list[PreparedMedia]
    sampling: common_pb2.SamplingParams  # validated; max_tokens always set
    params: SamplingParams
    num_vision_tokens: int = 0
    media_keys: list[str] = field(default_factory=list)

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens


class MediaIndex:
    """Bounded LRU: (cache salt, media key) -> (grid_thw, num_tokens), so clients may resend
    media by key, within the salt (tenant) that sent the bytes."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, str], tuple[list[int], int]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, key: str, grid_thw: list[int], num_tokens: int, salt: str = "") -> None:
        with self._lock:
            self._entries[salt, key] = (list(grid_thw), num_tokens)
            self._entries.move_to_end((salt, key))
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, key: str, salt: str = "") -> tuple[list[int], int] | None:
        with self._lock:
            hit = self._entries.get((salt, key))
            if hit is not None:
                self._entries.move_to_end((salt, key))
            return hit


class RequestPreprocessor:
    """`media_secret`: what media keys are keyed with (`seams.media_keys`; the scheduler's is the
    deployment's, default: this process's)."""

    def __init__(self, model_dir: str, max_model_len: int | None = None, media_secret: MediaKeySecret | None = None):
        from transformers import AutoConfig, AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.model_dir = str(model_dir)
        self.media_secret = media_secret or MediaKeySecret.of_process()
        self.config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir, local_files_only=True)
        tc = getattr(self.config, "text_config", self.config)
        self.vocab_size = int(tc.vocab_size)
        self.image_token_id = int(self.config.image_token_id)
        self.max_model_len = context_length(tc, max_model_len)
        self.processor = MultimodalProcessor(
            self.tokenizer, image_processor, self.image_token_id, self.config.vision_config.spatial_merge_size,
            self.max_model_len, video=_video_defaults(model_dir, self.config.model_type),
        )
        self.eos_token_ids = self._eos_ids()
        self.index = MediaIndex()

    @property
    def model_type(self) -> str:
        return self.config.model_type

    def prepare_upload(self, data: bytes, namespace: str, salt: str = "") -> PreparedMedia:
        """An uploaded image decoded, preprocessed and keyed as a request's, under its tenant's
        cache `salt` (upload_service.py)."""
        return self._media(common_pb2.Media(data=data), namespace, "the file", salt)

    def prepare(self, req: serve_pb2.GenerateRequest, namespace: str, salt: str = "", files=None) -> PreparedRequest:
        """Validate, tokenize, decode media, expand placeholders; media keyed under the request's
        cache `salt` (`security/tenants.py`). Raises RequestError. `files(file_id)`: the caller's
        uploaded file (uploads.py; NOT_FOUND if none), for media sent by file id."""
        try:
            params = sampling_from_proto(req.sampling)
        except InvalidRequestError as e:
            raise RequestError.invalid(str(e)) from None
        kind = req.WhichOneof("input")
        if kind == "prompt":
            ids, media = self._encode_text(req.prompt), list(req.media)
        elif kind == "prompt_token_ids":
            ids, media = list(req.prompt_token_ids.ids), list(req.media)  # in the vocabulary: the dispatcher checked
        elif kind == "chat":
            if req.media:
                raise RequestError.invalid("a chat request carries its images inside its messages, not in `media`")
            text, media = self._render_chat(req.chat)
            ids = self._encode_text(text)
        else:
            raise RequestError.invalid("the request has no prompt, prompt_token_ids or chat")
        n_videos = sum(1 for m in media if m.HasField("video"))
        try:
            self.processor.check_placeholders(ids, len(media) - n_videos)
            self.processor.check_video_placeholders(ids, n_videos)
        except InvalidRequestError as e:
            raise RequestError.invalid(str(e)) from None
        if media and not namespace:
            raise RequestError.unavailable("no instance has reported its media namespace yet")
        prepared = [self._media(m, namespace, label, salt, files) for m, label in zip(media, media_labels(media))]
        keys = [m.key for m in prepared]  # in the client's order
        try:
            expanded, order = self.processor.expand_media(ids, prepared)
        except InvalidRequestError as e:
            raise RequestError.invalid(str(e)) from None
        prepared = [prepared[i] for i in order]  # prompt order, as the engines read them
        return PreparedRequest(
            request_id=req.request_id or uuid.uuid4().hex,
            prompt_token_ids=expanded,
            media=prepared,
            sampling=sampling_to_proto(params),
            params=params,
            num_vision_tokens=sum(m.num_tokens for m in prepared),
            media_keys=keys,
        )

    # ---------------------------------------------------------------- pieces
    def _encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _render_chat(self, chat: serve_pb2.Chat) -> tuple[str, list[common_pb2.Media]]:
        """The rendered prompt and its media: images, then videos (`expand_media` pairs each kind)."""
        messages = []
        for msg in chat.messages:
            parts = []
            for part in msg.content:
                which = part.WhichOneof("part")
                if which == "text":
                    parts.append({"type": "text", "text": part.text})
                elif which == "image":
                    parts.append({"type": "image", "image": part.image})
                elif which == "video":
                    video = common_pb2.Media()
                    video.CopyFrom(part.video)
                    video.video.SetInParent()  # a video part is a video, its sampling options or not
                    parts.append({"type": "video", "video": video})
                else:
                    raise RequestError.invalid(f"empty content part in a {msg.role!r} message")
            messages.append({"role": msg.role, "content": parts})
        if not messages:
            raise RequestError.invalid("chat has no messages")
        add_gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        try:
            tools = json.loads(chat.tools_json) if chat.tools_json else None
            if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
                raise InvalidRequestError("chat.tools_json must be a JSON list of tool objects")
            rendered = chat_to_prompt(self.tokenizer, messages, add_gen, tools)
        except InvalidRequestError as e:
            raise RequestError.invalid(str(e)) from None
        except ValueError as e:  # tools_json is not JSON
            raise RequestError.invalid(f"chat.tools_json is not valid JSON: {e}") from None
        except Exception as e:  # the chat template may reject a conversation in many ways
            raise RequestError.invalid(f"cannot render the chat: {readable(e)}") from None
        mm = rendered["multi_modal_data"]
        return rendered["prompt"], [*mm["image"], *mm.get("video", [])]  # each kind in prompt order

    def _media(self, m: common_pb2.Media, namespace: str, label: str, salt: str = "", files=None) -> PreparedMedia:
        """One media item of the request; `label` names it in errors ("image 2", "video 1")."""
        which = m.WhichOneof("source")
        if which == "file_id":
            if m.HasField("video"):
                raise RequestError.invalid(f"{label}: uploads are images; a video is sent as its bytes")
            if files is None:
                raise RequestError.not_found(f"{label}: no file {m.file_id!r}")
            f = files(m.file_id)  # NOT_FOUND: unknown, expired, deleted or another caller's
            if not f.key.startswith(namespace + ":"):
                raise RequestError.not_found(f"{label}: file {m.file_id!r} was uploaded for another model")
            return PreparedMedia(f.key, f.data, list(f.grid_thw), f.num_tokens)
        if m.HasField("video"):
            if which != "data":
                raise RequestError.invalid(f"{label}: a video is sent as its bytes (no keys for videos)")
            try:
                mi = self.processor.preprocess_video(bytes(m.data), video_options_from_proto(m.video))
            except InvalidRequestError as e:
                raise RequestError.invalid(_about(label, e)) from None
            return PreparedMedia(media_key(mi.raw, namespace, self.media_secret, salt), bytes(m.data),
                                 [int(x) for x in mi.grid_thw.tolist()], mi.num_tokens, "video", mi.expansion, m.video)
        if which == "data":
            try:
                mi = self.processor.preprocess_image(bytes(m.data))
            except InvalidRequestError as e:
                raise RequestError.invalid(_about(label, e)) from None
            key = media_key(mi.raw, namespace, self.media_secret, salt)
            grid = [int(x) for x in mi.grid_thw.tolist()]
            self.index.put(key, grid, mi.num_tokens, salt)
            return PreparedMedia(key, bytes(m.data), grid, mi.num_tokens)
        if which == "key":
            if not m.key.startswith(namespace + ":"):
                raise RequestError.invalid(f"{label}: key {m.key!r} is not of this model's namespace {namespace!r}")
            hit = self.index.get(m.key, salt)  # another tenant's key: exactly as one never seen
            if hit is None:
                raise RequestError.invalid(f"{label}: unknown media key {m.key!r}; send the image bytes")
            return PreparedMedia(m.key, b"", hit[0], hit[1])
        raise RequestError.invalid(f"{label} has neither data nor key")

    def _eos_ids(self) -> list[int]:
        try:
            from transformers import GenerationConfig

            v = GenerationConfig.from_pretrained(self.model_dir, local_files_only=True).eos_token_id
        except Exception:  # no generation_config.json
            v = None
        return sorted(eos_token_ids(v, self.tokenizer))


def media_labels(media) -> list[str]:
    """How errors name each item of `media` (`Media` messages): "image N" / "video N", each kind
    counted from 1 in the order given (a chat's: prompt order)."""
    counts = {"image": 0, "video": 0}
    labels = []
    for m in media:
        kind = "video" if m.HasField("video") else "image"
        counts[kind] += 1
        labels.append(f"{kind} {counts[kind]}")
    return labels


def _about(label: str, e: InvalidRequestError) -> str:
    """`e`'s text about the media item `label`: "image 2 is not a readable image: ..."."""
    return str(e.naming(label)) if isinstance(e, MediaError) else f"{label}: {e}"


def _video_defaults(model_dir, model_type: str):
    """The checkpoint's video defaults and limits (None: the model takes no video)."""
    from epdserve.model.loader import VIDEO_ARCHS
    from epdserve.model.video import VideoOptions

    return VideoOptions.from_checkpoint(model_dir, VIDEO_ARCHS[model_type]) if model_type in VIDEO_ARCHS else None
