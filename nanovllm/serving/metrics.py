"""The serving summary of a run, computed from its plain records (``nanovllm.serving.records``).

Key names and definitions follow ``vllm bench serve`` so numbers can be compared side by side:

* TTFT  = first_token_time - arrival_time
* TPOT  = (E2EL - TTFT) / (num_output_tokens - 1), only for requests with more than one output token
* ITL   = every gap between consecutive token times, pooled over all requests
* E2EL  = finish_time - arrival_time

Conventions: only *completed* requests (no error, a finish time) enter latency and token statistics;
failed ones (error set) and aborted ones (finish_reason "abort", error saying why) are only counted. A statistic over an empty sample (e.g. TPOT when every request
produced one token) or a ratio with a zero denominator is ``None`` -- never a misleading 0. Throughputs over
a zero-length run are 0.0. Nothing here raises or warns on empty input.
"""

from __future__ import annotations

import itertools

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from nanovllm.serving.formatting import format_value
from nanovllm.serving.records import RequestRecord
from nanovllm.serving.step_records import TIER_LEVELS, merge_tier_counts

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
_LATENCY_STATS = ("mean", "median", "std", "p90", "p99")
_QUEUE_STATS = ("mean", "median", "p99")


@dataclass
class SLO:
    """Per-request latency targets in milliseconds; ``None`` means no target for that metric. Validated on
    construction: each target is a number > 0 or None."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for key, value in vars(self).items():
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not value > 0):
                raise ValueError(f"slo.{key} must be a number of milliseconds > 0 or null, got {value!r}")

    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


# --------------------------------------------------------------------------------------------------------------
# Per-request latencies (seconds)
# --------------------------------------------------------------------------------------------------------------

def is_completed(r: RequestRecord) -> bool:
    return r["error"] is None and r["finish_time"] is not None


def ttft_s(r: Mapping[str, Any]) -> float | None:
    return None if r["first_token_time"] is None else r["first_token_time"] - r["arrival_time"]


def e2el_s(r: Mapping[str, Any]) -> float:
    """End-to-end latency of a completed request (``is_completed``: it has a finish time)."""
    finish = r["finish_time"]
    assert finish is not None, "e2el_s of a request that has not finished"
    return finish - r["arrival_time"]


def tpot_s(r: RequestRecord) -> float | None:
    """Mean time per output token after the first; undefined for a single-token output."""
    ttft = ttft_s(r)
    if ttft is None or r["num_output_tokens"] <= 1:
        return None
    return (e2el_s(r) - ttft) / (r["num_output_tokens"] - 1)


class LatencySamples:
    """Every completed request's latencies in seconds, read from the records once, so that a run's summary and
    its breakdowns (per priority, client, replica) share one pass over what can be tens of millions of token
    times. Arrays in record order: ``ttft``, ``tpot``, ``e2el``, ``queue_time`` a value a request (NaN where it
    has none), ``itl`` every request's gaps between consecutive tokens, request after request, with ``owner``
    the request each gap belongs to. ``of`` selects the samples of some of the requests, in the same order, so
    that every figure is the one computed from those requests alone, bit for bit."""

    def __init__(self, done: Sequence[RequestRecord]) -> None:
        n = len(done)

        def column(key: str) -> np.ndarray:
            return np.fromiter((np.nan if r[key] is None else r[key] for r in done),  # type: ignore[literal-required]
                               dtype=np.float64, count=n)

        arrival, first = column("arrival_time"), column("first_token_time")
        self.size = n
        self.ttft = first - arrival
        self.e2el = column("finish_time") - arrival
        self.queue_time = column("first_scheduled_time") - arrival
        outputs = np.fromiter((r["num_output_tokens"] for r in done), dtype=np.int64, count=n)
        # TPOT only for requests with more than one output token (and a first token): NaN elsewhere.
        with np.errstate(divide="ignore", invalid="ignore"):
            self.tpot = np.where(outputs > 1, (self.e2el - self.ttft) / (outputs - 1), np.nan)
        lengths = np.fromiter((len(r["token_times"]) for r in done), dtype=np.int64, count=n)
        times = np.fromiter(itertools.chain.from_iterable(r["token_times"] for r in done), dtype=np.float64,
                            count=int(lengths.sum()))
        # Differences of neighbours, less those that span two requests (a request's last and the next one's first).
        spanning = np.cumsum(lengths)[:-1] - 1
        self.itl = np.delete(np.diff(times), spanning[(spanning >= 0) & (spanning < len(times) - 1)]) \
            if len(times) else np.empty(0)
        self.owner = np.repeat(np.arange(n), np.maximum(lengths - 1, 0))
        self._stats_of_all: tuple[dict[str, float | None], dict[str, float | None]] | None = None

    def of(self, members: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The latency samples (``LATENCY_METRICS`` and ``queue_time``) of the requests at the sorted indices
        ``members`` (None: all), NaNs left out."""
        def present(values: np.ndarray) -> np.ndarray:
            return values[~np.isnan(values)]

        if members is None:
            return {"ttft": present(self.ttft), "tpot": present(self.tpot), "itl": self.itl,
                    "e2el": self.e2el, "queue_time": present(self.queue_time)}
        chosen = np.zeros(self.size, dtype=bool)
        chosen[members] = True
        return {"ttft": present(self.ttft[members]), "tpot": present(self.tpot[members]),
                "itl": self.itl[chosen[self.owner]], "e2el": self.e2el[members],
                "queue_time": present(self.queue_time[members])}

    def stats_ms(self, members: np.ndarray | None = None) -> tuple[dict[str, float | None], dict[str, float | None]]:
        """The summary's latency statistics and its queue-time statistics of ``members`` (see ``of``); those of
        every request worked out once (a breakdown whose one group holds every request reads them again)."""
        if members is not None and len(members) == self.size:
            members = None
        if members is None and self._stats_of_all is not None:
            return self._stats_of_all
        samples = self.of(members)
        latency: dict[str, float | None] = {}
        for name in LATENCY_METRICS:
            latency.update(_stats_ms(samples[name], name, _LATENCY_STATS))
        out = latency, _stats_ms(samples["queue_time"], "queue_time", _QUEUE_STATS)
        if members is None:
            self._stats_of_all = out
        return out


