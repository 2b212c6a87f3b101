"""The serving summary kept as a run goes, in bounded memory: for a server that runs for days.

``metrics.summarize`` reads every request record of a run; a server that answers millions of requests cannot
hold them all. ``RequestAggregates`` takes each record once (``add``) and keeps only counts, sums, extremes and,
for each latency, a ``Reservoir``: running count / sum / sum of squares plus a fixed-size uniform sample
(Vitter's algorithm R, seeded) for the quantiles. ``summary`` returns the keys of ``summarize`` in its order.

Exactness: while no latency has more values than the reservoir holds (``capacity``, 10,000 by default) every
figure is the one ``summarize`` computes from the same records, bit for bit (the same values in the same order go
through the same numpy statistics). Past it, counts, token totals, throughputs, goodput and SLO figures stay
exact; means and standard deviations come from the running sums (equal up to float rounding); medians and
percentiles are the sample's, an estimate whose rank error shrinks as 1/sqrt(capacity) (about 1% of rank at
10,000: p99 is read between p98 and p100 of the full population).

``GroupedAggregates`` keeps one ``RequestAggregates`` per value of a record field (``metrics.breakdown``'s
groups), at most ``max_groups`` of them: a field a client controls (``priority``) cannot grow it without bound;
the values beyond fall into one group named ``"other"``.
"""

from __future__ import annotations

import math
import random
from typing import Any, Mapping

from nanovllm.serving.metrics import (
    _LATENCY_STATS,
    _QUEUE_STATS,
    SLO,
    _group_key,
    _meets_slo,
    _queue_time,
    _ratio,
    _stats_ms,
    e2el_s,
    is_completed,
    tpot_s,
    ttft_s,
)
from nanovllm.serving.records import RequestRecord

DEFAULT_CAPACITY = 10_000
DEFAULT_MAX_GROUPS = 64
OTHER_GROUP = "other"

__all__ = ["Reservoir", "RequestAggregates", "GroupedAggregates", "DEFAULT_CAPACITY"]


