"""Request fan-out: admission, attempts, retries, usage and timing for every public request.

Lifecycle of one request (`RequestRun.events`): checked against the input limits (`epdserve.limits`,
sizes and image headers only: INVALID_ARGUMENT or RESOURCE_EXHAUSTED before any work) and every
number against its range (`epdserve.rpc.ranges`: INVALID_ARGUMENT naming the field) → admitted
(or RESOURCE_EXHAUSTED past `max_requests_in_flight`, or past `max_pixels_in_flight`: its media's
declared pixels beside those of the requests whose media are still being decoded, `PixelBudget`,
held until its first token or its end) → prepared
(tokenized, media decoded and keyed, in a worker thread) → attempt 1 on a routed plan → deltas
stream to the client as instances produce them → the last delta carries finish reason, usage
and timing.

Choices (sampling.n > 1, OpenAI's n): the n choices run as one sequence group (one attempt, the
prompt prefilled once); every message carries its choice's `index`, each choice's last one is
finished with its own usage. The run keeps one output list per choice: a group that fails before
any output is retried whole; after some, each unfinished choice goes on alone (its own attempts,
seed + j, resumed after its own output as below), concurrently, so no choice is lost.

Retries, and the resume rule: when an instance fails mid-request (dies, is marked DOWN, its
stream breaks, or it reports a transient failure) the attempt is closed (calls cancelled,
Abort sent to its instances) and a new attempt starts elsewhere, with a fresh attempt id
("<id>#<n>"). It *resumes*: its prompt is the original prompt followed by every token already
streamed to the client, and its max_tokens is what is left, so no token is ever sent twice and
greedy output is unchanged. (Caveats: a stop string that would span the resume point is not
seen; a seeded sampled request continues with a fresh random stream.) At most `max_attempts`
attempts; then UNAVAILABLE (RESOURCE_EXHAUSTED if the last failure was "busy").

A client that lost its scheduler resumes the same way on another one (or on this one,
restarted): its request carries the token ids it already received (`resume_token_ids`), which
start the run as if this scheduler had streamed them itself.

Abort (public `Abort`) and client cancellation close the current attempt the same way; an
aborted stream ends with finish_reason "abort".

Tenants (`epdserve.security.tenants`): a request runs as its caller's tenant. Request ids are
the tenant's own (two tenants may use one id; `abort` finds only the caller's, and says "not
found" for another's exactly as for an id never seen); instances see ids made unique across
tenants. Its `cache_salt` (the tenant and the request's own salt) keys its media keys, its
prompt-chunk hashes and its first KV block, so no tenant is served, or told of, another's
cached prefix or media: usage's cached counts are the caller's own. `max_requests_per_tenant`
bounds one tenant's requests in flight (RESOURCE_EXHAUSTED, HTTP 429). Every instance call names
the tenant and its weight (`TenantShare`): engines admit and encode by each tenant's weighted
share (engine/fair_share.py), so a tenant that floods an instance does not keep another out.
The preprocessing threads are shared the same way (`FairPool`: a free thread goes to the tenant
served least recently).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing

import grpc

from epdserve.engine.request_parts import choice_seed
from epdserve.limits import LimitError, check_generate_request
from epdserve.rpc import common_pb2, instance_pb2, serve_pb2
from epdserve.rpc.ranges import RangeError, check_request
from epdserve.scheduler.attempt import Attempt, AttemptInputs, merge_timings
from epdserve.scheduler.channels import ChannelPool
from epdserve.scheduler.config import SchedulerConfig
from epdserve.scheduler.errors import Action, InstanceError, RequestError
from epdserve.scheduler.fair_pool import FairPool
from epdserve.scheduler.pixel_budget import PixelBudget
from epdserve.scheduler.preprocess import PreparedRequest, RequestPreprocessor
from epdserve.scheduler.prompt_chunks import PromptChunker
from epdserve.scheduler.registry import InstanceRecord, InstanceRegistry
from epdserve.scheduler.routing import Router
from epdserve.scheduler.upload_service import UploadService
from epdserve.scheduler.uploads import Uploads
from epdserve.security.tenants import DEFAULT_TENANT, cache_salt

MAX_CACHE_SALT_CHARS = 256

log = logging.getLogger(__name__)

_SWITCH_POLL_S = 0.05  # how often a request waiting out a role switch looks at the roster again


class StoredKeys:
    """Media keys an E instance confirmed are in the MM Store (bounded LRU): later requests
    skip E for them (P looks them up once). A key evicted since costs only a recompute at P."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)


