"""A single self-contained ``report.html`` for one or more runs: the summary table from each run's
``metrics.json`` (one column per run), its breakdowns, and every plot embedded as a base64 PNG, so the file
can be mailed or attached to a ticket without its run directories."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path
from typing import Any, Sequence

from nanovllm.serving.formatting import format_value
from nanovllm.harness.viz.plots import (
    RunData,
    compare_runs,
    load_run,
    plot_run,
    run_labels,
)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(format_value(cell, missing='–'))}</td>" for cell in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def summary_table(runs: Sequence[RunData]) -> str:
    """Summary metrics as rows, runs as columns (keys in first-seen order across runs)."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k in run.summary if k not in keys]
    rows = [[key] + [run.summary.get(key) for run in runs] for key in keys]
    return _table(["metric"] + [run.label for run in runs], rows)


def breakdown_tables(run: RunData) -> str:
    """One table per breakdown key (e.g. per client): groups as rows, metrics as columns."""
    parts = []
    for by, groups in (run.metrics.get("breakdowns") or {}).items():
        if not isinstance(groups, dict) or not groups:
            continue
        columns: list[str] = []
        for metrics in groups.values():
            columns += [c for c in metrics if c not in columns]
        rows = [[group] + [metrics.get(c) for c in columns] for group, metrics in groups.items()]
        parts.append(f"<h4>by {html.escape(str(by))}</h4>" + _table([by] + columns, rows))
    return "".join(parts)


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
img { max-width: 100%; display: block; margin: 0.5em 0 1.5em; }
"""


def _safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def write_report(run_dirs: Sequence[str | Path], out_dir: str | Path) -> Path:
    """Write every PNG and ``report.html`` into ``out_dir``; returns the report's path.

    One run: its plots sit directly in ``out_dir``. Several: each run's plots go to a subfolder named after
    it, and ``latency_cdf.png`` compares them all.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [load_run(d, label) for d, label in zip(run_dirs, run_labels(run_dirs))]
    sections = [f"<h1>nano-vllm run report</h1><h2>Summary</h2>{summary_table(runs)}"]
    if len(runs) > 1:
        comparison = compare_runs(run_dirs, out_dir / "latency_cdf.png")
        sections.append(f"<h2>Latency CDFs</h2>{_img(comparison)}")
    for run in runs:
        run_out = out_dir if len(runs) == 1 else out_dir / _safe_name(run.label)
        images = plot_run(run, run_out, latency_cdf=len(runs) == 1)  # several runs: compared above
        sections.append(
            f"<h2>{html.escape(run.label)}</h2><p><code>{html.escape(str(run.path))}</code></p>"
            + breakdown_tables(run)
            + "".join(_img(path) for path in images.values())
        )
    report = out_dir / "report.html"
    report.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>nano-vllm report</title>"
        f"<style>{_STYLE}</style></head><body>{''.join(sections)}</body></html>\n"
    )
    return report
