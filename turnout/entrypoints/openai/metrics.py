"""Prometheus metrics of one server: engine gauges and counters read at scrape time, latency histograms
fed by the engine thread. One CollectorRegistry per app, so several apps can live in one process."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from turnout.engine.async_engine import EngineObserver

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0)


class _EngineCollector:
    def __init__(self, state):
        self.state = state

    def collect(self):
        st = self.state
        eng = st.async_engine
        s = eng.stats if eng is not None else None
        g = GaugeMetricFamily

        def gauge(name, doc, value):
            m = g(name, doc)
            m.add_metric([], value)
            return m

        def counter(name, doc, value):
            m = CounterMetricFamily(name, doc)
            m.add_metric([], value)
            return m

        yield gauge("turnout_num_requests_running", "Requests being generated (engine running set).",
                    s.num_running if s else 0)
        yield gauge("turnout_num_requests_waiting", "Requests admitted and waiting to be scheduled.",
                    s.num_waiting if s else 0)
        yield gauge("turnout_num_requests_in_flight", "Requests the server holds (admitted, not yet finished).",
                    eng.num_in_flight if eng else 0)
        yield gauge("turnout_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                    s.kv_cache_usage if s else 0.0)
        yield counter("turnout_num_preemptions", "Preemptions since start.", s.num_preemptions_total if s else 0)
        yield counter("turnout_prompt_tokens", "Prompt tokens processed since start.",
                      s.prompt_tokens_total if s else 0)
        yield counter("turnout_generation_tokens", "Tokens generated since start.",
                      s.generation_tokens_total if s else 0)
        yield counter("turnout_lookahead_steps", "Decode steps launched before the previous step's tokens were "
                      "read back (async scheduling).", s.lookahead_steps_total if s else 0)
        yield counter("turnout_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache (either tier) "
                      "since start.", s.prefix_cache_hit_tokens_total if s else 0)
        yield from _kv_tier_metrics(s, gauge, counter)
        yield from _speculative_metrics(s, counter)
        yield gauge("turnout_engine_healthy", "1 when the engine is loaded and alive.", 1 if st.healthy else 0)
        last = getattr(eng, "last_loop", None)
        yield gauge("turnout_engine_loop_age_seconds", "Seconds since the engine thread last came round its loop "
                    "(an idle engine: under a second; the gauges above are as old as this).",
                    time.monotonic() - last if last is not None else 0.0)
        yield from _replica_metrics(getattr(eng, "replicas", None), getattr(eng, "admitted", None))
        ops = g("turnout_op_implementation", "Implementation each op resolved to (value 1).",
                labels=["op", "impl"])
        for row in st.ops_report:
            ops.add_metric([str(row.get("op")), str(row.get("chosen") or "none")], 1)
        yield ops


# (name, help, EngineStats field) of the KV tiers (worker/kv_transfer.py, kv/tiers.py)
_TIER_COUNTERS = (
    ("turnout_swap_preemptions", "Preemptions by swapping the sequence's blocks to host memory.", "swap_preemptions_total"),
    ("turnout_recompute_preemptions", "Preemptions by dropping the blocks (recomputed later).",
     "recompute_preemptions_total"),
    ("turnout_swap_pool_full", "Swaps refused for a full host pool (recomputed instead).", "swap_pool_full_total"),
    ("turnout_swapped_out_blocks", "KV blocks copied to host memory by swap preemption.", "swapped_out_blocks_total"),
    ("turnout_swapped_in_blocks", "KV blocks copied back from host memory.", "swapped_in_blocks_total"),
    ("turnout_host_tier_hit_tokens", "Prompt tokens loaded from the host prefix tier instead of recomputed.",
     "host_tier_hit_tokens_total"),
    ("turnout_host_tier_offloaded_blocks", "Prefix blocks evicted from the device into the host tier.",
     "host_tier_offloaded_blocks_total"),
)
_TIER_GAUGES = (
    ("turnout_num_requests_swapped", "Sequences waiting in host memory to be swapped back in.", "num_swapped"),
    ("turnout_host_tier_used_blocks", "Blocks the host prefix tier holds.", "host_tier_used_blocks"),
)


def _kv_tier_metrics(s, gauge, counter):
    for name, doc, field in _TIER_COUNTERS:
        yield counter(name, doc, getattr(s, field, 0) if s else 0)
    for name, doc, field in _TIER_GAUGES:
        yield gauge(name, doc, getattr(s, field, 0) if s else 0)


def _speculative_metrics(s, counter):
    """Speculative decoding (turnout/engine/speculative.py): vLLM's spec_decode counters, and per draft position."""
    yield counter("turnout_spec_decode_num_drafts", "Sequence steps that verified draft tokens.",
                  getattr(s, "num_drafts_total", 0) if s else 0)
    yield counter("turnout_spec_decode_num_draft_tokens", "Draft tokens verified.",
                  getattr(s, "draft_tokens_total", 0) if s else 0)
    yield counter("turnout_spec_decode_num_accepted_tokens", "Draft tokens accepted (each saved a one-token step).",
                  getattr(s, "accepted_draft_tokens_total", 0) if s else 0)
    per = CounterMetricFamily("turnout_spec_decode_num_accepted_tokens_per_pos",
                              "Draft tokens accepted at each draft position (0-based).", labels=["position"])
    for j, n in enumerate(getattr(s, "accepted_draft_tokens_per_position", []) if s else []):
        per.add_metric([str(j)], n)
    yield per
    per = CounterMetricFamily("turnout_spec_decode_num_draft_tokens_per_pos",
                              "Draft tokens verified at each draft position (0-based).", labels=["position"])
    for j, n in enumerate(getattr(s, "draft_tokens_per_position", []) if s else []):
        per.add_metric([str(j)], n)
    yield per


