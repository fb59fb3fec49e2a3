"""The global scheduler: public gRPC front, instance registry, routing, request fan-out.

One sentence per module:
- config.py      SchedulerConfig (ports, health hysteresis, backpressure, retries)
- registry.py    the instance roster with health hysteresis and per-instance outstanding work
- health.py      the prober: grpc.health.v1 checks, forgetting the long-dead, static instances
- routing.py     Router: coupled vs. P+D, media spread across E, least work (+ cached prefix) + id cursor, backpressure
- prompt_chunks.py  PromptChunker: a prompt's block hashes (seams/prefix_hash.py) in each pool's block size
- prefix_index.py   PrefixIndex: per instance, the prompt blocks this scheduler sent it (LRU; dropped when it dies)
- preprocess.py  tokenization, media decode + keys, placeholder expansion (tokenizer only, no model)
- attempt.py     one attempt's RPC choreography (Encode / Decode reserve / Prefill / Decode stream)
- dispatcher.py  admission, retries with resume, abort, usage and timing of each request
- channels.py    one grpc.aio channel per instance
- services.py    the EPDServe and Registry servicers
- server.py      SchedulerServer (asyncio) and SchedulerThread (hosted in a thread)
- errors.py      RequestError (status to the client) and InstanceError (what to do about a failure)
- pixel_budget.py  PixelBudget: scheduler-wide pixels of the requests whose media are still being decoded
- fair_pool.py     FairPool: the preprocessing threads, a free one to the tenant served least recently
- pressure.py    stage pressure over a sliding window: how far each stage (E, P, D) is past what it should carry
- controller.py  the `--mode auto` role controller: which instance should switch roles, when, and why
- coupling.py    the controller's coupling moves: fold prefill and decode into one engine, or split them
- uploads.py     Uploads: uploaded images by file id, scoped to the caller's identity, with a life and a byte bound
- upload_service.py  encode on upload: validate, key, send to an E at once; get; delete (features dropped)
"""
from epdserve.scheduler.config import SchedulerConfig


def __getattr__(name: str):
    """SchedulerServer / SchedulerThread on first use: a command's `--help` (which reads
    SchedulerConfig's flags) imports no gRPC server or torch."""
    if name in ("SchedulerServer", "SchedulerThread"):
        from epdserve.scheduler import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SchedulerConfig", "SchedulerServer", "SchedulerThread"]