class _Split(Exception):
    """A group's attempt failed after some of its choices had output: each unfinished choice goes on
    as its own request (`RequestRun._merged`), resumed after its own output."""

    def __init__(self, choices: list[int], next_try: int):
        self.choices, self.next_try = choices, next_try


class RequestRun:
    def __init__(self, dispatcher: Dispatcher, prep: PreparedRequest, arrival: float, deadline: float | None,
                 tenant: str = DEFAULT_TENANT, salt: str = ""):
        self.d = dispatcher
        self.prep = prep
        self.tenant, self.salt = tenant, salt
        # the id instances see: the client's, made unique across tenants (ids are per tenant)
        self.wire_id = prep.request_id if not tenant else \
            f"{prep.request_id}@{hashlib.sha256(tenant.encode()).hexdigest()[:12]}"
        self.deadline = deadline
        self.timing = common_pb2.StageTimings(arrival=arrival)
        self.n = max(1, prep.sampling.n)  # choices (OpenAI's n), served as one sequence group
        self.outputs: list[list[int]] = [[] for _ in range(self.n)]  # each choice's tokens streamed so far
        self.ended: dict[int, str] = {}  # choice -> its finish reason
        self.live: set[Attempt] = set()  # attempts running now (one, or one per choice after a split)
        self.attempts: list[Attempt] = []
        self.first: Attempt | None = None  # the attempt that produced the first token
        self.first_at: float | None = None  # ... when it reached the scheduler (Unix seconds)
        self.resumed = 0  # output tokens the client already had (resume_token_ids)
        self.aborted = False
        self.prefix: dict[int, list[bytes]] = {}  # block size -> the prompt's block hashes (prompt_chunks.py)
        self._wake = asyncio.Event()

    @property
    def attempt(self) -> Attempt | None:
        """The latest attempt (None before the first)."""
        return self.attempts[-1] if self.attempts else None

    @property
    def generated(self) -> list[int]:
        """Choice 0's output so far (the request's, when n is 1)."""
        return self.outputs[0]

    @generated.setter
    def generated(self, ids: list[int]) -> None:
        self.outputs[0] = list(ids)

    def abort(self) -> None:
        self.aborted = True
        self._wake.set()
        for a in list(self.live):
            a.cancel(InstanceError("client", "attempt", grpc.StatusCode.CANCELLED, "aborted by the client"))

    def instance_down(self, rec: InstanceRecord) -> None:
        for a in list(self.live):
            a.kill(rec.instance_id, f"instance {rec.instance_id} is down")

    async def events(self) -> AsyncIterator[serve_pb2.GenerateDelta]:
        """The public stream: every choice's deltas (`index`), each choice's last one finished with
        its usage; the n choices run as one group, and each unfinished one alone after a failure
        that came once some had output (`_Split`)."""
        finished = False
        avoid: set[str] = set()
        try:
            split = None
            try:  # aclosing: a client that leaves closes the lanes at once (no retry starts after it)
                async with aclosing(self._lane(tuple(range(self.n)), 1, avoid)) as lane:
                    async for j, piece in lane:
                        delta = self._delta(j, piece)
                        if delta is not None:
                            yield delta
            except _Split as e:
                split = e
            if split is not None:
                async with aclosing(self._merged(split, avoid)) as lanes:
                    async for j, piece in lanes:
                        delta = self._delta(j, piece)
                        if delta is not None:
                            yield delta
            if self.aborted:
                for j in range(self.n):
                    if j not in self.ended:
                        self.ended[j] = "abort"
                        yield self._final(j, [], "", "abort")
            finished = True
        finally:
            for a in self.attempts:  # closed already unless it failed or the client left
                a.close(abort=not finished)

    async def _lane(self, choices: tuple[int, ...], first_try: int, avoid: set[str]):
        """`choices` (one, or the whole group) as attempts `first_try`.. until they all finished:
        (choice, Piece) as they come. Retried (resumed after what was streamed) on an instance's
        failure; a group that fails once some choice had output raises `_Split`."""
        cfg, prep = self.d.config, self.prep
        last_error: InstanceError | None = None
        for n in range(first_try, cfg.max_attempts + 1):
            if self.aborted:
                return
            attempt = await self._routed_attempt(n, avoid, choices)
            self.live.add(attempt)
            try:
                async for piece in attempt.run():
                    j = choices[piece.index] if piece.index < len(choices) else None
                    if j is None or j in self.ended:
                        continue
                    if piece.token_ids and self.first is None:
                        self.first, self.first_at = attempt, time.time()
                    self.outputs[j].extend(piece.token_ids)
                    if piece.finished:
                        self.ended[j] = piece.finish_reason
                        if all(c in self.ended for c in choices):
                            await attempt.encode_results()
                            attempt.close(abort=False)
                            self._learn_stored(attempt)
                    yield j, piece
                return
            except InstanceError as e:
                attempt.close(abort=True)
                self._learn_stored(attempt)
                if self.aborted:
                    return
                last_error = e
                self._handle_failure(e, avoid)
                log.warning("request %s attempt %d failed (%s); %s", prep.request_id, n, e,
                            "retrying" if n < cfg.max_attempts else "giving up")
                if n < cfg.max_attempts:
                    await self._backoff(n)
                    if len(choices) > 1 and any(self.outputs[c] for c in choices):
                        raise _Split([c for c in choices if c not in self.ended], n + 1) from None
            finally:
                self.live.discard(attempt)
        if self.aborted:
            return
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if last_error and last_error.action is Action.BUSY \
            else grpc.StatusCode.UNAVAILABLE
        raise RequestError(code, f"request {prep.request_id} failed after {cfg.max_attempts} attempts: {last_error}")

    async def _merged(self, split: _Split, avoid: set[str]):
        """Each of `split.choices` as its own lane, concurrently: their (choice, Piece) merged."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(j: int) -> None:
            try:
                async for item in self._lane((j,), split.next_try, set(avoid)):
                    await queue.put(item)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
                await queue.put(e)
                return
            await queue.put(None)

        pumps = [asyncio.ensure_future(pump(j)) for j in split.choices]
        try:
            running = len(pumps)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    def _delta(self, j: int, piece) -> serve_pb2.GenerateDelta | None:
        if piece.finished:
            return self._final(j, piece.token_ids, piece.text, piece.finish_reason, piece.logprobs)
        if piece.token_ids or piece.text:
            return serve_pb2.GenerateDelta(request_id=self.prep.request_id, token_ids=piece.token_ids,
                                           text=piece.text, logprobs=piece.logprobs, index=j)
        return None

    # ---------------------------------------------------------------- pieces
    async def _routed_attempt(self, n: int, avoid: set[str], choices: tuple[int, ...] = (0,)) -> Attempt:
        """Start attempt `n`; while a role has no instance only because one is switching roles,
        wait for it (up to `switch_wait_s`) instead of failing the request."""
        deadline = time.monotonic() + self.d.config.switch_wait_s
        while True:
            try:
                return self._start_attempt(n, avoid, choices)
            except RequestError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE or not self.d.registry.switching() \
                        or time.monotonic() > deadline or self.aborted:
                    raise
            await asyncio.sleep(_SWITCH_POLL_S)

    def _start_attempt(self, n: int, avoid: set[str], choices: tuple[int, ...] = (0,)) -> Attempt:
        """Attempt `n` at `choices`: the whole group (sampling.n as asked), or one choice of it alone
        (n unset, seeded seed + j as the group seeds it), after its own output so far."""
        prep, d = self.prep, self.d
        group = len(choices) > 1
        generated = [] if group else self.outputs[choices[0]]
        media_tokens = [m.num_tokens for m in prep.media]
        seen: set[str] = set()
        encode = []
        for i, m in enumerate(prep.media):
            if m.data and m.key not in d.stored and m.key not in seen:
                encode.append(i)
            seen.add(m.key)
        prompt = prep.prompt_token_ids + generated
        remaining = prep.max_tokens - len(generated)
        plan, lease = d.router.plan(len(prompt), remaining * len(choices), media_tokens, encode, avoid,
                                    prefix=self.prefix)
        encoding = {prep.media[i].key for _, items in plan.encodes for i in items}
        refs = [
            instance_pb2.MediaRef(key=m.key, data=m.data, grid_thw=m.grid_thw, num_tokens=m.num_tokens,
                                  expect_features=m.key in encoding, video=m.video)
            for m in prep.media
        ]
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(prep.sampling)
        sampling.max_tokens = remaining
        if sampling.HasField("structured"):  # the resumed output joins the prompt: the grammar replays it
            sampling.structured.replay_prompt_tokens = len(generated)
        if generated:  # the penalties count the resumed tokens as output (engine/logits_process.py)
            sampling.resumed_outputs = sampling.resumed_outputs + len(generated)
        wire_id = f"{self.wire_id}#{n}"
        if self.n > 1 and not group:  # one choice of the group, alone: its own id and seed
            sampling.ClearField("n")
            if sampling.HasField("seed"):
                sampling.seed = choice_seed(sampling.seed, choices[0])
            wire_id = f"{self.wire_id}.c{choices[0]}#{n}"
        inputs = AttemptInputs(wire_id, prompt, refs, sampling, prep.num_vision_tokens, self.deadline, self.salt,
                               instance_pb2.TenantShare(name=self.tenant, weight=self.d.tenant_weight(self.tenant)))
        attempt = Attempt(inputs, plan, lease, d.channels, d.registry, d.background)
        attempt.encoded_keys = encoding
        self.attempts.append(attempt)
        if not self.timing.dispatched:
            self.timing.dispatched = time.time()
        return attempt

    def _handle_failure(self, e: InstanceError, avoid: set[str]) -> None:
        action = e.action
        if action is Action.FAIL:
            raise RequestError.invalid(e.message)
        if action is Action.DEADLINE:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, e.message)
        if action is Action.RETRY_DEAD:
            self.d.registry.record_failure(e.instance_id, f"{e.stage}: {e.code.name}")
            avoid.add(e.instance_id)
        elif action is Action.BUSY:
            avoid.add(e.instance_id)

    async def _backoff(self, n: int) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=self.d.config.retry_backoff_s * n)
        except asyncio.TimeoutError:
            pass

    def _learn_stored(self, attempt: Attempt) -> None:
        for key in attempt.report.already_stored:  # answered: it is in the store now
            self.d.stored.add(key)

    def _final(self, j: int, token_ids: list[int], text: str, reason: str, logprobs=()) -> serve_pb2.GenerateDelta:
        """Choice j's last message: its finish reason, and usage with its own output tokens."""
        for a in self.attempts:
            merge_timings(self.timing, a.report.timings)
        self.timing.finished = time.time()
        return serve_pb2.GenerateDelta(
            request_id=self.prep.request_id, token_ids=token_ids, text=text, finished=True, finish_reason=reason,
            usage=self._usage(j), timing=self.timing, media_keys=self.prep.media_keys, logprobs=logprobs, index=j,
        )

    def _usage(self, j: int = 0) -> common_pb2.Usage:
        prep = self.prep
        vision = prep.num_vision_tokens
        return common_pb2.Usage(
            prompt_tokens=len(prep.prompt_token_ids), prompt_text_tokens=len(prep.prompt_token_ids) - vision,
            vision_tokens=vision, cached_vision_tokens=self._cached_vision_tokens(), output_tokens=len(self.outputs[j]),
            cached_tokens=min(self.first.report.kv_cached_tokens, len(prep.prompt_token_ids)) if self.first else 0,
        )

    def _cached_vision_tokens(self) -> int:
        """Vision tokens not encoded for this request: E found them stored, or E was skipped and
        the prefilling instance read them (see the module docstring of attempt.py)."""
        a = self.first
        if a is None or not self.prep.media:
            return 0
        rep = a.report
        cached = sum(m.num_tokens for m in self.prep.media if rep.already_stored.get(m.key))
        others = [m for m in self.prep.media if m.key not in a.encoded_keys]
        if a.plan.coupled is not None:
            cached += min(rep.reported_cached_tokens, sum(m.num_tokens for m in others))
        else:
            cached += sum(m.num_tokens for m in others if m.key not in rep.recomputed)
        return min(cached, self.prep.num_vision_tokens)


