"""Plots and an HTML report of what happened in a run, drawn from its files (``requests.jsonl``,
``steps.jsonl``, ``metrics.json``). From a shell: ``python -m nanovllm.viz RUN_DIR [RUN_DIR ...] [--out DIR]``."""

from nanovllm.harness.viz.plots import (
    RunData,
    compare_runs,
    load_run,
    plot_batch_composition,
    plot_kv_usage,
    plot_latency_cdfs,
    plot_run,
    plot_timeline,
    save_figure,
)
from nanovllm.harness.viz.report import write_report

__all__ = [
    "RunData",
    "compare_runs",
    "load_run",
    "plot_batch_composition",
    "plot_kv_usage",
    "plot_latency_cdfs",
    "plot_run",
    "plot_timeline",
    "save_figure",
    "write_report",
]