def _queue_time(r: RequestRecord) -> float | None:
    return None if r["first_scheduled_time"] is None else r["first_scheduled_time"] - r["arrival_time"]


def _latencies_s(done: Sequence[RequestRecord]) -> dict[str, np.ndarray]:
    """Each latency metric's sample in seconds (ITL pooled over requests, as vLLM does)."""
    samples = LatencySamples(done).of()
    return {name: samples[name] for name in LATENCY_METRICS}


# --------------------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------------------

def _stat(values_ms: np.ndarray, stat: str) -> float | None:
    if values_ms.size == 0:
        return None  # checked first: numpy would warn and return nan on an empty sample
    if stat == "mean":
        return float(np.mean(values_ms))
    if stat == "median":
        return float(np.median(values_ms))
    if stat == "std":
        return float(np.std(values_ms))  # population std (ddof=0), like vLLM
    return float(np.percentile(values_ms, float(stat[1:])))  # "p90" -> 90th percentile, linear interpolation


def _stats_ms(values_s: Iterable[float] | np.ndarray, name: str, stats: Sequence[str]) -> dict[str, float | None]:
    values = values_s if isinstance(values_s, np.ndarray) else list(values_s)
    values_ms = np.asarray(values, dtype=np.float64) * 1000.0
    return {f"{stat}_{name}_ms": _stat(values_ms, stat) for stat in stats}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def run_duration(requests: Sequence[RequestRecord]) -> float:
    """Seconds from the first arrival to the last finish over all requests (0.0 when nothing finished)."""
    finishes = [r["finish_time"] for r in requests if r["finish_time"] is not None]
    if not finishes:
        return 0.0
    return max(0.0, max(finishes) - min(r["arrival_time"] for r in requests))