def _replica_metrics(replicas, admitted):
    """--data-parallel-size > 1: the same gauges and counters per replica (label ``replica``); the unlabelled
    families above are the totals."""
    if not replicas:
        return
    fams = [(GaugeMetricFamily, "turnout_replica_num_requests_running", "Requests being generated, per replica.",
             lambda i, s: s.num_running),
            (GaugeMetricFamily, "turnout_replica_num_requests_waiting", "Requests waiting, per replica.",
             lambda i, s: s.num_waiting),
            (GaugeMetricFamily, "turnout_replica_kv_cache_usage_perc", "KV-cache usage (0..1), per replica.",
             lambda i, s: s.kv_cache_usage),
            (CounterMetricFamily, "turnout_replica_prompt_tokens", "Prompt tokens processed, per replica.",
             lambda i, s: s.prompt_tokens_total),
            (CounterMetricFamily, "turnout_replica_generation_tokens", "Tokens generated, per replica.",
             lambda i, s: s.generation_tokens_total),
            (CounterMetricFamily, "turnout_replica_requests", "Requests routed to each replica.",
             lambda i, s: admitted[i] if admitted else 0)]
    for cls, name, doc, value in fams:
        m = cls(name, doc, labels=["replica"])
        for i, r in enumerate(replicas):
            m.add_metric([str(i)], value(i, r.stats))
        yield m


class ServerMetrics(EngineObserver):
    def __init__(self, state):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("turnout_time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("turnout_inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("turnout_e2e_request_latency_seconds", "Arrival to finish, finished requests.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.finished = Counter("turnout_request_finished", "Requests finished, by reason.",
                                ["finished_reason"], registry=r)
        self.rejected = Counter("turnout_request_rejected", "Requests refused before admission, by reason.",
                                ["reason"], registry=r)
        r.register(_EngineCollector(state))

    # EngineObserver (engine thread; prometheus_client is thread-safe)
    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_inter_token(self, itl_s: float, num_tokens: int) -> None:
        for _ in range(min(num_tokens, 64)):
            self.itl.observe(itl_s)

    def on_finished(self, e2e_s: float, finish_reason: str) -> None:
        self.finished.labels(finished_reason=finish_reason or "unknown").inc()
        if finish_reason != "abort":
            self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
