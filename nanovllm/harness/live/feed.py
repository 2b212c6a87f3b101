"""A run's files, read as they grow, and what the live views draw from them at any moment ``t``.

``RunFeed`` tails ``steps.jsonl``, ``requests.jsonl`` and ``blocks.jsonl`` through ``records.JsonlTail`` (a
torn last line waits for its newline), so it works the same on a run in progress and on a finished one. The
functions below turn records into plain columns for the charts; they take a time ``t`` so the dashboard's
scrubber can show the run as it was at any moment. All times are seconds since the run started.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from nanovllm.engine.kv_offload import tier_capacities
from nanovllm.serving.metrics import summarize_with_breakdowns
from nanovllm.serving.records import (
    BLOCKS_FILE,
    CONFIG_FILE,
    ENGINE_FILE,
    REQUESTS_FILE,
    STEPS_FILE,
    JsonlTail,
    is_run_dir,
    read_metrics,
)
from nanovllm.serving.step_records import merge_tier_counts

PHASES = ("queued", "prefill", "decoding", "preempted", "finished", "failed")


class NotARunError(ValueError):
    """The path given to the dashboard is not a run (or sweep) directory."""


def check_run_dir(path: str | Path, starting: bool = False) -> Path:
    """``path`` as a run or sweep directory, or ``NotARunError`` saying what is wrong with it. ``starting``: the
    run is still loading its model, so an existing directory without its files yet is fine."""
    path = Path(path)
    if not path.exists():
        raise NotARunError(f"{path} does not exist")
    if not path.is_dir():
        raise NotARunError(f"{path} is a file, not a run directory")
    if not starting and not is_run_dir(path) and not sweep_runs(path):
        raise NotARunError(f"{path} is not a run directory (no {STEPS_FILE} or metrics.json) nor a multirun "
                           f"directory (no job subdirectories with them)")
    return path


def sweep_runs(path: str | Path) -> list[Path]:
    """The job directories of a multirun directory (numbered ``0``, ``1``, ... by Hydra), in job order."""
    path = Path(path)
    jobs = [p for p in path.iterdir() if p.is_dir() and is_run_dir(p)] if path.is_dir() else []
    return sorted(jobs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


@dataclass
class EngineSizes:
    """What the charts are drawn against; from ``engine.json`` (live runs) or the run's ``config.json``."""

    num_kv_blocks: int | None = None
    bytes_per_block: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_requests: int | None = None
    num_speculative_tokens: int | None = None   # K when speculative decoding is on, else None
    # The KV tiers (``kv_offload``) by record name, with their capacity in bytes (a cluster's: every replica's
    # together, as its occupancy is summed; None where unstated); None when the run has none or does not say
    kv_tiers: dict[str, int | None] | None = None

    @classmethod
    def read(cls, run_dir: Path) -> "EngineSizes":
        for name in (ENGINE_FILE, CONFIG_FILE):
            try:
                data = json.loads((run_dir / name).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if name == CONFIG_FILE:
                engine = data.get("engine") or {}
                workload = data.get("workload") or {}
                replicas = (data.get("cluster") or {}).get("replicas") or 1
                spec = data.get("speculative") or {}
                data = {**engine, "num_requests": workload.get("num_requests") or workload.get("max_requests"),
                        "num_speculative_tokens": spec.get("num_tokens") if spec.get("method") else None,
                        "kv_tiers": _config_tiers(data.get("kv_offload"), replicas)}
                for key in ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):  # a cluster's: totals
                    if isinstance(data.get(key), int):
                        data[key] *= replicas
            return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})
        return cls()


def cluster_tier_capacities(capacities: Mapping[str, int | None], replicas: int) -> dict[str, int | None]:
    """A cluster's tier capacities from one replica's: each replica has its own tiers (their occupancy is
    summed, so their capacity is too), but ``shared`` is one store every replica sees (the largest replica's
    view of it is drawn, and each replica bounds what it adds to ``capacity``)."""
    return {name: capacity if capacity is None or name == "shared" else capacity * replicas
            for name, capacity in capacities.items()}


