"""`choice_requests`: one `GenerateRequest` as its `n` choices (OpenAI's `n`), for both fronts.

The scheduler's wire serves one sequence per request; a request with n choices is n requests:
copies with ids ``<id>-c<j>`` (an empty id stays empty: the scheduler assigns one) and, when
seeded, seeds ``seed + j`` (wrapped inside int64), so each choice samples its own stream and a
seeded request reproduces. Whoever sends them (the HTTP front, `Client.generate_choices`) starts
the first alone and the others once its second message is out (or it ended): their prompts then
hit the prefix cache the first one filled on the prefilling instance and, in P-D, on D (which
caches a prompt's imported blocks at its first decode step), so the prompt is prefilled once and
only its last block crosses to D again.

The engines serve n as one sequence group (engine/sequence_group.py, `SamplingParams.n`: the
prompt prefilled once, the choices forked at the first token, one KV transfer in P-D, choice j
seeded seed + j exactly as here); the gRPC wire, the scheduler and these fronts do not use it
yet (docs/openai-sampling.md, "n"), so this fan-out stays until they carry `n` and a choice index.
"""
from __future__ import annotations

from epdserve.rpc import serve_pb2


def choice_requests(req: serve_pb2.GenerateRequest, n: int) -> list[serve_pb2.GenerateRequest]:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1:
        return [req]
    out = []
    for j in range(n):
        c = serve_pb2.GenerateRequest()
        c.CopyFrom(req)
        c.request_id = f"{req.request_id}-c{j}" if req.request_id else ""
        if c.sampling.HasField("seed"):
            c.sampling.seed = (c.sampling.seed + j + 2**63) % 2**64 - 2**63
        out.append(c)
    return out
