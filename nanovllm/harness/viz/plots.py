"""Plots of one run, or a comparison of several, drawn from the run's files alone.

A run directory holds ``requests.jsonl`` and ``steps.jsonl`` (``nanovllm.serving.records``) and ``metrics.json``
(summary plus ``breakdowns``). Every plot here is a function from loaded runs to a matplotlib ``Figure``;
figures are built without pyplot, so nothing touches the global backend or leaks open figures, and saving
goes through Agg.
"""

from __future__ import annotations

import itertools

import os
from pathlib import Path
from typing import Iterable, Sequence

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from nanovllm.serving.metrics import e2el_s, is_completed, tpot_s, ttft_s
from nanovllm.serving.records import RunData, read_run

QUEUED, PREFILL, DECODE = "#bbbbbb", "#e4572e", "#4c72b0"
MAX_TIMELINE_REQUESTS = 400  # beyond this the bars are sub-pixel; the first ones still show the pattern


def load_run(run_dir: str | Path, label: str | None = None) -> RunData:
    """Read a run directory (through ``records``, the one reader of run files); missing files give empty
    records rather than errors (a run cut short)."""
    return read_run(run_dir, label)


def run_labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """Short distinct names: the directory name, or more of the path where names collide (Hydra multirun
    directories are all called 0, 1, 2 ... under different sweeps)."""
    paths = [Path(d).resolve() for d in run_dirs]
    depth = 1
    while True:
        labels = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels) or depth >= max(len(p.parts) for p in paths):
            return labels
        depth += 1


# -- per-request latencies --------------------------------------------------------------------------------------


def _completed(requests: Iterable[dict]) -> list[dict]:
    return [r for r in requests if is_completed(r)]


def ttfts(requests: Iterable[dict]) -> list[float]:
    """Time to first token (s) of each completed request."""
    return [t for t in map(ttft_s, _completed(requests)) if t is not None]


def tpots(requests: Iterable[dict]) -> list[float]:
    """Time per output token after the first (s), for completed requests with at least two tokens."""
    return [t for t in map(tpot_s, _completed(requests)) if t is not None]


def e2els(requests: Iterable[dict]) -> list[float]:
    """End-to-end latency (s) of each completed request."""
    return [e2el_s(r) for r in _completed(requests)]


# -- figures ----------------------------------------------------------------------------------------------------


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what}", ha="center", va="center", transform=ax.transAxes, color="gray")


def _phases(r: dict) -> tuple[float, float, float, float]:
    """(arrival, first scheduled, first token, end) of a request, collapsing phases it never reached."""
    arrival = r["arrival_time"]
    end = r.get("finish_time")
    scheduled = r.get("first_scheduled_time")
    first_token = r.get("first_token_time")
    end = end if end is not None else max(t for t in (arrival, scheduled, first_token) if t is not None)
    scheduled = scheduled if scheduled is not None else end
    first_token = first_token if first_token is not None else end
    return arrival, scheduled, first_token, end


def plot_timeline(run: RunData) -> Figure:
    """One horizontal bar per request (by arrival): queued, prefill (until first token), decode (until finish).
    Preemptions (×N) and failures are annotated at the bar's end; failed requests are hatched."""
    requests = sorted(run.requests, key=lambda r: r["arrival_time"])[:MAX_TIMELINE_REQUESTS]
    fig = Figure(figsize=(10, min(2 + 0.18 * len(requests), 24)))
    ax = fig.add_subplot()
    if not requests:
        _no_data(ax, "requests")
        return fig
    phases = [_phases(r) for r in requests]
    y = list(range(len(requests)))
    for (start, stop), color, label in (((0, 1), QUEUED, "queued"), ((1, 2), PREFILL, "prefill"),
                                        ((2, 3), DECODE, "decode")):
        ax.barh(y, [p[stop] - p[start] for p in phases], left=[p[start] for p in phases], color=color,
                label=label, height=0.8)
    for i, r in enumerate(requests):
        notes = [f"×{r['num_preemptions']}"] if r.get("num_preemptions") else []
        if r.get("error") is not None:
            notes.append("failed")
            ax.barh(i, phases[i][3] - phases[i][0], left=phases[i][0], fill=False, hatch="//",
                    edgecolor="black", height=0.8)
        if notes:
            ax.annotate(" ".join(notes), (phases[i][3], i), xytext=(3, 0), textcoords="offset points",
                        va="center", fontsize=7)
    ax.set_yticks(y if len(y) <= 40 else [])
    ax.set_yticklabels([str(r["request_id"]) for r in requests] if len(y) <= 40 else [])
    ax.invert_yaxis()  # first arrival on top, like a Gantt chart
    ax.set_xlabel("time since run start (s)")
    ax.set_ylabel("request")
    ax.set_title(f"{run.label}: request timeline (×N = preempted N times)")
    ax.legend(loc="lower right", fontsize=8)
    return fig


