"""``GET /metrics``: the server's figures in Prometheus' text format, under vLLM's names where vLLM has one
(so a dashboard built for vLLM reads nano-vllm unchanged) and ``nanovllm:`` names for what only nano-vllm
knows: the scheduling policy and allocator in use, figures per priority class, prefix-cache hits, recompute
after preemption, evictions and step times. Speculative decoding's counters are vLLM's
(``vllm:spec_decode_num_drafts`` etc., with ``_total`` appended as Prometheus counters are).

Updated by the engine thread after each step and each ended request, from the same records the run writes
(``records.RequestRecord`` / ``StepRecord``), so ``/metrics`` and ``metrics.json`` count the same things. Each
server has its own registry (several servers can live in one process, as in the tests).
"""

from __future__ import annotations

from typing import Any, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the route)

from nanovllm.serving.metrics import e2el_s, ttft_s

# Bucket bounds in seconds, as vLLM chooses them for the same histograms (CPU serving sits at the slow end).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    """The Prometheus collectors of one server, labelled with its model (and policy / allocator for ours)."""

    def __init__(self, model_name: str, policy: str, allocator: str) -> None:
        self.registry = CollectorRegistry()
        model = {"model_name": model_name}
        plugins = {**model, "policy": policy, "allocator": allocator}
        r = self.registry

        def gauge(name: str, doc: str, labels: dict[str, str]) -> Gauge:
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        def counter(name: str, doc: str, labels: dict[str, str]) -> Counter:
            return Counter(name, doc, list(labels), registry=r).labels(**labels)

        def histogram(name: str, doc: str, labels: dict[str, str], buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=r).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.", model)
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (preempted included).",
                             model)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", model)
        self.preemptions = counter("vllm:num_preemptions", "Preemptions by the scheduler.", model)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.", model)
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens emitted.", model)
        self._success = Counter("vllm:request_success", "Requests that ended, by finish reason.",
                                [*model, "finished_reason"], registry=r)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", model, _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", model,
                             _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", model, _E2E_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time from arrival to the first step.", model,
                               _E2E_BUCKETS)
        # Speculative decoding, as vLLM counts it (all 0 with speculation off).
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Verifications of proposed tokens (one per "
                                   "request and step with proposals).", model)
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified.", model)
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", model)
        self._spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Proposed tokens "
                                              "accepted, by position in the proposal (0 = first).",
                                              [*model, "position"], registry=r)
        self._model = model
        # nano-vllm's own: which policy and allocator serve, and what they did.
        self.info = Gauge("nanovllm:engine_info", "The scheduling policy and KV allocator in use (always 1).",
                          list(plugins), registry=r).labels(**plugins)
        self.info.set(1)
        self.steps = counter("nanovllm:engine_steps", "Engine steps run.", plugins)
        self.step_time = histogram("nanovllm:step_duration_seconds", "Duration of one engine step.", plugins,
                                   _STEP_BUCKETS)
        self.prefix_hits = counter("nanovllm:prefix_cache_hit_tokens", "Prompt tokens served from the prefix "
                                   "cache.", plugins)
        self.recomputed = counter("nanovllm:recomputed_tokens", "Tokens computed again after a preemption.",
                                  plugins)
        self.evictions = counter("nanovllm:kv_cache_evictions", "Cached KV blocks evicted.", plugins)
        self.swapped = counter("nanovllm:swapped_tokens", "Tokens of swapped-out requests loaded back instead of "
                               "recomputed.", plugins)
        self.tier_hits = counter("vllm:external_prefix_cache_hits", "Prompt tokens loaded from KV tiers below the "
                                 "pool (vLLM's name for hits outside the GPU pool).", model)
        self.kv_free = gauge("nanovllm:kv_blocks_free", "Free KV blocks (cached ones included).", plugins)
        self._by_priority = Counter("nanovllm:requests_ended", "Requests that ended, by priority class and finish "
                                    "reason ('failed' when rejected).", [*plugins, "priority", "finished_reason"],
                                    registry=r)
        self._ttft_by_priority = Histogram("nanovllm:time_to_first_token_seconds", "Time to first token by priority "
                                           "class.", [*plugins, "priority"], buckets=_TTFT_BUCKETS, registry=r)
        self._plugins = plugins

    def observe_step(self, step: Mapping[str, Any], engine: Any) -> None:
        """After each engine step (engine thread): the queue gauges, KV usage and the step's counts."""
        running, waiting = engine.queue_lengths()
        self.running.set(running)
        self.waiting.set(waiting)
        total = step["kv_blocks_total"]
        self.kv_usage.set(step["kv_blocks_used"] / total if total else 0.0)
        self.kv_free.set(step["kv_blocks_free"])
        self.preemptions.inc(step["num_preempted"])
        self.prompt_tokens.inc(step["num_prefill_tokens"])
        # Tokens emitted: one per sampled sequence, plus the proposals a verification accepted (a step that
        # accepts k proposals of a request emits k + 1 tokens of it), as vLLM counts them.
        self.generation_tokens.inc(step["num_sampled"] + step["spec_decode_num_accepted_tokens"])
        self.steps.inc()
        self.step_time.observe(step["duration"])
        self.prefix_hits.inc(step["prefix_hit_tokens"])
        self.recomputed.inc(step["recomputed_tokens"])
        self.evictions.inc(step["num_evictions"])
        self.swapped.inc(step.get("swapped_tokens", 0))
        self.tier_hits.inc(sum(t["hit_tokens"] for t in step.get("kv_tiers", {}).values()))
        self.spec_drafts.inc(step["spec_decode_num_drafts"])
        self.spec_draft_tokens.inc(step["spec_decode_num_draft_tokens"])
        self.spec_accepted.inc(step["spec_decode_num_accepted_tokens"])
        for position, count in enumerate(step.get("spec_decode_num_accepted_tokens_per_pos", [])):
            self._spec_accepted_per_pos.labels(**self._model, position=str(position)).inc(count)

    def observe_request(self, record: Mapping[str, Any]) -> None:
        """After each ended request (engine thread): its latencies and how it ended."""
        reason = record["finish_reason"] or "failed"
        self._success.labels(**self._model, finished_reason=reason).inc()
        priority = str(record["priority"])
        self._by_priority.labels(**self._plugins, priority=priority, finished_reason=reason).inc()
        if record["error"] is not None or record["finish_time"] is None:
            return
        ttft = ttft_s(record)
        if ttft is not None:
            self.ttft.observe(ttft)
            self._ttft_by_priority.labels(**self._plugins, priority=priority).observe(ttft)
        times = record["token_times"]
        for before, after in zip(times, times[1:]):
            self.itl.observe(after - before)
        self.e2e.observe(e2el_s(record))
        if record["first_scheduled_time"] is not None:
            self.queue.observe(record["first_scheduled_time"] - record["arrival_time"])

    def render(self) -> bytes:
        """The text exposition of every collector (``GET /metrics``)."""
        return generate_latest(self.registry)