def _config_tiers(spec: Any, replicas: int) -> dict[str, int | None] | None:
    """The tiers of a run's ``kv_offload`` config (None: off, or not a spec the engine would take)."""
    try:
        capacities = tier_capacities(spec)
    except ValueError:
        return None
    return cluster_tier_capacities(capacities, replicas) or None


# How much of a run the live views hold: the latest steps and ended requests, and the latest block snapshots (each
# holds every running request's block table, so fewer). A server that runs for days appends without end; the
# views show a rolling window of it, and memory stays bounded (the files keep everything).
WINDOW = 20_000
SNAPSHOT_WINDOW = 1_000


@dataclass
class RunFeed:
    """The latest of one run directory: ``poll`` reads what was appended since and keeps the latest ``window``
    steps and requests and ``snapshot_window`` block snapshots (older ones are dropped: ``num_*_seen`` count
    every one read)."""

    run_dir: Path
    steps: list[dict] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)
    snapshots: list[dict] = field(default_factory=list)
    sizes: EngineSizes = field(default_factory=EngineSizes)
    finished: bool = False
    # request id -> [start, end or None] intervals in which a snapshot saw it preempted (those that closed
    # before the oldest snapshot kept are dropped with it)
    preempted: dict[str, list[list[float | None]]] = field(default_factory=dict)
    window: int = WINDOW
    snapshot_window: int = SNAPSHOT_WINDOW
    num_steps_seen: int = 0
    num_requests_seen: int = 0

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self._tails = {name: JsonlTail(self.run_dir / name) for name in (STEPS_FILE, REQUESTS_FILE, BLOCKS_FILE)}

    def poll(self) -> tuple[list[dict], list[dict], list[dict]]:
        """Read newly appended steps, requests and snapshots (and keep them); returns the new ones."""
        if self.sizes.num_kv_blocks is None or self.sizes.num_requests is None:
            self.sizes = EngineSizes.read(self.run_dir)
        self.finished = self.finished or read_metrics(self.run_dir) is not None
        steps, requests, snapshots = (self._tails[n].read_new() for n in (STEPS_FILE, REQUESTS_FILE, BLOCKS_FILE))
        self.steps += steps
        self.requests += requests
        self.num_steps_seen += len(steps)
        self.num_requests_seen += len(requests)
        for snapshot in snapshots:
            self._track_preemptions(snapshot)
        self.snapshots += snapshots
        self._trim()
        return steps, requests, snapshots

    def _trim(self) -> None:
        """Keep the rolling window: the latest ``window`` steps and requests, ``snapshot_window`` snapshots."""
        for kept, limit in ((self.steps, self.window), (self.requests, self.window),
                            (self.snapshots, self.snapshot_window)):
            if len(kept) > limit:
                del kept[:len(kept) - limit]
        if self.snapshots:
            oldest = self.snapshots[0]["time"]
            for request_id in [rid for rid, intervals in self.preempted.items()
                               if intervals[-1][1] is not None and intervals[-1][1] < oldest]:
                del self.preempted[request_id]

    @property
    def first_step_index(self) -> int:
        """The index (among every step read) of ``steps[0]``."""
        return self.num_steps_seen - len(self.steps)

    def steps_between(self, start: int, stop: int | None = None) -> list[dict]:
        """The kept steps whose index among every step read is in [``start``, ``stop``)."""
        first = self.first_step_index
        return self.steps[max(0, start - first):None if stop is None else max(0, stop - first)]

    def _track_preemptions(self, snapshot: dict) -> None:
        now = snapshot["time"]
        seen_preempted = {r["request_id"] for r in snapshot["requests"] if r["status"] == "preempted"}
        for request_id, intervals in self.preempted.items():
            if intervals[-1][1] is None and request_id not in seen_preempted:
                intervals[-1][1] = now
        for request_id in seen_preempted:
            intervals = self.preempted.setdefault(request_id, [])
            if not intervals or intervals[-1][1] is not None:
                intervals.append([now, None])

    @property
    def torn_files(self) -> list[str]:
        """Files whose last line is incomplete right now (normal while a run writes; damage once it ended)."""
        return [name for name, tail in self._tails.items() if tail.torn]

    @property
    def bad_lines(self) -> int:
        return sum(tail.bad_lines for tail in self._tails.values())

    @property
    def end_time(self) -> float:
        """The latest moment the files describe."""
        return step_end(self.steps[-1]) if self.steps else 0.0

    def snapshot_at(self, t: float) -> dict | None:
        """The last block snapshot taken at or before ``t``."""
        index = bisect.bisect_right([s["time"] for s in self.snapshots], t)
        return self.snapshots[index - 1] if index else None

    def steps_until(self, t: float) -> list[dict]:
        return self.steps[:bisect.bisect_right([step_end(s) for s in self.steps], t)]

    def requests_ended_by(self, t: float) -> list[dict]:
        return [r for r in self.requests if (r["finish_time"] if r["finish_time"] is not None else 0.0) <= t]