# --------------------------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------------------------

def _meets_slo(r: RequestRecord, slo: SLO) -> bool:
    """DistServe's goodput test: every SLO that is set holds."""
    ttft, tpot = ttft_s(r), tpot_s(r)
    if slo.ttft_ms is not None and (ttft is None or ttft * 1000.0 > slo.ttft_ms):
        return False
    # A one-token output has no TPOT: it had no decode steps to be slow in, so it meets any TPOT target.
    if slo.tpot_ms is not None and tpot is not None and tpot * 1000.0 > slo.tpot_ms:
        return False
    return slo.e2el_ms is None or e2el_s(r) * 1000.0 <= slo.e2el_ms


def _goodput(done: Sequence[RequestRecord], total: int, duration: float, slo: SLO | None) -> dict[str, Any]:
    """Good requests per second, and the fraction of *all* requests that were good (failed ones miss)."""
    if slo is None or not slo.is_set():
        return {"request_goodput": None, "goodput_fraction": None}
    good = sum(_meets_slo(r, slo) for r in done)
    return {"request_goodput": good / duration if duration > 0 else 0.0,
            "goodput_fraction": _ratio(good, total)}


def _own_slo_attainment(requests: Sequence[RequestRecord]) -> float | None:
    """Of the requests that carry targets of their own (``slo_ttft`` / ``slo_e2el``, from the workload), the
    fraction that completed within all of them (a failed or aborted one misses); None when none carries one.
    Records written before these fields existed carry none."""
    targeted = [r for r in requests if r.get("slo_ttft") is not None or r.get("slo_e2el") is not None]
    if not targeted:
        return None

    def met(r: RequestRecord) -> bool:
        if not is_completed(r):
            return False
        ttft, slo_ttft, slo_e2el = ttft_s(r), r.get("slo_ttft"), r.get("slo_e2el")
        if slo_ttft is not None and (ttft is None or ttft > slo_ttft):
            return False
        return slo_e2el is None or e2el_s(r) <= slo_e2el

    return sum(map(met, targeted)) / len(targeted)