def _step_end_times(steps: list[dict]) -> list[float]:
    return [s["start_time"] + s["duration"] for s in steps]


def plot_kv_usage(run: RunData) -> Figure:
    """KV blocks used (and held by the prefix cache) as a share of all blocks, and running / waiting counts."""
    fig = Figure(figsize=(10, 6))
    kv_ax, queue_ax = fig.subplots(2, 1, sharex=True)
    if not run.steps:
        _no_data(kv_ax, "steps")
        return fig
    t = _step_end_times(run.steps)
    total = [max(s["kv_blocks_total"], 1) for s in run.steps]
    used = [s["kv_blocks_used"] / n for s, n in zip(run.steps, total)]
    cached = [s.get("kv_blocks_cached", 0) / n for s, n in zip(run.steps, total)]
    kv_ax.fill_between(t, 0, used, step="post", color=DECODE, alpha=0.7, lw=0, label="used")
    kv_ax.fill_between(t, used, [u + c for u, c in zip(used, cached)], step="post", color=QUEUED,
                       alpha=0.7, lw=0, label="cached (free, reusable)")
    kv_ax.set_ylim(0, 1.05)
    kv_ax.set_ylabel("KV blocks / total")
    kv_ax.legend(loc="upper left", fontsize=8)
    kv_ax.set_title(f"{run.label}: KV cache and queues")
    queue_ax.step(t, [s["num_running"] for s in run.steps], where="post", label="running", color=DECODE)
    queue_ax.step(t, [s["num_waiting"] for s in run.steps], where="post", label="waiting", color=PREFILL)
    preempted = [(ti, s["num_preempted"]) for ti, s in zip(t, run.steps) if s.get("num_preempted")]
    if preempted:
        queue_ax.scatter(*zip(*preempted), marker="x", color="black", label="preemptions", zorder=3)
    queue_ax.set_xlabel("time since run start (s)")
    queue_ax.set_ylabel("requests")
    queue_ax.legend(loc="upper left", fontsize=8)
    return fig


def plot_batch_composition(run: RunData) -> Figure:
    """Tokens computed per step, prefill stacked under decode (filled steps, not bars: runs have 10^4 steps)."""
    fig = Figure(figsize=(10, 4))
    ax = fig.add_subplot()
    if not run.steps:
        _no_data(ax, "steps")
        return fig
    x = [s["step"] for s in run.steps]
    prefill = [s["num_prefill_tokens"] for s in run.steps]
    total = [p + s["num_decode_tokens"] for p, s in zip(prefill, run.steps)]
    # Each step owns [step, step + 1): extend by one so the last step is drawn too.
    x, prefill, total = x + [x[-1] + 1], prefill + prefill[-1:], total + total[-1:]
    ax.fill_between(x, 0, prefill, step="post", color=PREFILL, lw=0, label="prefill tokens")
    ax.fill_between(x, prefill, total, step="post", color=DECODE, lw=0, label="decode tokens")
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens in batch")
    ax.set_title(f"{run.label}: batch composition")
    ax.legend(loc="upper right", fontsize=8)
    return fig


