"""`RosterCollector`: instances by role and health, and each instance's engine load, read from
the scheduler's `InstanceRegistry` at scrape time.

Instance-side metrics (batch, KV blocks in use, engine step time and batch size, P->D KV bytes
and failed transfers, KV prefix cache queries and hits) travel in the `Load` message of
`GetLoad` / heartbeats, which the scheduler already collects for routing, rather than from a
/metrics port per instance: one scrape target per deployment sees them all; no instance port is
opened to the scraper (instances stay on the cluster network, behind the cluster token and mutual
TLS); a new instance is scraped as soon as it registers, with no service discovery. The price: figures are as fresh as the last probe or
heartbeat (`--probe-interval`, `--heartbeat-interval`), and an instance's counters leave with it
(Prometheus treats its return as a counter reset). They are labelled by instance and roles; the
KV transfer metrics also by direction (P counts what it sent, D what it received).
"""
from __future__ import annotations

from collections import Counter as Tally

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from epdserve.roles import role_set
from epdserve.rpc import common_pb2

P = "epdserve:"


class RosterCollector:
    def __init__(self, scheduler):
        self.scheduler = scheduler

    def describe(self):
        return []  # scraped names vary with the roster; nothing to check at registration

    def collect(self):
        records = list(self.scheduler.registry.records())
        by = GaugeMetricFamily(P + "instances", "Known instances by roles and health", labels=["roles", "health"])
        tally = Tally((r.roles, common_pb2.HealthState.Name(r.health).lower()) for r in records)
        for (roles, health), n in sorted(tally.items()):
            by.add_metric([roles, health], n)
        yield by
        labels = ["instance", "roles"]
        gauges = {
            "running_requests": ("Requests running on the instance (its batch)", lambda x: x.running_requests),
            "waiting_requests": ("Requests waiting on the instance", lambda x: x.waiting_requests),
            "kv_blocks_used": ("KV cache blocks in use", lambda x: x.total_kv_blocks - x.free_kv_blocks),
            "kv_blocks_total": ("KV cache blocks", lambda x: x.total_kv_blocks),
            "queued_tokens": ("Prompt and vision tokens waiting to be encoded or prefilled", lambda x: x.queued_tokens),
            "queued_media": ("Images waiting to be encoded", lambda x: x.queued_media),
            "mm_cache_hit_rate": ("Local feature cache hits / lookups", lambda x: x.mm_cache_hit_rate),
        }
        for name, (doc, get) in gauges.items():
            g = GaugeMetricFamily(P + "instance_" + name, doc, labels=labels)
            for r in records:
                g.add_metric([r.instance_id, r.roles], get(r.load))
            yield g
        enc = CounterMetricFamily(P + "instance_images_encoded", "Images run through a vision encoder since start "
                                  "(on P/PD instances without E: recomputes)", labels=labels)
        for r in records:
            enc.add_metric([r.instance_id, r.roles], r.load.images_encoded)
        yield enc
        vis = CounterMetricFamily(P + "instance_vision_seconds", "Wall time in vision encoders since start "
                                  "(E workers, and engines that encode inline)", labels=labels)
        for r in records:
            vis.add_metric([r.instance_id, r.roles], r.load.vision_seconds)
        yield vis
        yield from _kv_transfer(records)
        yield from _engine_steps(records)
        yield from _prefix_cache(records)
        yield from _decode_graphs(records)


def _kv_transfer(records):
    kv_bytes = CounterMetricFamily(P + "instance_kv_transfer_bytes", "P->D KV bytes of finished transfers "
                                   "(direction sent: by P, acknowledged by D; received: by D)",
                                   labels=["instance", "roles", "direction"])
    failures = CounterMetricFamily(P + "instance_kv_transfer_failures", "P->D KV transfers that failed "
                                   "(sent: on P, including refused ones; received: on D)",
                                   labels=["instance", "roles", "direction"])
    leaked = CounterMetricFamily(P + "instance_kv_leaked_communicators", "P->D KV pairs torn down with an "
                                 "operation still running (HCCL: HcclCommDestroy returned E_AGAIN), each leaving a "
                                 "communicator no one can destroy until the process ends", labels=["instance", "roles"])
    for r in records:  # a coupled P+D instance (PD, EPD) keeps its KV: no transfer to count
        rs = role_set(r.roles)
        if rs.sends_kv:
            kv_bytes.add_metric([r.instance_id, r.roles, "sent"], r.load.kv_sent_bytes)
            failures.add_metric([r.instance_id, r.roles, "sent"], r.load.kv_send_failures)
        if rs.receives_kv:
            kv_bytes.add_metric([r.instance_id, r.roles, "received"], r.load.kv_received_bytes)
            failures.add_metric([r.instance_id, r.roles, "received"], r.load.kv_recv_failures)
        if rs.sends_kv or rs.receives_kv:
            leaked.add_metric([r.instance_id, r.roles], r.load.kv_leaked_communicators)
    yield kv_bytes
    yield failures
    yield leaked


def _engine_steps(records):
    labels = ["instance", "roles"]
    step = SummaryMetricFamily(P + "instance_engine_step_seconds", "Engine step wall time, vision encoding "
                               "apart (count: steps; sum: seconds)", labels=labels)
    batch = SummaryMetricFamily(P + "instance_engine_step_batch_size", "Requests in each engine step's batch "
                                "(count: steps; sum: requests)", labels=labels)
    for r in records:
        step.add_metric([r.instance_id, r.roles], r.load.engine_steps, r.load.engine_step_seconds)
        batch.add_metric([r.instance_id, r.roles], r.load.engine_steps, r.load.engine_step_requests)
    yield step
    yield batch


def _decode_graphs(records):
    """Whether decode steps replay graphs (engine/model_runner.py graph_report)."""
    labels = ["instance", "roles"]
    keys = GaugeMetricFamily(P + "instance_decode_graphs", "Decode graphs captured (batch x width buckets)",
                             labels=labels)
    capture = GaugeMetricFamily(P + "instance_decode_graph_capture_seconds", "Seconds the decode graph "
                                "captures took", labels=labels)
    replays = CounterMetricFamily(P + "instance_decode_graph_replays", "Decode-only steps replayed from a "
                                  "captured graph since start", labels=labels)
    eager = CounterMetricFamily(P + "instance_eager_decode_steps", "Decode-only steps run eagerly since start "
                                "(graphs off, or no captured bucket fits)", labels=labels)
    for r in records:
        lab = [r.instance_id, r.roles]
        keys.add_metric(lab, r.load.decode_graph_keys)
        capture.add_metric(lab, r.load.decode_graph_capture_seconds)
        replays.add_metric(lab, r.load.decode_graph_replays)
        eager.add_metric(lab, r.load.eager_decode_steps)
    yield from (keys, capture, replays, eager)


def _prefix_cache(records):
    """The KV prefix cache in tokens, as vLLM counts it (hit rate: hits / queries)."""
    labels = ["instance", "roles"]
    queries = CounterMetricFamily(P + "instance_prefix_cache_queries", "Prompt tokens looked up in the KV prefix "
                                  "cache since start", labels=labels)
    hits = CounterMetricFamily(P + "instance_prefix_cache_hits", "Prompt tokens whose KV came from the prefix "
                               "cache since start", labels=labels)
    for r in records:
        queries.add_metric([r.instance_id, r.roles], r.load.prefix_queried_tokens)
        hits.add_metric([r.instance_id, r.roles], r.load.prefix_hit_tokens)
    yield queries
    yield hits