def step_end(step: dict) -> float:
    return step["start_time"] + step["duration"]


# -- columns for the charts ---------------------------------------------------------------------------------------

STEP_COLUMNS = ("t", "step", "running", "waiting", "preempted", "max_num_seqs", "kv_used", "kv_cached", "kv_free",
                "kv_used_mib", "kv_cached_mib", "kv_free_mib", "prefill_tokens", "decode_seqs", "token_budget",
                "throughput")


_STATE_KEYS = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_cached", "kv_blocks_free")


def step_columns(steps: Sequence[dict], sizes: EngineSizes, history: Sequence[dict] = (),
                 window: float = 2.0) -> dict[str, list]:
    """One row per step for the time-series charts. ``history``: the steps before these (for the rolling
    throughput, output tokens per second over the last ``window`` seconds). A cluster's steps (they carry
    ``replica``) interleave replicas: the queue and KV columns are the sums of every replica's latest state."""
    mib = (sizes.bytes_per_block or 0) / 2**20
    every = list(history) + list(steps)
    ends = [step_end(s) for s in every]
    cumulative = [0]
    for s in every:
        cumulative.append(cumulative[-1] + s.get("num_sampled", s["num_decode_tokens"]))
    latest: dict[Any, dict] = {}   # replica -> its last step's state
    for s in history:
        latest[s.get("replica")] = s
    columns: dict[str, list] = {name: [] for name in STEP_COLUMNS}
    for offset, s in enumerate(steps, start=len(history)):
        t = ends[offset]
        start = bisect.bisect_left(ends, t - window, 0, offset + 1)
        span = t - (ends[start - 1] if start else 0.0)
        latest[s.get("replica")] = s
        state = {key: sum(r.get(key, 0) for r in latest.values()) for key in _STATE_KEYS}
        row = {
            "t": t, "step": s["step"], "running": state["num_running"], "waiting": state["num_waiting"],
            "preempted": s["num_preempted"], "max_num_seqs": sizes.max_num_seqs or 0,
            "kv_used": state["kv_blocks_used"], "kv_cached": state["kv_blocks_cached"],
            "kv_free": state["kv_blocks_free"],
            "prefill_tokens": s["num_prefill_tokens"], "decode_seqs": s["num_decode_seqs"],
            "token_budget": sizes.max_num_batched_tokens or 0,
            "throughput": (cumulative[offset + 1] - cumulative[start]) / span if span > 0 else 0.0,
        }
        for name in ("used", "cached", "free"):
            row[f"kv_{name}_mib"] = row[f"kv_{name}"] * mib
        for name in STEP_COLUMNS:
            columns[name].append(row[name])
    return columns


REPLICA_COLUMNS = ("t", "running", "waiting", "kv_usage")


