"""Bounded step records: how many of a run's step records are kept and written (``records.steps``).

A simulated run of a GPU-scale trace takes millions of engine steps; one record each makes ``steps.jsonl``
gigabytes long. ``StepRecords`` says what is kept:

* ``all`` (the default): every step, as always. A run that passes ``WARN_STEPS`` steps says so in one log line.
* ``every:N``: every N-th step's record, unchanged (step numbers keep their gaps: ``step`` is the run's count).
* ``interval:SECONDS``: one record per replica per SECONDS of run time, aggregating its steps: ``num_steps``
  (how many), ``step`` and ``start_time`` of the first, ``duration`` summed (the time spent stepping), the
  token, sequence, preemption, eviction, prefix-hit, FLOP and byte counts summed, the queue lengths and KV
  blocks used / cached / unused slots at their maximum, free blocks at their minimum, MFU and MBU over the
  window's summed work and time. A record with ``num_steps`` is an aggregate.

Whatever is kept, the run's summary reads ``StepTotals``, accumulated from every step as it happens: step
count, peak and mean KV usage, mean step time, evictions, mean unused slots and cached blocks, the monitor's
run-level MFU/MBU and a cluster's per-replica step figures. Counts, sums of integers and maxima are those of
all steps exactly; means are running sums, equal to the all-steps figures up to float rounding.
``calibrate`` and ``step_time=replay`` need every step: run those with ``records.steps=all``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import numpy as np

from nanovllm.outputs import StepColumns

logger = logging.getLogger(__name__)

#: Steps after which a run that keeps every record says (once) that ``records.steps`` bounds them.
WARN_STEPS = 1_000_000

# How an ``interval`` aggregate combines each key of its steps' records (keys not named keep the last value).
_SUMMED = ("duration", "num_prefill_tokens", "num_decode_tokens", "num_prefill_seqs", "num_decode_seqs",
           "num_preempted", "context_tokens", "attn_pairs", "num_sampled", "prefix_hit_tokens", "recomputed_tokens",
           "swapped_tokens",
           "num_evictions", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
           "spec_decode_num_accepted_tokens", "spec_proposer_fed_tokens", "flops", "bytes")
_MAXED = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_cached", "kv_slots_unused")
_MINNED = ("kv_blocks_free",)
_FIRST = ("step", "start_time")
_UTILISATION = ("mfu", "mbu")   # duration-weighted: the window's work over its time, as Monitor.overall does
# ``kv_tiers`` (per tier counters of the step): summed, but for what a tier holds after the step (the last).
TIER_LEVELS = ("blocks", "bytes")


@dataclass(frozen=True)
class StepRecords:
    """What a run keeps of its step records (the module docstring): ``mode`` ``all``, ``every`` (each
    ``every``-th) or ``interval`` (aggregated per ``interval`` seconds). ``parse`` reads the Hydra spelling."""

    mode: Literal["all", "every", "interval"] = "all"
    every: int = 1
    interval: float = 0.0

    @classmethod
    def parse(cls, spec: str | None) -> "StepRecords":
        """``"all"``, ``"every:N"`` (N >= 1) or ``"interval:SECONDS"`` (> 0); ``ValueError`` naming the option."""
        text = "all" if spec is None else str(spec).strip()
        kind, _, value = text.partition(":")
        number = _number(value)
        if kind == "all" and not value:
            return cls()
        if kind == "every" and value.strip().isdigit() and int(value) >= 1:
            return cls("every", every=int(value))
        if kind == "interval" and number is not None and math.isfinite(number) and number > 0:
            return cls("interval", interval=number)
        raise ValueError(f"records.steps must be all, every:N (N >= 1) or interval:SECONDS (> 0), got {spec!r}")

    @property
    def bounded(self) -> bool:
        return self.mode != "all"

    def __str__(self) -> str:
        return {"all": "all", "every": f"every:{self.every}", "interval": f"interval:{self.interval:g}"}[self.mode]


@dataclass
class RecordsConfig:
    """The Hydra ``records`` node: ``steps``, what ``steps.jsonl`` keeps (``StepRecords.parse``)."""

    steps: str = "all"


@dataclass
class _Sums:
    """Running figures over some steps (the run's, or one replica's)."""

    num_steps: int = 0
    duration: float = 0.0
    usage_sum: float = 0.0
    usage_count: int = 0
    usage_peak: float | None = None
    outstanding: int = 0   # running + waiting, summed

    def add(self, step: Mapping[str, Any]) -> None:
        self.num_steps += 1
        self.duration += step["duration"]
        self.outstanding += step["num_running"] + step["num_waiting"]
        if step["kv_blocks_total"] > 0:
            usage = step["kv_blocks_used"] / step["kv_blocks_total"]
            self.usage_sum += usage
            self.usage_count += 1
            self.usage_peak = usage if self.usage_peak is None else max(self.usage_peak, usage)


    def add_columns(self, steps: StepColumns, rows: np.ndarray | slice, count: int) -> None:
        """``add`` for each of ``steps``' rows ``rows`` (``count`` of them), in order, at once (the same sums,
        added in that order)."""
        if not count:
            return
        self.num_steps += count
        self.duration = running_sum(self.duration, steps.columns["duration"][rows])
        self.outstanding += _int_sum(steps, "num_running", rows, count) + _int_sum(steps, "num_waiting", rows, count)
        total = _values(steps, "kv_blocks_total", rows, count)
        used = _values(steps, "kv_blocks_used", rows, count)
        counted = total > 0
        if counted.any():
            usage = used[counted] / total[counted]
            self.usage_sum = running_sum(self.usage_sum, usage)
            self.usage_count += int(counted.sum())
            peak = float(usage.max())
            self.usage_peak = peak if self.usage_peak is None else max(self.usage_peak, peak)


def _values(steps: StepColumns, key: str, rows: np.ndarray | slice, count: int) -> np.ndarray:
    """``key``'s values at ``rows`` (``count`` of them), a constant broadcast."""
    if key in steps.columns:
        return steps.columns[key][rows]
    return np.full(count, steps.constants[key])