class Dispatcher:
    def __init__(self, config: SchedulerConfig, registry: InstanceRegistry, router: Router,
                 channels: ChannelPool, preprocessor: RequestPreprocessor,
                 tenant_weight: Callable[[str], float] | None = None):
        self.config = config
        self.tenant_weight = tenant_weight or (lambda tenant: 1.0)  # the keys file's @weight (fair share)
        self.registry = registry
        self.router = router
        self.channels = channels
        self.preprocessor = preprocessor
        self.stored = StoredKeys(config.stored_keys_size)
        preprocessor.index.capacity = config.media_index_size
        self.runs: dict[tuple[str, str], RequestRun] = {}  # (tenant, request id) -> its run
        self._per_tenant: dict[str, int] = {}  # tenant -> requests admitted
        self._seqs_per_tenant: dict[str, int] = {}  # tenant -> their sequences (n each)
        self._tokens_per_tenant: dict[str, int] = {}  # tenant -> prompt + n x max_tokens of its requests
        self.finished_listeners: list = []  # each finished request: listener(ttft_s, tpot_s, ok, media, age_s) (the role controller)
        self.background: set[asyncio.Task] = set()
        self._admitted = 0
        self.pixels = PixelBudget(config.max_pixels_in_flight)
        self.chunker = PromptChunker((preprocessor.image_token_id, preprocessor.processor.video_token_id)) \
            if router.cache_aware else None
        self.pool = ThreadPoolExecutor(max_workers=config.preprocess_threads, thread_name_prefix="epdserve-prep")
        self.prep = FairPool(self.pool, config.preprocess_threads)  # the threads, shared fairly by tenants
        self.uploads = UploadService(self, Uploads(config.upload_ttl_s, config.upload_max_bytes,
                                                   tenant_max_bytes=config.upload_tenant_max_bytes,
                                                   tenant_max_files=config.upload_tenant_max_files))
        registry.on_down(self._instance_down)

    @property
    def in_flight(self) -> int:
        return self._admitted

    @property
    def pixels_in_flight(self) -> int:
        """Declared pixels of the admitted requests whose media are not done with yet (`PixelBudget`)."""
        return self.pixels.used

    async def generate(self, req: serve_pb2.GenerateRequest, deadline: float | None = None,
                       tenant: str = DEFAULT_TENANT) -> AsyncIterator[serve_pb2.GenerateDelta]:
        """The public stream of one request, run as `tenant`'s. Raises RequestError."""
        arrival = time.time()
        try:
            pixels = check_generate_request(req, self.config.limits)
            check_request(req, self.preprocessor.vocab_size)
        except LimitError as e:
            raise RequestError(e.grpc_code, e.message) from None
        except RangeError as e:
            raise RequestError.invalid(e.message) from None
        if len(req.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise RequestError.invalid(f"cache_salt is {len(req.cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}")
        salt = cache_salt(tenant, req.cache_salt)
        n, seq_quota = max(1, req.sampling.n), self.config.max_sequences_per_tenant
        if seq_quota is not None and n > seq_quota:
            raise RequestError.invalid(f"n={n} sequences exceed a tenant's limit ({seq_quota}: --max-sequences-per-tenant)")
        held = self.pixels.take(pixels)  # INVALID_ARGUMENT first: a request that never fits is no "retry later"
        if self._admitted >= self.config.max_requests_in_flight:
            held.release()
            raise RequestError.exhausted(f"{self._admitted} requests in flight (limit {self.config.max_requests_in_flight})")
        quota, mine = self.config.max_requests_per_tenant, self._per_tenant.get(tenant, 0)
        if quota is not None and mine >= quota:
            held.release()
            raise RequestError.exhausted(f"this tenant has {mine} requests in flight (its limit {quota})")
        seqs = self._seqs_per_tenant.get(tenant, 0)
        if seq_quota is not None and seqs + n > seq_quota:
            held.release()
            raise RequestError.exhausted(f"this tenant has {seqs} sequences in flight; {n} more exceed its limit "
                                         f"({seq_quota}: --max-sequences-per-tenant)")
        self._admitted += 1
        self._per_tenant[tenant] = mine + 1
        self._seqs_per_tenant[tenant] = seqs + n
        tokens = 0  # taken once the prompt is tokenized (`_take_tokens`)
        try:
            if req.request_id and (tenant, req.request_id) in self.runs:
                raise RequestError.invalid(f"request id {req.request_id!r} is already in flight")
            prep, prefix = await self.prep.run(tenant, self._prepare, req, self.registry.namespace,
                                               self._block_sizes(), salt, tenant)
            if (tenant, prep.request_id) in self.runs:
                raise RequestError.invalid(f"request id {prep.request_id!r} is already in flight")
            tokens = self._take_tokens(tenant, prep, n)
            run = RequestRun(self, prep, arrival, deadline, tenant, salt)
            run.generated = self._resumed(req, prep)
            run.resumed = len(run.generated)
            run.prefix = prefix
            self.runs[tenant, prep.request_id] = run
            ok = False
            try:
                async for delta in run.events():
                    held.release()  # its first output: every stage has read its media
                    yield delta
                ok = True
            finally:
                self.runs.pop((tenant, prep.request_id), None)
                self._report_finished(run, ok)
        finally:
            self._admitted -= 1
            for counts, k in ((self._per_tenant, 1), (self._seqs_per_tenant, n), (self._tokens_per_tenant, tokens)):
                if not k:
                    continue
                left = counts[tenant] - k
                if left:
                    counts[tenant] = left
                else:
                    del counts[tenant]
            held.release()

    def _take_tokens(self, tenant: str, prep, n: int) -> int:
        """Count the request's tokens (prompt, vision included, + n x max_tokens) against its tenant's
        `max_tokens_per_tenant`; RequestError (400 alone over it, else 429) when they do not fit."""
        quota = self.config.max_tokens_per_tenant
        if quota is None:
            return 0
        tokens = len(prep.prompt_token_ids) + n * prep.max_tokens
        if tokens > quota:
            raise RequestError.invalid(f"this request's {tokens} tokens (prompt + n x max_tokens) exceed a tenant's "
                                       f"limit ({quota}: --max-tokens-per-tenant)")
        mine = self._tokens_per_tenant.get(tenant, 0)
        if mine + tokens > quota:
            raise RequestError.exhausted(f"this tenant has {mine} tokens in flight; {tokens} more exceed its limit "
                                         f"({quota}: --max-tokens-per-tenant)")
        self._tokens_per_tenant[tenant] = mine + tokens
        return tokens

    def _block_sizes(self) -> set[int]:
        """The block sizes of the instances that prefill (on the event loop: the registry's thread)."""
        return {r.block_size for r in self.registry.records() if r.role_set.prefills}

    def _prepare(self, req: serve_pb2.GenerateRequest, namespace: str, block_sizes: set[int],
                 salt: str = "", tenant: str = DEFAULT_TENANT) -> tuple[PreparedRequest, dict[int, list[bytes]]]:
        """In a worker thread: the prepared request and, for cache-aware routing, its prompt's block
        hashes in each of `block_sizes` (both keyed by the request's cache `salt`); media sent by
        file id are `tenant`'s uploads."""
        prep = self.preprocessor.prepare(req, namespace, salt, lambda file_id: self.uploads.get(tenant, file_id))
        if self.chunker is None:
            return prep, {}
        return prep, self.chunker.by_block_size(prep.prompt_token_ids, prep.media, block_sizes, salt)

    def _report_finished(self, run: RequestRun, ok: bool) -> None:
        """Tell `finished_listeners(ttft_s, tpot_s, ok, media, age_s)` how a request went (scheduler's
        clock; TPOT None with fewer than two tokens streamed; media: its images and videos; age_s:
        seconds since it arrived)."""
        if not self.finished_listeners:
            return
        now = time.time()
        ttft = run.first_at - run.timing.arrival if run.first_at is not None else None
        n = len(run.generated) - run.resumed
        tpot = (now - run.first_at) / (n - 1) if run.first_at is not None and n > 1 else None
        for listener in self.finished_listeners:
            listener(ttft, tpot, ok, len(run.prep.media), now - run.timing.arrival)

    def _resumed(self, req: serve_pb2.GenerateRequest, prep: PreparedRequest) -> list[int]:
        """The output a resuming client already has (its ids checked with the rest: `check_request`):
        the run continues after it."""
        ids = list(req.resume_token_ids)
        if ids and req.sampling.n > 1:
            raise RequestError.invalid("resume_token_ids cannot resume a request with sampling.n > 1 "
                                       "(whose output is n choices)")
        if len(ids) >= prep.max_tokens:
            raise RequestError.invalid(f"{len(ids)} resume_token_ids leave nothing of max_tokens={prep.max_tokens}")
        return ids

    def abort(self, request_id: str, tenant: str = DEFAULT_TENANT) -> bool:
        """Abort `tenant`'s request `request_id`; False when it has none in flight by that id
        (another tenant's is not found either)."""
        run = self.runs.get((tenant, request_id))
        if run is None:
            return False
        run.abort()
        return True

    def _instance_down(self, rec: InstanceRecord) -> None:
        for run in list(self.runs.values()):
            run.instance_down(rec)

    async def close(self) -> None:
        for run in list(self.runs.values()):
            run.abort()
        if self.background:
            await asyncio.wait(list(self.background), timeout=2.0)
        self.pool.shutdown(wait=False, cancel_futures=True)