def replica_columns(steps: Sequence[dict]) -> dict[int, dict[str, list]]:
    """Per replica (the steps' ``replica``), one row per step of its own: its running and waiting requests and
    its KV usage (blocks used over its total) after the step. Empty for one engine's steps."""
    columns: dict[int, dict[str, list]] = {}
    for s in steps:
        replica = s.get("replica")
        if replica is None:
            continue
        mine = columns.setdefault(replica, {name: [] for name in REPLICA_COLUMNS})
        total = s["kv_blocks_total"]
        for name, value in (("t", step_end(s)), ("running", s["num_running"]), ("waiting", s["num_waiting"]),
                            ("kv_usage", s["kv_blocks_used"] / total if total else 0.0)):
            mine[name].append(value)
    return columns


SPEC_COLUMNS = ("t", "step", "drafts", "proposed", "accepted", "acceptance_rate", "mean_accepted_length")


def speculating(steps: Sequence[dict], sizes: EngineSizes) -> bool:
    """Whether the run decodes speculatively: its sizes say so (``engine.json`` or ``config.json``), or a step
    proposed something (a replayed run that has neither file)."""
    return bool(sizes.num_speculative_tokens) or any(s.get("spec_decode_num_draft_tokens") for s in steps)


def spec_columns(steps: Sequence[dict], history: Sequence[dict] = (), window: float = 5.0) -> dict[str, list]:
    """One row per step for the speculation charts: the step's verifications (``drafts``), proposed and
    accepted tokens, and over the last ``window`` seconds (``history``: the steps before these, as for
    ``step_columns``) the acceptance rate (accepted / proposed tokens) and mean accepted length (1 + accepted /
    drafts, vLLM's). NaN (a gap in the line) when nothing was proposed in the window. Steps recorded before the
    counters existed count as proposing nothing."""
    every = list(history) + list(steps)
    ends = [step_end(s) for s in every]
    sums = [(0, 0, 0)]   # cumulative (drafts, proposed, accepted)
    for s in every:
        d, p, a = sums[-1]
        sums.append((d + s.get("spec_decode_num_drafts", 0), p + s.get("spec_decode_num_draft_tokens", 0),
                     a + s.get("spec_decode_num_accepted_tokens", 0)))
    columns: dict[str, list] = {name: [] for name in SPEC_COLUMNS}
    for offset, s in enumerate(steps, start=len(history)):
        t = ends[offset]
        start = bisect.bisect_left(ends, t - window, 0, offset + 1)
        drafts, proposed, accepted = (now - then for now, then in zip(sums[offset + 1], sums[start]))
        row = {"t": t, "step": s["step"], "drafts": s.get("spec_decode_num_drafts", 0),
               "proposed": s.get("spec_decode_num_draft_tokens", 0),
               "accepted": s.get("spec_decode_num_accepted_tokens", 0),
               "acceptance_rate": accepted / proposed if proposed else math.nan,
               "mean_accepted_length": 1.0 + accepted / drafts if drafts else math.nan}
        for name in SPEC_COLUMNS:
            columns[name].append(row[name])
    return columns


POSITION_COLUMNS = ("position", "accepted", "drafts", "rate")


@dataclass
class SpecTotals:
    """Speculation counts summed over the steps added so far (a few integers, whatever the run's length): what
    the per-position chart draws. ``add`` takes steps in order; the dashboard adds new steps as they arrive
    and starts a fresh one when the slider goes back."""

    drafts: int = 0
    proposed: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)

    def add(self, steps: Sequence[dict]) -> None:
        for s in steps:
            self.drafts += s.get("spec_decode_num_drafts", 0)
            self.proposed += s.get("spec_decode_num_draft_tokens", 0)
            self.accepted += s.get("spec_decode_num_accepted_tokens", 0)
            counts = s.get("spec_decode_num_accepted_tokens_per_pos", [])
            self.per_pos.extend([0] * (len(counts) - len(self.per_pos)))
            for position, count in enumerate(counts):
                self.per_pos[position] += count

    def positions(self, num_tokens: int | None = None) -> dict[str, list]:
        """Per proposal position (1 = the first proposed token; ``num_tokens``: K, so positions never accepted
        still show): accepted proposals and their rate per verification, vLLM's per-position acceptance
        (accepted at i / drafts). With a policy that varies K, fewer drafts reach the later positions than
        the rate's denominator counts."""
        count = max(len(self.per_pos), num_tokens or 0)
        accepted = self.per_pos + [0] * (count - len(self.per_pos))
        return {"position": list(range(1, count + 1)), "accepted": accepted, "drafts": [self.drafts] * count,
                "rate": [a / self.drafts if self.drafts else 0.0 for a in accepted]}