def _int_sum(steps: StepColumns, key: str, rows: np.ndarray | slice, count: int) -> int:
    """The sum of an integer ``key`` over ``rows`` (``count`` of them)."""
    if key in steps.columns:
        return int(steps.columns[key][rows].sum())
    return int(steps.constants[key]) * count


def running_sum(start: float, values: np.ndarray) -> float:
    """``start`` plus each of ``values`` in turn, as a loop of ``+=`` gives it (not numpy's pairwise sum)."""
    if not len(values):
        return start
    return float(np.add.accumulate(np.concatenate(([start], values.astype(float))))[-1])


@dataclass
class StepTotals:
    """The step figures of a run's summary, accumulated from every step as it runs (``add``), so they hold
    whichever records are kept. ``summary()`` has the keys of ``metrics.summarize``'s step and memory figures."""

    run: _Sums = field(default_factory=_Sums)
    replicas: dict[int, _Sums] = field(default_factory=dict)
    has_memory_fields: bool | None = None   # whether the records carry kv_slots_unused (as summarize checks)
    num_evictions: int = 0
    kv_slots_unused: int = 0
    kv_blocks_cached: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    # speculative decoding's counters, summed (None: the records carry none, as summarize checks)
    spec_decode: dict[str, Any] | None = None

    def add(self, step: Mapping[str, Any]) -> None:
        """One step's (annotated) record; called by ``StepLoop`` for every step."""
        self.run.add(step)
        replica = step.get("replica")
        if replica is not None:
            self.replicas.setdefault(replica, _Sums()).add(step)
        if self.has_memory_fields is None:
            self.has_memory_fields = "kv_slots_unused" in step
        if self.has_memory_fields:
            self.num_evictions += step["num_evictions"]
            self.kv_slots_unused += step["kv_slots_unused"]
            self.kv_blocks_cached += step["kv_blocks_cached"]
        self.flops += step.get("flops", 0.0)
        self.bytes += step.get("bytes", 0.0)
        if "spec_decode_num_drafts" in step:
            self._add_spec(step)

    def add_columns(self, steps: StepColumns) -> None:
        """``add`` for each of ``steps`` in order, at once: steps computed ahead (``StepKeeper.offer_columns``
        checked they are plain decodes: no speculative proposals, no KV tiers)."""
        count = len(steps)
        self.run.add_columns(steps, slice(None), count)
        if "replica" in steps.columns:
            replicas = steps.columns["replica"]
            for replica in _in_order_of_appearance(replicas):
                rows = np.flatnonzero(replicas == replica)
                self.replicas.setdefault(replica, _Sums()).add_columns(steps, rows, len(rows))
        elif "replica" in steps.constants:
            self.replicas.setdefault(steps.constants["replica"], _Sums()).add_columns(steps, slice(None), count)
        if self.has_memory_fields is None:
            self.has_memory_fields = "kv_slots_unused" in steps.keys
        if self.has_memory_fields:
            every = slice(None)
            self.num_evictions += _int_sum(steps, "num_evictions", every, count)
            self.kv_slots_unused += _int_sum(steps, "kv_slots_unused", every, count)
            self.kv_blocks_cached += _int_sum(steps, "kv_blocks_cached", every, count)
        if "flops" in steps.columns:
            self.flops = running_sum(self.flops, steps.columns["flops"])
        if "bytes" in steps.columns:
            self.bytes = running_sum(self.bytes, steps.columns["bytes"])
        if "spec_decode_num_drafts" in steps.keys and self.spec_decode is None:
            self.spec_decode = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}

    def _add_spec(self, step: Mapping[str, Any]) -> None:
        spec = self.spec_decode
        if spec is None:
            spec = self.spec_decode = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
        if not step["spec_decode_num_drafts"]:   # no proposal verified in the step: nothing to add
            return
        spec["drafts"] += step["spec_decode_num_drafts"]
        spec["draft_tokens"] += step["spec_decode_num_draft_tokens"]
        spec["accepted"] += step["spec_decode_num_accepted_tokens"]
        counts, per_pos = step.get("spec_decode_num_accepted_tokens_per_pos", []), spec["per_pos"]
        per_pos.extend([0] * (len(counts) - len(per_pos)))
        for position, count in enumerate(counts):
            per_pos[position] += count

    def spec_decode_summary(self) -> dict[str, Any]:
        """``metrics.summarize``'s speculative-decoding figures over every step added ({} when the records
        carry none), for a summary built from totals rather than records (the HTTP server's)."""
        spec = self.spec_decode
        if spec is None:
            return {}
        drafts, draft_tokens, accepted = spec["drafts"], spec["draft_tokens"], spec["accepted"]
        return {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": draft_tokens,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else None,
            "spec_decode_mean_accepted_length": 1.0 + accepted / drafts if drafts else None,
            "spec_decode_num_accepted_tokens_per_pos": list(spec["per_pos"]),
        }

    def summary(self) -> dict[str, Any]:
        """``peak_kv_usage``, ``mean_kv_usage``, ``num_steps``, ``mean_step_ms``, ``num_evictions``,
        ``mean_kv_slots_unused``, ``mean_kv_blocks_cached`` over every step added."""
        run, n = self.run, self.run.num_steps
        out: dict[str, Any] = {
            "peak_kv_usage": run.usage_peak,
            "mean_kv_usage": run.usage_sum / run.usage_count if run.usage_count else None,
            "num_steps": n,
            "mean_step_ms": run.duration / n * 1000.0 if n else None,
        }
        memory = bool(n and self.has_memory_fields)
        out["num_evictions"] = self.num_evictions if memory else None
        out["mean_kv_slots_unused"] = self.kv_slots_unused / n if memory else None
        out["mean_kv_blocks_cached"] = self.kv_blocks_cached / n if memory else None
        return out

    def utilisation(self, peak_flops: float | None, peak_bandwidth: float | None) -> dict[str, float | None]:
        """Run-level MFU and MBU over every step (``Monitor.overall``'s definition: total work over total time)."""
        time = self.run.duration

        def ratio(work: float, peak: float | None) -> float | None:
            return work / time / peak if peak is not None and peak > 0 and time > 0 else None

        return {"mfu": ratio(self.flops, peak_flops), "mbu": ratio(self.bytes, peak_bandwidth)}

    def replica_figures(self, replica: int, duration: float) -> dict[str, Any]:
        """One replica's step figures for ``harness.cluster.per_replica`` (``duration``: the run's length)."""
        sums = self.replicas.get(replica, _Sums())
        return {
            "mean_kv_usage": sums.usage_sum / sums.usage_count if sums.usage_count else 0.0,
            "peak_kv_usage": sums.usage_peak if sums.usage_peak is not None else 0.0,
            "busy_fraction": sums.duration / duration,
            "mean_outstanding": sums.outstanding / sums.num_steps if sums.num_steps else 0.0,
            "num_steps": sums.num_steps,
        }


