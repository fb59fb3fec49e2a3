"""Instances: one process hosting one or more stage workers (E, P, D), and the launcher's processes.

One sentence per module:
- roles.py           roles → stage workers (coupled PD/EPD, co-located EP/ED), mode → instance pools
- affinity.py        disjoint CPU core sets for co-located workers; per-thread pinning of torch teams
- worker.py          StageWorker: a loop thread owning one engine, its call queue and load snapshot
- encode_worker.py   E: media → vision encoder → MM Store + feature event to the target P
- prefill_worker.py  P: pair bootstrap → prefill → layerwise KV send → release once D acknowledged
- kv_hook.py         the layer hook that drives the KVSender from the engine's layer loop
- decode_worker.py   D: block reservation → KV receive → decode → stream
- coupled_worker.py  PD / EPD: the whole request in one engine
- convert.py         protobuf ↔ engine types (sampling params, media refs, deltas, timings)
- errors.py          failure → gRPC status (INVALID_ARGUMENT, ABORTED, RESOURCE_EXHAUSTED, UNAVAILABLE)
- servicer.py        the Instance gRPC service: each RPC to its worker
- registration.py    Register / Heartbeat / Deregister with the scheduler
- config.py          InstanceConfig and the `epdserve instance` flags
- host.py            InstanceHost: workers + MM Store + KV rendezvous + gRPC server, in order
- procs.py           child processes that cannot outlive the launcher
- deployment.py      one mode's processes: private MM Store, scheduler, instances
"""