TIER_COLUMNS = ("t", "step", "blocks", "mib", "fraction", "blocks_loaded", "blocks_written", "mib_loaded",
                "mib_written", "hit_tokens")


def has_tiers(steps: Sequence[dict], sizes: EngineSizes) -> bool:
    """Whether the run has KV tiers below its pool: its sizes say so (``engine.json`` or ``config.json``), or a
    step carries their counters (a replayed run that has neither file)."""
    return bool(sizes.kv_tiers) or any(s.get("kv_tiers") for s in steps)


def _holding(replicas: Mapping[Any, Mapping[str, float]], name: str) -> tuple[float, float]:
    """(blocks, bytes) one tier holds: each replica's latest, summed; ``shared`` is one store every replica
    sees, so the largest (as ``metrics.json`` counts it)."""
    combine = max if name == "shared" else sum
    return (combine(c.get("blocks", 0) for c in replicas.values()),
            combine(c.get("bytes", 0) for c in replicas.values()))


def tier_columns(steps: Sequence[dict], sizes: EngineSizes, history: Sequence[dict] = ()) -> dict[str, dict[str, list]]:
    """Per tier (by record name), one row per step that carries its counters: what the tier holds after the
    step (blocks, MiB, and the fraction of its capacity where the run states one, else NaN) and what the step
    moved (blocks and MiB loaded from it and written to it, prompt tokens it served). ``history``: the steps
    before these; a cluster's steps interleave replicas, and a tier's holdings are then every replica's latest
    together (``_holding``)."""
    latest: dict[str, dict[Any, Mapping[str, float]]] = {}   # tier -> replica -> its latest counters
    for s in history:
        for name, counts in (s.get("kv_tiers") or {}).items():
            latest.setdefault(name, {})[s.get("replica")] = counts
    capacities = sizes.kv_tiers or {}
    columns: dict[str, dict[str, list]] = {}
    for s in steps:
        for name, counts in (s.get("kv_tiers") or {}).items():
            latest.setdefault(name, {})[s.get("replica")] = counts
            blocks, held = _holding(latest[name], name)
            capacity = capacities.get(name)
            row = {"t": step_end(s), "step": s["step"], "blocks": blocks, "mib": held / 2**20,
                   "fraction": held / capacity if capacity else math.nan,
                   "blocks_loaded": counts.get("blocks_loaded", 0), "blocks_written": counts.get("blocks_written", 0),
                   "mib_loaded": counts.get("bytes_loaded", 0) / 2**20,
                   "mib_written": counts.get("bytes_written", 0) / 2**20, "hit_tokens": counts.get("hit_tokens", 0)}
            mine = columns.setdefault(name, {column: [] for column in TIER_COLUMNS})
            for column in TIER_COLUMNS:
                mine[column].append(row[column])
    return columns