class StepKeeper:
    """Decides, step by step, which records a run keeps (``StepRecords``) and keeps ``totals`` over all of
    them when it keeps fewer than all. ``StepLoop`` offers every step (``offer``) and ``flush``es at the end."""

    def __init__(self, spec: StepRecords) -> None:
        self.spec = spec
        self.totals: StepTotals | None = StepTotals() if spec.bounded else None
        self.num_steps = 0
        self._open: dict[Any, dict[str, Any]] = {}   # interval: the open aggregate of each replica
        self._warned = False

    def offer(self, step: dict[str, Any]) -> list[dict[str, Any]]:
        """The records to keep and log now, given the run's next step (its record, numbered and annotated)."""
        self.num_steps += 1
        spec = self.spec
        if self.totals is None:
            if self.num_steps == WARN_STEPS and not self._warned:
                self._warned = True
                logger.warning("%d step records kept so far (records.steps=all); records.steps=interval:SECONDS "
                               "or every:N bounds steps.jsonl, with the summary's step figures still over "
                               "every step", WARN_STEPS)
            return [step]
        self.totals.add(step)
        if spec.mode == "every":
            return [step] if (self.num_steps - 1) % spec.every == 0 else []
        return self._aggregate(step)

    def offer_columns(self, steps: StepColumns) -> list[dict[str, Any]]:
        """``offer`` for each of ``steps`` (numbered and annotated) in order, at once: the records to keep and
        log now, the same as offering them one by one gives. Bounded records of plain steps are kept with array
        operations; anything else goes step by step."""
        if self.totals is None or not _plain(steps) or len(steps) < MIN_STEPS_PER_RUN * _num_runs(steps):
            return [kept for step in steps.records() for kept in self.offer(dict(step))]
        first = self.num_steps
        self.num_steps += len(steps)
        self.totals.add_columns(steps)
        if self.spec.mode == "every":
            rows = np.flatnonzero((np.arange(first, self.num_steps)) % self.spec.every == 0)
            return [dict(steps.record(int(row))) for row in rows]
        return self._aggregate_columns(steps)

    def _aggregate_columns(self, steps: StepColumns) -> list[dict[str, Any]]:
        """``_aggregate`` for each of ``steps`` in order: per replica, its steps in runs of one window each."""
        windows = np.floor(steps.columns["start_time"] / self.spec.interval).astype(np.int64)
        replicas = steps.columns.get("replica")
        keys = [steps.constants.get("replica")] if replicas is None else _in_order_of_appearance(replicas)
        done: list[tuple[int, dict[str, Any]]] = []   # (the row whose step closed it, the closed aggregate)
        for key in keys:
            rows = np.arange(len(steps)) if replicas is None else np.flatnonzero(replicas == key)
            bounds = np.flatnonzero(np.diff(windows[rows])) + 1
            for run in np.split(rows, bounds):
                window = int(windows[run[0]])
                current = self._open.get(key)
                if current is not None and current["_window"] == window:
                    _merge_columns(current, steps, run)
                    continue
                step = dict(steps.record(int(run[0])))
                self._open[key] = {**step, "num_steps": 1, "_window": window, **_weighted(step)}
                _merge_columns(self._open[key], steps, run[1:])
                if current is not None:
                    done.append((int(run[0]), _finished(current)))
        return [record for _, record in sorted(done, key=lambda item: item[0])]

    def flush(self) -> list[dict[str, Any]]:
        """The aggregates still open (interval mode), in start order; called once after the last step."""
        done = sorted(self._open.values(), key=lambda record: record["start_time"])
        self._open.clear()
        return [_finished(record) for record in done]

    def _aggregate(self, step: dict[str, Any]) -> list[dict[str, Any]]:
        window = math.floor(step["start_time"] / self.spec.interval)
        key = step.get("replica")
        current = self._open.get(key)
        if current is not None and current["_window"] == window:
            _merge(current, step)
            return []
        self._open[key] = {**step, "num_steps": 1, "_window": window, **_weighted(step)}
        if "kv_tiers" in step:   # a copy: the window's sums must not change the step's own record
            self._open[key]["kv_tiers"] = merge_tier_counts({}, step["kv_tiers"])
        return [] if current is None else [_finished(current)]


