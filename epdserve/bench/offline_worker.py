"""Worker process of `epdserve bench offline`: runs ONE configuration on one workload.

Owns the process boundary: `python -m epdserve.bench.offline_worker JOB.json RESULT.json` reads a
`WorkerJob` (JSON), pins the thread count, rebuilds the seeded requests, runs the named
configuration and writes its `RunResult` plus the process's peak RSS as JSON. One process per
configuration keeps peak memory per configuration and stops one configuration's allocator
state or threads from colouring the next one's timing.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field, replace


@dataclass
class WorkerJob:
    config: str  # a key of offline_configs.CONFIGS
    model_dir: str
    workload: dict  # WorkloadSpec.to_dict()
    threads: int = 2
    num_requests: int | None = None  # run only the first N requests (None: all)
    engine_args: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def run_job(job: WorkerJob) -> dict:
    import torch
    import transformers

    from epdserve.bench.offline_configs import CONFIGS, RunContext
    from epdserve.bench.offline_workloads import WorkloadSpec, build_requests

    torch.set_num_threads(job.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    t0 = time.perf_counter()
    spec = WorkloadSpec(**job.workload)
    tokenizer = transformers.AutoTokenizer.from_pretrained(job.model_dir, local_files_only=True)
    requests = build_requests(spec, tokenizer)[: job.num_requests]
    # A warm-up request from another seed: its image is not one the timed run will see.
    warmup = build_requests(replace(spec, num_requests=1, seed=spec.seed + 7919), tokenizer)[0]
    ctx = RunContext(model_dir=job.model_dir, engine_args=dict(job.engine_args))
    load_before = os.getloadavg()[0]
    result = CONFIGS[job.config](ctx, requests, spec.output_len, warmup)
    return {
        "config": job.config,
        "workload": spec.name,
        "num_requests": len(requests),
        "threads": torch.get_num_threads(),
        "duration_s": result.duration_s,
        "cpu_s": result.cpu_s,
        # 1-minute load average of the machine (all users) before and after: > the core count means
        # other work was competing with this configuration.
        "loadavg_1m": [load_before, os.getloadavg()[0]],
        "prompt_tokens": result.prompt_tokens,
        "vision_tokens": result.vision_tokens,
        "output_tokens": sum(len(t) for t in result.tokens),
        "tokens": result.tokens,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "process_s": time.perf_counter() - t0,
        "extra": result.extra,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m epdserve.bench.offline_worker JOB.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = WorkerJob(**json.load(f))
    out = run_job(job)
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