def plot_cache_activity(run: RunData) -> Figure:
    """Prefix-cache and memory activity per step, cumulative: prompt tokens served from the cache, tokens
    recomputed after preemptions, cached blocks evicted; and allocated KV slots not holding a token (internal
    fragmentation). Runs recorded before these step fields existed show "no data"."""
    fig = Figure(figsize=(10, 6))
    work_ax, slots_ax = fig.subplots(2, 1, sharex=True)
    if not run.steps or "kv_slots_unused" not in run.steps[0]:
        _no_data(work_ax, "cache steps")
        return fig
    x = [s["step"] for s in run.steps]
    for key, label, color in (("prefix_hit_tokens", "prefix-cache hit tokens", DECODE),
                              ("recomputed_tokens", "recomputed tokens", PREFILL),
                              ("num_evictions", "evicted blocks", QUEUED)):
        work_ax.step(x, list(itertools.accumulate(s[key] for s in run.steps)), where="post", label=label,
                     color=color)
    work_ax.set_ylabel("cumulative count")
    work_ax.legend(loc="upper left", fontsize=8)
    work_ax.set_title(f"{run.label}: prefix cache and memory")
    slots_ax.step(x, [s["kv_slots_unused"] for s in run.steps], where="post", color=DECODE)
    slots_ax.set_xlabel("engine step")
    slots_ax.set_ylabel("allocated slots unused")
    return fig


def _plot_cdf(ax: Axes, values: list[float], label: str) -> None:
    values = sorted(values)
    n = len(values)
    # Start at (min, 0) so the first jump is drawn; y is the share of requests at or below x.
    ax.step([values[0]] + values, [0.0] + [(i + 1) / n for i in range(n)], where="post", label=f"{label} (n={n})")


def plot_latency_cdfs(runs: Sequence[RunData]) -> Figure:
    """CDFs of TTFT, TPOT and end-to-end latency (ms), one line per run."""
    fig = Figure(figsize=(14, 4))
    axes = fig.subplots(1, 3)
    for ax, (name, metric) in zip(axes, (("TTFT", ttfts), ("TPOT", tpots), ("E2EL", e2els))):
        drawn = False
        for run in runs:
            values = [v * 1000 for v in metric(run.requests)]
            if values:
                _plot_cdf(ax, values, run.label)
                drawn = True
        if drawn:
            ax.legend(loc="lower right", fontsize=8)
        else:
            _no_data(ax, "completed requests")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    return fig


def save_figure(fig: Figure, path: str | Path, dpi: int = 100) -> Path:
    """Write ``fig`` as a PNG through the Agg canvas."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, format="png")
    return path


def compare_runs(run_dirs: Sequence[str | Path], out_path: str | Path) -> Path:
    """Latency CDFs of several runs on one figure, written to ``out_path``."""
    runs = [load_run(d, label) for d, label in zip(run_dirs, run_labels(run_dirs))]
    return save_figure(plot_latency_cdfs(runs), out_path)


PER_RUN_PLOTS = {
    "timeline": plot_timeline,
    "kv_usage": plot_kv_usage,
    "batch": plot_batch_composition,
    "cache": plot_cache_activity,
}


def plot_run(run: RunData, out_dir: str | Path, latency_cdf: bool = True) -> dict[str, Path]:
    """The per-run figures of ``run`` (and its own latency CDFs unless ``latency_cdf`` is false) into
    ``out_dir``; returns name -> PNG path."""
    out_dir = Path(out_dir)
    written = {name: save_figure(plot(run), out_dir / f"{name}.png") for name, plot in PER_RUN_PLOTS.items()}
    if latency_cdf:
        written["latency_cdf"] = save_figure(plot_latency_cdfs([run]), out_dir / "latency_cdf.png")
    return written


def default_out_dir(run_dirs: Sequence[str | Path]) -> Path:
    """``viz/`` inside the run (one run) or inside the runs' common parent (several)."""
    return Path(os.path.commonpath([str(Path(d).resolve()) for d in run_dirs])) / "viz"