def _weighted(step: Mapping[str, Any]) -> dict[str, float]:
    return {f"_{key}_time": step[key] * step["duration"] for key in _UTILISATION if step.get(key) is not None}


# Sets for the per-step merge (each step of a window goes through it).
_FIRST_SET, _SUMMED_SET, _MAXED_SET, _MINNED_SET, _UTILISATION_SET = (
    frozenset(_FIRST), frozenset(_SUMMED), frozenset(_MAXED), frozenset(_MINNED), frozenset(_UTILISATION))


def _merge(record: dict[str, Any], step: Mapping[str, Any]) -> None:
    record["num_steps"] += 1
    for key, value in step.items():
        if key in _FIRST_SET:
            continue
        if key in _SUMMED_SET:
            record[key] += value
        elif key in _MAXED_SET:
            if value > record[key]:
                record[key] = value
        elif key in _MINNED_SET:
            if value < record[key]:
                record[key] = value
        elif key == "kv_tiers":
            record[key] = merge_tier_counts(record.get(key) or {}, value)
        elif key not in _UTILISATION_SET:
            record[key] = value
    for name, value in _weighted(step).items():
        record[name] = record.get(name, 0.0) + value


def _merge_columns(record: dict[str, Any], steps: StepColumns, rows: np.ndarray) -> None:
    """``_merge`` of each of ``steps``' rows ``rows`` into ``record``, in order, at once."""
    if not len(rows):
        return
    record["num_steps"] += len(rows)
    for key, constant in steps.constants.items():   # the same in every step: no arrays needed
        if key in _FIRST_SET or key in _UTILISATION_SET:
            continue
        if key in _SUMMED_SET:
            record[key] = record[key] + constant * len(rows) if isinstance(constant, int) else \
                running_sum(record[key], np.full(len(rows), constant))
        elif key in _MAXED_SET:
            record[key] = max(record[key], constant)
        elif key in _MINNED_SET:
            record[key] = min(record[key], constant)
        else:
            record[key] = list(constant) if isinstance(constant, list) else constant
    last = int(rows[-1])
    for key, column in steps.columns.items():
        if key in _FIRST_SET or key in _UTILISATION_SET:
            continue
        if key in _SUMMED_SET:
            values = column[rows]
            record[key] = running_sum(record[key], values) if values.dtype.kind == "f" or \
                isinstance(record[key], float) else record[key] + int(values.sum())
        elif key in _MAXED_SET:
            record[key] = max(record[key], column[rows].max().item())
        elif key in _MINNED_SET:
            record[key] = min(record[key], column[rows].min().item())
        else:
            record[key] = column[last].item()
    duration = steps.columns["duration"][rows]
    for key in _UTILISATION:
        if key in steps.columns:
            name = f"_{key}_time"
            record[name] = running_sum(record.get(name, 0.0), steps.columns[key][rows] * duration)


