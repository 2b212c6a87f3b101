"""One table for a whole multirun: ``summary.csv`` (every metric) and ``summary.md`` (the headline ones) in the
sweep directory, one row per job, with a column per swept setting.

``SweepSummary`` is a Hydra callback, registered in ``conf/config.yaml`` under ``hydra.callbacks``; after the
last job it reads each job's ``.hydra/overrides.yaml`` and ``metrics.json`` (or ``error.txt`` for a job that
failed). :func:`summarize_sweep` does the same for any sweep directory, e.g. one copied from another machine.
"""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from nanovllm.harness.interrupt import STOP
from nanovllm.serving.formatting import format_value
from nanovllm.serving.records import read_metrics

# The columns of summary.md, in this order, when the jobs have them (summary.csv keeps every metric).
HEADLINE_METRICS = (
    "completed", "failed", "duration", "request_throughput", "output_throughput", "request_goodput",
    "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms", "num_preemptions",
    "prefix_cache_hit_rate", "peak_kv_usage", "mfu", "mbu",
)


class SweepSummary(Callback):
    """Writes the sweep's summary table when a multirun ends; exits non-zero if a job failed. While the sweep
    runs, a signal stops it after the current job (each job's own start-up is interrupted at once)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Jobs may run in other processes (joblib, submitit, Ray): this one then only waits for them, and a
        # signal must not cut that wait short, or no summary would be written over the jobs that ran.
        STOP.serving("running the sweep")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        rows = summarize_sweep(sweep_dir)
        if not rows:
            return
        print((sweep_dir / "summary.md").read_text(encoding="utf-8"))
        failed = [row["job"] for row in rows if row.get("error")]
        if STOP.requested:  # the summary covers the jobs that ran; the interrupted one says so in its row
            print(f"error: the sweep was interrupted by {STOP.name}; see {sweep_dir / 'summary.md'}",
                  file=sys.stderr)
            sys.exit(STOP.exit_status)
        if failed:
            print(f"error: {len(failed)} of {len(rows)} jobs failed (job {', '.join(failed)}); "
                  f"see {sweep_dir / 'summary.md'}", file=sys.stderr)
            sys.exit(1)


def summarize_sweep(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Collect every job under ``sweep_dir``, write ``summary.csv`` and ``summary.md`` there, return the rows."""
    sweep_dir = Path(sweep_dir)
    jobs = sorted((p.parent.parent for p in sweep_dir.glob("**/.hydra/overrides.yaml")),
                  key=lambda d: _natural_key(d.relative_to(sweep_dir).as_posix()))
    rows = [_job_row(sweep_dir, job) for job in jobs]
    if not rows:
        return rows
    swept = _swept_keys(rows)
    metric_keys = _ordered_union(row["metrics"] for row in rows)
    flat = [{"job": row["job"], **{k: row["settings"].get(k) for k in swept}, "error": row["error"],
             "overrides": " ".join(row["overrides"]), **row["metrics"]} for row in rows]
    _write_csv(sweep_dir / "summary.csv", flat, ["job", *swept, "error", "overrides", *metric_keys])
    headline = [k for k in HEADLINE_METRICS if k in metric_keys]
    md_columns = ["job", *swept, *headline] + (["error"] if any(row["error"] for row in rows) else [])
    (sweep_dir / "summary.md").write_text(_markdown(flat, md_columns), encoding="utf-8")
    return flat


def _job_row(sweep_dir: Path, job_dir: Path) -> dict[str, Any]:
    overrides = [str(o) for o in OmegaConf.load(job_dir / ".hydra" / "overrides.yaml")]
    error_path = job_dir / "error.txt"
    metrics = read_metrics(job_dir)
    if error_path.is_file():
        error = error_path.read_text(encoding="utf-8").strip()
    else:
        error = None if metrics is not None else "no metrics.json (the job did not finish)"
    metrics = metrics or {}
    return {
        "job": job_dir.relative_to(sweep_dir).as_posix(),
        "overrides": overrides,
        "settings": dict(_split_override(o) for o in overrides),
        # Scalars only: the breakdowns have their own tables in each job's metrics.json.
        "metrics": {k: v for k, v in metrics.items() if not isinstance(v, (dict, list))},
        "error": error,
    }


def _split_override(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def _swept_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The settings that differ between jobs (all of them when there is one job): the table's key columns."""
    keys = _ordered_union(row["settings"] for row in rows)
    if len(rows) == 1:
        return keys
    return [k for k in keys if len({row["settings"].get(k) for row in rows}) > 1]


def _ordered_union(dicts: Any) -> list[str]:
    keys: dict[str, None] = {}
    for d in dicts:
        keys.update(dict.fromkeys(d))
    return list(keys)


def _natural_key(text: str) -> list[Any]:
    """Job dirs 2 before 10."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text)]


def _write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _markdown(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(format_value(row.get(c), missing="", markdown=True) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"