@dataclass
class TierTotals:
    """KV tier counters summed over the steps added so far, and what each tier holds after the latest (a few
    numbers per tier and replica, whatever the run's length): the tier section's headline. ``add`` takes steps
    in order; the dashboard adds new steps as they arrive and starts a fresh one when the slider goes back."""

    counts: dict[str, dict[str, float]] = field(default_factory=dict)   # tier -> summed counters
    held: dict[str, dict[Any, Mapping[str, float]]] = field(default_factory=dict)  # tier -> replica -> latest
    # Prompt tokens the steps admitted, computed as prefill or found cached: the hit rate's denominator (all
    # prompt tokens, as metrics.json's hit_rate, unless a preempted request was readmitted: its tokens count again)
    admitted_tokens: int = 0

    def add(self, steps: Sequence[dict]) -> None:
        for s in steps:
            self.admitted_tokens += s.get("num_prefill_tokens", 0) + s.get("prefix_hit_tokens", 0)
            tiers = s.get("kv_tiers")
            if not tiers:
                continue
            self.counts = merge_tier_counts(self.counts, tiers)
            for name, counts in tiers.items():
                self.held.setdefault(name, {})[s.get("replica")] = counts

    def figures(self, name: str, capacity: int | None = None) -> dict[str, float | None]:
        """The tier's headline: what it holds after the latest step added (``blocks``, ``mib``, and with its
        ``capacity`` in bytes the ``fraction`` of it, else None), its ``hit_rate`` (None before any admission),
        and over the steps added the blocks and MiB loaded and written and the seconds spent loading."""
        blocks, held = _holding(self.held.get(name, {}), name)
        counts = self.counts.get(name, {})
        hits = counts.get("hit_tokens", 0)
        return {"blocks": blocks, "mib": held / 2**20, "fraction": held / capacity if capacity else None,
                "hit_tokens": hits, "hit_rate": hits / self.admitted_tokens if self.admitted_tokens else None,
                "blocks_loaded": counts.get("blocks_loaded", 0), "mib_loaded": counts.get("bytes_loaded", 0) / 2**20,
                "blocks_written": counts.get("blocks_written", 0),
                "mib_written": counts.get("bytes_written", 0) / 2**20, "load_seconds": counts.get("load_seconds", 0.0)}


GANTT_COLUMNS = ("row", "start", "end", "phase", "request_id", "priority", "client", "prompt_tokens",
                 "output_tokens", "preemptions", "ttft_ms", "e2el_ms")


def _segments(spans: list[tuple[float, float | None, str]], t: float) -> list[tuple[float, float, str]]:
    """Clip (start, end, phase) spans to ``t``; drop empty ones. The end marks (finished / failed) are drawn as
    a short tick after the end, whatever ``t``, so that they stay visible."""
    out = []
    for start, end, phase in spans:
        if phase in ("finished", "failed"):
            out.append((start, start + max(0.005, 0.006 * t), phase))
            continue
        end = t if end is None else min(end, t)
        if start < end or (start == end == t and phase == "queued"):
            out.append((start, end, phase))
    return out


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else (b - a) * 1000


def _request_spans(r: dict, end_phase: str | None, end: float | None) -> list[tuple[float, float | None, str]]:
    """Queued until first scheduled, prefill until the first token, decoding until ``end``."""
    scheduled, first = r.get("first_scheduled_time"), r.get("first_token_time")
    spans = [(r["arrival_time"], scheduled if scheduled is not None else end, "queued")]
    if scheduled is not None:
        spans.append((scheduled, first if first is not None else end, "prefill"))
    if first is not None:
        spans.append((first, end, "decoding"))
    if end_phase is not None and end is not None:
        spans.append((end, end, end_phase))
    return spans


