"""Instances: one process hosting one or more stage workers (E, P, D); the launcher is epdserve.deploy.

One sentence per module:
- modes.py           the deployment modes as one table: mode → instance pools (records of epdserve/roles.py), and back
- affinity.py        disjoint CPU core sets for co-located workers; per-thread pinning of torch teams
- worker.py          StageWorker: a loop thread owning one engine (over the process's shared model),
                     its call queue, request handles and load snapshot; submit / abort / outputs
- encode_worker.py   E: Encode RPC → engine request with media only (features → MM Store + event)
- prefill_worker.py  P: pair bootstrap → engine request with RemoteDecode (layerwise send connector)
- decode_worker.py   D: engine request with RemotePrefill (blocks reserved, receive connector) → stream
- coupled_worker.py  PD / EPD: the whole request in one engine
- convert.py         protobuf ↔ engine types (media refs, deltas, timings)
- sampling_wire.py   common.SamplingParams ↔ the engine's SamplingParams (the scheduler's side of the wire too)
- errors.py          failure → gRPC status (INVALID_ARGUMENT, ABORTED, RESOURCE_EXHAUSTED, UNAVAILABLE)
- servicer.py        the Instance gRPC service: each RPC to its worker
- registration.py    Register / Heartbeat / Deregister with the scheduler
- config.py          InstanceConfig: its fields are the `epdserve instance` flags
- host.py            InstanceHost: one loaded model + workers + MM Store + KV rendezvous + gRPC server
- identity.py        an instance's opaque roster id (``<roles>-<random>``)
- role_switch.py     live role switching (`SwitchRoles`): new roles without a restart
- colocation.py      the co-location policy: how co-located stages share one device (CPU and NPU)
- stage_stream.py    a co-located stage's own device stream, limited to its share of the cores
- device_share.py    the process's share of its NPU (--device-core-share: set_device_limit, once per process)
"""