class Reservoir:
    """One latency's values (seconds): their count, sum and sum of squares, and a uniform sample of at most
    ``capacity`` of them for the quantiles (algorithm R: the i-th value replaces a random slot with probability
    capacity / i, so every value seen is in the sample with the same probability)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, seed: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"a reservoir holds at least one value, got capacity={capacity}")
        self.capacity = capacity
        self.count = 0
        self.total = 0.0
        self.total_sq = 0.0
        self.sample: list[float] = []
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        """Count ``value`` and maybe keep it in the sample."""
        self.count += 1
        self.total += value
        self.total_sq += value * value
        if len(self.sample) < self.capacity:
            self.sample.append(value)
            return
        slot = self._rng.randrange(self.count)
        if slot < self.capacity:
            self.sample[slot] = value

    @property
    def exact(self) -> bool:
        """Whether the sample still holds every value seen."""
        return self.count == len(self.sample)

    def stats_ms(self, name: str, stats: tuple[str, ...]) -> dict[str, float | None]:
        """``metrics._stats_ms``'s keys and figures in milliseconds: from every value while they all fit,
        else the mean and population std from the running sums and the quantiles from the sample."""
        out = _stats_ms(self.sample, name, stats)
        if self.exact:
            return out
        mean = self.total / self.count
        variance = max(0.0, self.total_sq / self.count - mean * mean)   # rounding can take it just below 0
        if "mean" in stats:
            out[f"mean_{name}_ms"] = mean * 1000.0
        if "std" in stats:
            out[f"std_{name}_ms"] = math.sqrt(variance) * 1000.0
        return out


class RequestAggregates:
    """The running summary of the request records ``add``ed (the module docstring). ``slo`` enables the
    goodput figures, as ``summarize``'s does; it must be given up front since records are not kept."""

    def __init__(self, slo: SLO | None = None, capacity: int = DEFAULT_CAPACITY, seed: int = 0) -> None:
        self.slo = slo
        self.total = 0
        self.completed = 0
        self.aborted = 0
        self.errored = 0                    # error set, aborted ones included (summarize's "failed" + "aborted")
        self.first_arrival: float | None = None
        self.last_finish: float | None = None
        self.input_tokens = 0               # over completed requests
        self.output_tokens = 0
        self.cached_tokens = 0
        self.preemptions = 0                # over every request
        self.recomputed_tokens = 0
        self.good = 0                       # completed within every SLO that is set
        self.targeted = 0                   # requests carrying targets of their own
        self.targets_met = 0
        # one stream of seeds per latency: reservoirs filled at the same time must not sample in lockstep
        self.latencies = {name: Reservoir(capacity, seed * 8 + i)
                          for i, name in enumerate(("ttft", "tpot", "itl", "e2el", "queue_time"))}

    def add(self, r: RequestRecord) -> None:
        """Fold one ended request's record into the figures."""
        self.total += 1
        self.first_arrival = r["arrival_time"] if self.first_arrival is None else min(self.first_arrival,
                                                                                      r["arrival_time"])
        if r["finish_time"] is not None:
            self.last_finish = r["finish_time"] if self.last_finish is None else max(self.last_finish,
                                                                                     r["finish_time"])
        self.aborted += r["finish_reason"] == "abort"
        self.errored += r["error"] is not None
        self.preemptions += r["num_preemptions"]
        self.recomputed_tokens += r.get("num_recomputed_tokens", 0)
        self._own_targets(r)
        if not is_completed(r):
            return
        self.completed += 1
        self.input_tokens += r["num_prompt_tokens"]
        self.output_tokens += r["num_output_tokens"]
        self.cached_tokens += r["num_cached_tokens"]
        if self.slo is not None and self.slo.is_set():
            self.good += _meets_slo(r, self.slo)
        samples = self.latencies
        ttft, tpot, queue = ttft_s(r), tpot_s(r), _queue_time(r)
        if ttft is not None:
            samples["ttft"].add(ttft)
        if tpot is not None:
            samples["tpot"].add(tpot)
        times = r["token_times"]
        for a, b in zip(times, times[1:]):
            samples["itl"].add(b - a)
        samples["e2el"].add(e2el_s(r))
        if queue is not None:
            samples["queue_time"].add(queue)

    def _own_targets(self, r: RequestRecord) -> None:
        slo_ttft, slo_e2el = r.get("slo_ttft"), r.get("slo_e2el")
        if slo_ttft is None and slo_e2el is None:
            return
        self.targeted += 1
        if not is_completed(r):
            return
        ttft = ttft_s(r)
        if slo_ttft is not None and (ttft is None or ttft > slo_ttft):
            return
        self.targets_met += slo_e2el is None or e2el_s(r) <= slo_e2el

    @property
    def duration(self) -> float:
        """``metrics.run_duration`` of the records added: first arrival to last finish (0.0 before a finish)."""
        if self.last_finish is None or self.first_arrival is None:
            return 0.0
        return max(0.0, self.last_finish - self.first_arrival)

    def summary(self, duration: float | None = None) -> dict[str, Any]:
        """``summarize(records)`` of the records added, without steps (its step keys are those of no step:
        the caller updates them from ``StepTotals``); ``duration`` as ``summarize``'s."""
        duration = self.duration if duration is None else float(duration)
        per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
        failed = self.errored - self.aborted
        out: dict[str, Any] = {
            "completed": self.completed,
            "failed": failed,
            "aborted": self.aborted,
            "unfinished": self.total - self.completed - failed - self.aborted,
            "duration": duration,
            "total_input_tokens": self.input_tokens,
            "total_output_tokens": self.output_tokens,
            "request_throughput": per_s(self.completed),
            "output_throughput": per_s(self.output_tokens),
            "total_token_throughput": per_s(self.input_tokens + self.output_tokens),
        }
        if self.slo is None or not self.slo.is_set():
            out.update(request_goodput=None, goodput_fraction=None)
        else:
            out.update(request_goodput=self.good / duration if duration > 0 else 0.0,
                       goodput_fraction=_ratio(self.good, self.total))
        out["slo_attainment"] = self.targets_met / self.targeted if self.targeted else None
        for name in ("ttft", "tpot", "itl", "e2el"):
            out.update(self.latencies[name].stats_ms(name, _LATENCY_STATS))
        out.update(self.latencies["queue_time"].stats_ms("queue_time", _QUEUE_STATS))
        out["num_preemptions"] = self.preemptions
        out["prefix_cache_hit_rate"] = _ratio(self.cached_tokens, self.input_tokens)
        out["recomputed_tokens"] = self.recomputed_tokens
        # summarize(records, steps=()): the step figures of no step, replaced by the caller's StepTotals
        out.update(peak_kv_usage=None, mean_kv_usage=None, num_steps=0, mean_step_ms=None, num_evictions=None,
                   mean_kv_slots_unused=None, mean_kv_blocks_cached=None)
        return out


class GroupedAggregates:
    """``RequestAggregates`` per value of the record field ``by`` (``"priority"``, ``"client_id"``), for
    ``metrics.breakdown``'s table; at most ``max_groups`` values, the rest counted under ``"other"``."""

    def __init__(self, by: str, slo: SLO | None = None, capacity: int = DEFAULT_CAPACITY,
                 max_groups: int = DEFAULT_MAX_GROUPS) -> None:
        self.by, self.slo, self.capacity, self.max_groups = by, slo, capacity, max_groups
        self.groups: dict[Any, RequestAggregates] = {}

    def add(self, r: Mapping[str, Any]) -> None:
        """Fold one record into its group's figures."""
        value = r.get(self.by)
        if value not in self.groups and len(self.groups) >= self.max_groups:
            value = OTHER_GROUP
        group = self.groups.get(value)
        if group is None:
            group = self.groups[value] = RequestAggregates(self.slo, self.capacity, seed=len(self.groups))
        group.add(r)  # type: ignore[arg-type]

    def breakdown(self, duration: float) -> dict[str, dict[str, Any]]:
        """``metrics.breakdown(records, by, slo=...)``: each group's summary over the whole run's ``duration``,
        keyed by ``str(value)`` in ``breakdown``'s order."""
        return {str(value): self.groups[value].summary(duration) for value in sorted(self.groups, key=_group_key)}