def gantt_rows(feed: RunFeed, t: float, max_rows: int = 80, group_by: str = "priority") -> dict[str, list]:
    """Gantt segments of the requests that arrived by ``t`` (the latest ``max_rows`` by arrival), rows
    grouped by ``group_by`` (``"priority"`` or ``"client_id"``). A request that ended by ``t`` is drawn from its
    record; one still in flight from the last snapshot (live runs only). Preempted intervals come from the
    snapshots, so they are as fine-grained as ``live.snapshot_every``."""
    entries: dict[str, tuple[dict, str | None]] = {}
    snapshot = feed.snapshot_at(t)
    for r in (snapshot or {}).get("requests", []):
        if r["arrival_time"] <= t:
            entries[r["request_id"]] = (r, None)
    for r in feed.requests:
        if r["arrival_time"] > t:
            continue
        ended = r["finish_time"] is not None and r["finish_time"] <= t
        if ended or r["request_id"] not in entries:
            entries[r["request_id"]] = (r, ("failed" if r["error"] is not None else "finished") if ended else None)
    chosen = sorted(entries.values(), key=lambda e: e[0]["arrival_time"])[-max_rows:]
    chosen.sort(key=lambda e: (str(e[0].get(group_by)), e[0]["arrival_time"]))
    columns: dict[str, list] = {name: [] for name in GANTT_COLUMNS}
    for r, end_phase in chosen:
        end = r["finish_time"] if end_phase is not None else None
        spans = _request_spans(r, end_phase, end)
        for start, stop in feed.preempted.get(r["request_id"], []):
            spans.append((start, stop if stop is not None else end, "preempted"))
        row = f"{group_by[0]}{r.get(group_by)} · {r['request_id']}"
        for start, stop, phase in _segments(spans, t):
            values = {
                "row": row, "start": start, "end": stop, "phase": phase, "request_id": r["request_id"],
                "priority": r.get("priority"), "client": str(r.get("client_id")),
                "prompt_tokens": r["num_prompt_tokens"], "output_tokens": r["num_output_tokens"],
                "preemptions": r["num_preemptions"], "ttft_ms": _ms(r["arrival_time"], r.get("first_token_time")),
                "e2el_ms": _ms(r["arrival_time"], r.get("finish_time")),
            }
            for name in GANTT_COLUMNS:
                columns[name].append(values[name])
    return columns


BLOCK_COLUMNS = ("block", "x", "y", "owner", "owners", "state")


def block_map(snapshot: dict | None, num_blocks: int, width: int = 32) -> dict[str, list]:
    """One cell per KV block, laid out ``width`` to a row: who holds it in ``snapshot``; ``state`` is
    ``free``, ``owned`` or ``shared`` (held by several requests: a prefix-cache hit)."""
    holders: dict[int, list[str]] = {}
    for r in (snapshot or {}).get("requests", []):
        for block in r["blocks"]:
            holders.setdefault(block, []).append(r["request_id"])
    columns: dict[str, list] = {name: [] for name in BLOCK_COLUMNS}
    for block in range(num_blocks):
        owners = holders.get(block, [])
        state = "free" if not owners else "shared" if len(owners) > 1 else "owned"
        values = {"block": block, "x": block % width, "y": block // width, "owner": owners[0] if owners else "",
                  "owners": ", ".join(owners), "state": state}
        for name in BLOCK_COLUMNS:
            columns[name].append(values[name])
    return columns


LATENCY_COLUMNS = ("group", "requests", "done", "failed", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms",
                   "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms", "output_tok_s")


def latency_table(requests: Sequence[dict]) -> dict[str, list]:
    """TTFT/TPOT/ITL percentiles of the requests ended so far: overall, per priority class, per client."""
    overall, breakdowns = summarize_with_breakdowns(requests, (), ("priority", "client_id")) if requests else ({}, {})
    groups: list[tuple[str, dict[str, Any]]] = [("all", overall)] if requests else []
    for by, label in (("priority", "priority "), ("client_id", "client ")):
        parts = breakdowns.get(by, {})
        if len(parts) > 1:
            groups += [(label + name, summary) for name, summary in parts.items()]
    columns: dict[str, list] = {name: [] for name in LATENCY_COLUMNS}
    for name, s in groups:
        values = {"group": name, "requests": s["completed"] + s["failed"] + s["unfinished"], "done": s["completed"],
                  "failed": s["failed"], "output_tok_s": s.get("output_throughput")}
        for metric in ("ttft", "tpot", "itl"):
            values[f"p50_{metric}_ms"] = s.get(f"median_{metric}_ms")
            values[f"p99_{metric}_ms"] = s.get(f"p99_{metric}_ms")
        for column in LATENCY_COLUMNS:
            columns[column].append(values[column])
    return columns