#: Fewer steps than this a replica, on average, are kept one by one (the array operations' set-up per replica
#: costs about as much as that many steps' books kept one at a time).
MIN_STEPS_PER_RUN = 8


def _num_runs(steps: StepColumns) -> int:
    """How many replicas' runs of steps ``steps`` interleaves (1 on one engine)."""
    replicas = steps.columns.get("replica")
    return 1 if replicas is None else len(np.unique(replicas))


def _plain(steps: StepColumns) -> bool:
    """Whether ``offer_columns`` may keep ``steps`` with array operations: numeric columns (MFU/MBU known for
    every step or for none), no KV-tier counters, no speculative proposals."""
    if "kv_tiers" in steps.keys or any(column.dtype == object for column in steps.columns.values()):
        return False
    if any(key in steps.constants and steps.constants[key] is not None for key in _UTILISATION):
        return False
    drafts = steps.columns.get("spec_decode_num_drafts")
    return not (steps.constants.get("spec_decode_num_drafts") or (drafts is not None and drafts.any()))


def _in_order_of_appearance(values: np.ndarray) -> list[Any]:
    """The distinct ``values`` in the order they first appear (as Python numbers)."""
    distinct, first = np.unique(values, return_index=True)
    return [distinct[i].item() for i in np.argsort(first)]


def merge_tier_counts(total: Mapping[str, Mapping[str, float]],
                      step: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """A new ``kv_tiers`` mapping: ``total``'s counters plus ``step``'s per tier, and what each tier holds
    (``TIER_LEVELS``) as of ``step`` (the later one)."""
    out = {name: dict(counts) for name, counts in total.items()}
    for name, counts in step.items():
        merged = out.setdefault(name, {})
        for key, value in counts.items():
            merged[key] = value if key in TIER_LEVELS else merged.get(key, 0) + value
    return out


def _finished(record: dict[str, Any]) -> dict[str, Any]:
    """An aggregate as it is written: MFU/MBU over its summed time, the bookkeeping keys dropped."""
    out = {key: value for key, value in record.items() if not key.startswith("_")}
    for key in _UTILISATION:
        if key in out:
            weighted = record.get(f"_{key}_time")
            out[key] = weighted / out["duration"] if weighted is not None and out["duration"] > 0 else None
    return out


def _number(text: str) -> float | None:
    """``text`` as a number, None when it is not one."""
    try:
        return float(text)
    except ValueError:
        return None