def _counts(requests: Sequence[RequestRecord], done: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    aborted = sum(r["finish_reason"] == "abort" for r in requests)
    failed = sum(r["error"] is not None for r in requests) - aborted
    total_in = sum(r["num_prompt_tokens"] for r in done)
    total_out = sum(r["num_output_tokens"] for r in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return {
        "completed": len(done),
        "failed": failed,
        "aborted": aborted,
        "unfinished": len(requests) - len(done) - failed - aborted,  # none of those (a run cut short)
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
    }


def _scheduling(requests: Sequence[RequestRecord], done: Sequence[RequestRecord],
                queue_stats: Mapping[str, float | None]) -> dict[str, Any]:
    out: dict[str, Any] = dict(queue_stats)
    # Preemptions cost work whether or not the request later finished, so count them over every request.
    out["num_preemptions"] = sum(r["num_preemptions"] for r in requests)
    out["prefix_cache_hit_rate"] = _ratio(sum(r["num_cached_tokens"] for r in done),
                                          sum(r["num_prompt_tokens"] for r in done))
    # Recompute is wasted work whoever the victim was: over every request (files before it existed: 0).
    out["recomputed_tokens"] = sum(r.get("num_recomputed_tokens", 0) for r in requests)
    return out


def _tier_stats(requests: Sequence[RequestRecord], steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """KV tiers (runs with kv_offload): swapped tokens, and per tier its counters summed over the steps
    (``hit_tokens``, ``blocks_written``/``_loaded``, ``bytes_written``/``_loaded``, ``failures``,
    ``load_seconds``, ``write_seconds``), ``hit_rate`` (its hit tokens over all prompt tokens), and what it held
    at the end (``blocks``, ``bytes``: each replica's last step, summed over replicas; for ``shared``, one store
    every replica sees, the largest). Empty without tiers."""
    tiered = [s for s in steps if "kv_tiers" in s]
    if not tiered:
        return {}
    per_tier: dict[str, dict[str, float]] = {}
    held: dict[str, dict[Any, Mapping[str, float]]] = {}   # tier -> replica -> its last step's counts
    for step in tiered:
        per_tier = merge_tier_counts(per_tier, step["kv_tiers"])
        for name, counts in step["kv_tiers"].items():
            held.setdefault(name, {})[step.get("replica")] = counts
    prompt_tokens = sum(r.get("num_prompt_tokens") or 0 for r in requests)
    for name, totals in per_tier.items():
        combine = max if name == "shared" else sum
        for key in TIER_LEVELS:
            totals[key] = combine(counts.get(key, 0) for counts in held[name].values())
        totals["hit_rate"] = totals.get("hit_tokens", 0) / prompt_tokens if prompt_tokens else 0.0
    return {"swapped_tokens": sum(s.get("swapped_tokens", 0) for s in tiered), "kv_tiers": per_tier}


def _memory_stats(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Prefix-cache and fragmentation figures from the step records (None for runs recorded before them).
    Internal fragmentation is the mean, over steps, of allocated KV slots not holding a computed token."""
    if not steps or "kv_slots_unused" not in steps[0]:
        return {"num_evictions": None, "mean_kv_slots_unused": None, "mean_kv_blocks_cached": None}
    return {
        "num_evictions": sum(s["num_evictions"] for s in steps),
        "mean_kv_slots_unused": float(np.mean([s["kv_slots_unused"] for s in steps])),
        "mean_kv_blocks_cached": float(np.mean([s["kv_blocks_cached"] for s in steps])),
    }


def _step_stats(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    usage = [s["kv_blocks_used"] / s["kv_blocks_total"] for s in steps if s["kv_blocks_total"] > 0]
    durations = [s["duration"] for s in steps]
    return {
        "peak_kv_usage": max(usage) if usage else None,
        "mean_kv_usage": float(np.mean(usage)) if usage else None,
        "num_steps": len(steps),
        "mean_step_ms": float(np.mean(durations)) * 1000.0 if durations else None,
    }


def _spec_decode_stats(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Speculative decoding's figures from the step records, vLLM's names (none for runs recorded before the
    counters existed; zeros and None when nothing was proposed). Acceptance rate: accepted / proposed tokens;
    mean accepted length, as vLLM's: tokens one verification emits on average, 1 + accepted / drafts (the
    target's own token included); per position: proposals accepted at position i (0 = the first proposed)."""
    if not steps or "spec_decode_num_drafts" not in steps[0]:
        return {}
    drafts = sum(s["spec_decode_num_drafts"] for s in steps)
    draft_tokens = sum(s["spec_decode_num_draft_tokens"] for s in steps)
    accepted = sum(s["spec_decode_num_accepted_tokens"] for s in steps)
    per_pos: list[int] = []
    for s in steps:
        counts = s.get("spec_decode_num_accepted_tokens_per_pos", [])
        per_pos.extend([0] * (len(counts) - len(per_pos)))
        for position, count in enumerate(counts):
            per_pos[position] += count
    return {
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": draft_tokens,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_acceptance_rate": _ratio(accepted, draft_tokens),
        "spec_decode_mean_accepted_length": 1.0 + accepted / drafts if drafts else None,
        "spec_decode_num_accepted_tokens_per_pos": per_pos,
    }


def summarize(requests: Sequence[RequestRecord], steps: Sequence[Mapping[str, Any]] = (),
              duration: float | None = None, slo: SLO | None = None) -> dict[str, Any]:
    """The flat serving summary of a run, with ``vllm bench serve`` key names (see the module docstring).

    ``duration`` defaults to last finish - first arrival; pass the wall time of the run to match a
    benchmark client's view. ``slo`` enables ``request_goodput`` and ``goodput_fraction`` (else ``None``);
    ``slo_attainment`` is against each request's own targets instead (None when no request has any).
    """
    return summarize_with_breakdowns(requests, steps, (), duration, slo)[0]


def _summary(requests: Sequence[RequestRecord], done: Sequence[RequestRecord],
             stats: tuple[Mapping[str, float | None], Mapping[str, float | None]],
             steps: Sequence[Mapping[str, Any]], duration: float,
             slo: SLO | None) -> dict[str, Any]:
    summary = _counts(requests, done, duration)
    summary.update(_goodput(done, len(requests), duration, slo))
    summary["slo_attainment"] = _own_slo_attainment(requests)
    latency, queue = stats   # ``LatencySamples.stats_ms``
    summary.update(latency)
    summary.update(_scheduling(requests, done, queue))
    summary.update(_step_stats(steps))
    summary.update(_memory_stats(steps))
    summary.update(_tier_stats(requests, steps))
    summary.update(_spec_decode_stats(steps))
    return summary


def _group_key(value: Any) -> tuple:
    """Sort groups by value, numbers before strings, None last."""
    return (value is None, isinstance(value, str), value if value is not None else 0)


def breakdown(requests: Sequence[RequestRecord], by: str, **kw: Any) -> dict[str, dict[str, Any]]:
    """``summarize`` per value of a request field (``"priority"`` or ``"client_id"``), keyed by ``str(value)``.

    Every group shares the whole run's duration (unless ``duration`` is given), so per-group throughputs add
    up to the run's. Step statistics are global, so they are left out unless ``steps`` is passed in ``kw``.
    """
    requests = list(requests)
    done = [r for r in requests if is_completed(r)]
    return _breakdown(requests, done, LatencySamples(done), by, **kw)


def _breakdown(requests: Sequence[RequestRecord], done: Sequence[RequestRecord], samples: LatencySamples, by: str,
               duration: float | None = None, slo: SLO | None = None,
               steps: Sequence[Mapping[str, Any]] = ()) -> dict[str, dict[str, Any]]:
    """``breakdown`` with the completed requests' latencies already read (``samples``, of ``done``)."""
    if requests and by not in requests[0]:
        raise ValueError(f"breakdown(by={by!r}): not a request record field; try 'priority' or 'client_id'")
    duration = run_duration(requests) if duration is None else float(duration)
    groups: dict[Any, list[RequestRecord]] = {}
    for r in requests:
        groups.setdefault(r.get(by), []).append(r)
    done_groups: dict[Any, list[int]] = {}   # each group's completed requests, as indices into ``done``
    for index, r in enumerate(done):
        done_groups.setdefault(r.get(by), []).append(index)
    out = {}
    for value in sorted(groups, key=_group_key):
        members = np.array(done_groups.get(value, ()), dtype=np.int64)
        out[str(value)] = _summary(groups[value], [done[i] for i in members], samples.stats_ms(members), steps,
                                   duration, slo)
    return out


def summarize_with_breakdowns(requests: Sequence[RequestRecord], steps: Sequence[Mapping[str, Any]] = (),
                              breakdown_by: Sequence[str] = (), duration: float | None = None,
                              slo: SLO | None = None) -> tuple[dict[str, Any], dict[str, dict[str, dict[str, Any]]]]:
    """``summarize(requests, steps, duration, slo)`` and ``breakdown(requests, by, slo=slo)`` for each field of
    ``breakdown_by``, reading every request's latencies once for all of them (what a harness reports at the end
    of a run)."""
    requests = list(requests)
    done = [r for r in requests if is_completed(r)]
    samples = LatencySamples(done)
    run = run_duration(requests) if duration is None else float(duration)
    summary = _summary(requests, done, samples.stats_ms(), steps, run, slo)
    return summary, {by: _breakdown(requests, done, samples, by, slo=slo) for by in breakdown_by}


# --------------------------------------------------------------------------------------------------------------
# Console output
# --------------------------------------------------------------------------------------------------------------

_WIDTH = 50

# (section title or None for the top block, [(label, key)]) -- the order vLLM prints them in.
_LAYOUT: list[tuple[str | None, list[tuple[str, str]]]] = [
    (None, [
        ("Successful requests", "completed"), ("Failed requests", "failed"),
        ("Aborted requests", "aborted"),
        ("Unfinished requests", "unfinished"), ("Benchmark duration (s)", "duration"),
        ("Total input tokens", "total_input_tokens"), ("Total generated tokens", "total_output_tokens"),
        ("Request throughput (req/s)", "request_throughput"),
        ("Request goodput (req/s)", "request_goodput"), ("Goodput fraction", "goodput_fraction"),
        ("Own-SLO attainment", "slo_attainment"),
        ("Output token throughput (tok/s)", "output_throughput"),
        ("Total token throughput (tok/s)", "total_token_throughput"),
    ]),
    *[(title, [(f"{label} {metric.upper()} (ms)", f"{label.lower()}_{metric}_ms")
               for label in ("Mean", "Median", "Std", "P90", "P99")])
      for title, metric in (("Time to First Token", "ttft"), ("Time per Output Token (excl. 1st token)", "tpot"),
                            ("Inter-token Latency", "itl"), ("End-to-end Latency", "e2el"))],
    ("Scheduling", [
        ("Mean queue time (ms)", "mean_queue_time_ms"), ("Median queue time (ms)", "median_queue_time_ms"),
        ("P99 queue time (ms)", "p99_queue_time_ms"), ("Preemptions", "num_preemptions"),
        ("Prefix cache hit rate", "prefix_cache_hit_rate"), ("Recomputed tokens", "recomputed_tokens"),
        ("Evicted cached blocks", "num_evictions"), ("Mean unused KV slots", "mean_kv_slots_unused"),
        ("Mean cached free blocks", "mean_kv_blocks_cached"), ("Peak KV cache usage", "peak_kv_usage"),
        ("Mean KV cache usage", "mean_kv_usage"), ("Engine steps", "num_steps"),
        ("Mean step time (ms)", "mean_step_ms"),
    ]),
    # Shown only when something was proposed (format_summary), as vLLM logs it only with speculation on.
    ("Speculative Decoding", [
        ("Drafts", "spec_decode_num_drafts"), ("Draft tokens", "spec_decode_num_draft_tokens"),
        ("Accepted tokens", "spec_decode_num_accepted_tokens"),
        ("Acceptance rate", "spec_decode_acceptance_rate"),
        ("Mean accepted length", "spec_decode_mean_accepted_length"),
        ("Accepted per position", "spec_decode_num_accepted_tokens_per_pos"),
    ]),
]
_KNOWN_KEYS = {key for _, rows in _LAYOUT for _, key in rows}


def _line(label: str, value: Any) -> str:
    return f"{label + ':':<40} {format_value(value, '.2f'):<10}".rstrip()


def _header(title: str, fill: str) -> str:
    return f"{title:{fill}^{_WIDTH}}"


def format_summary(summary: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """A console block in the style of ``vllm bench serve``'s result; keys the summary lacks are skipped,
    goodput only shows when an SLO was given, and keys it does not know go under "Other"."""
    lines = [_header(f" {title} ", "=")]
    speculated = bool(summary.get("spec_decode_num_drafts"))
    for section, rows in _LAYOUT:
        present = [(label, key) for label, key in rows if key in summary
                   and not (key in ("request_goodput", "goodput_fraction", "slo_attainment")
                            and summary[key] is None)
                   and (speculated or not key.startswith("spec_decode_"))]
        if section is not None and present:
            lines.append(_header(section, "-"))
        lines += [_line(label, ", ".join(map(str, summary[key])) if isinstance(summary[key], list)
                        else summary[key]) for label, key in present]
    # Nested figures (a cluster's per-replica table, its replicas' settings) have tables of their own.
    extra = [key for key in summary if key not in _KNOWN_KEYS and not isinstance(summary[key], (dict, list))]
    if extra:
        lines.append(_header("Other", "-"))
        lines += [_line(key, summary[key]) for key in extra]
    lines.append("=" * _WIDTH)
    return "\n".join(lines)
