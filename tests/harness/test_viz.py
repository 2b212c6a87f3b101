"""Plots and the HTML report from a hand-built run directory, through the real command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanovllm.harness.viz.plots import e2els, load_run, run_labels, tpots, ttfts

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUMMARY = {"completed": 4, "failed": 1, "request_throughput": 2.5, "mean_ttft_ms": 120.0, "p99_e2el_ms": 900.0}


def _request(i: int, arrival: float, scheduled: float | None, first: float | None, finish: float | None,
             outputs: int, preemptions: int = 0, error: str | None = None) -> dict:
    token_times = [first + k * 0.05 for k in range(outputs)] if first is not None else []
    return {"request_id": str(i), "client_id": "a" if i % 2 else "b", "priority": 0, "arrival_time": arrival,
            "first_scheduled_time": scheduled, "first_token_time": first, "finish_time": finish,
            "token_times": token_times, "num_prompt_tokens": 16, "num_cached_tokens": 0,
            "num_output_tokens": outputs, "num_preemptions": preemptions,
            "finish_reason": None if error else "length", "error": error}


REQUESTS = [
    _request(0, 0.0, 0.0, 0.1, 0.5, outputs=9),
    _request(1, 0.05, 0.1, 0.2, 0.9, outputs=8, preemptions=2),
    _request(2, 0.2, 0.3, 0.35, 0.35, outputs=1),                       # a single token: no TPOT
    _request(3, 0.3, None, None, 0.3, outputs=0, error="prompt too long"),  # rejected
    _request(4, 0.4, 0.5, 0.6, 0.8, outputs=5),
]


def _steps(n: int = 8) -> list[dict]:
    return [{"step": k, "start_time": 0.1 * k, "duration": 0.1, "num_prefill_tokens": 16 if k % 3 == 0 else 0,
             "num_decode_tokens": min(k, 3), "num_prefill_seqs": int(k % 3 == 0), "num_decode_seqs": min(k, 3),
             "num_running": min(k + 1, 3), "num_waiting": max(2 - k, 0), "num_preempted": int(k == 4),
             "kv_blocks_used": 2 + k, "kv_blocks_cached": 1, "kv_blocks_free": 14 - k, "kv_blocks_total": 16,
             "context_tokens": 20 + k, "attn_pairs": 100, "num_sampled": min(k + 1, 3),
             "prefix_hit_tokens": 8 if k % 3 == 0 else 0, "recomputed_tokens": 4 if k == 5 else 0,
             "num_evictions": int(k == 6), "kv_slots_unused": k % 4} for k in range(n)]


def write_run(run_dir: Path, summary: dict = SUMMARY) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in _steps()))
    breakdowns = {"client_id": {"a": {"completed": 2, "mean_ttft_ms": 150.0}, "b": {"completed": 2}}}
    (run_dir / "metrics.json").write_text(json.dumps({**summary, "breakdowns": breakdowns}))
    return run_dir


def run_cli(*args: str | Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "nanovllm.viz", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=True)


def _assert_png(path: Path) -> None:
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_MAGIC, path


def test_latencies_from_records() -> None:
    assert ttfts(REQUESTS) == pytest.approx([0.1, 0.15, 0.15, 0.2])  # the failed request is left out
    assert e2els(REQUESTS) == pytest.approx([0.5, 0.85, 0.15, 0.4])
    assert tpots(REQUESTS) == pytest.approx([0.4 / 8, 0.7 / 7, 0.2 / 4])  # one-token request has no TPOT


def test_run_labels_disambiguate_hydra_multirun_dirs(tmp_path: Path) -> None:
    assert run_labels([tmp_path / "fcfs", tmp_path / "sjf"]) == ["fcfs", "sjf"]
    assert run_labels([tmp_path / "a" / "0", tmp_path / "b" / "0"]) == ["a/0", "b/0"]


def test_cli_single_run_writes_pngs_and_report(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    run_cli(run_dir)  # default output: run/viz
    out = run_dir / "viz"
    for name in ("timeline", "kv_usage", "batch", "cache", "latency_cdf"):
        _assert_png(out / f"{name}.png")
    html = (out / "report.html").read_text()
    for key in SUMMARY:
        assert key in html
    assert "breakdowns" not in html and "by client_id" in html  # breakdowns as their own tables
    assert html.count("data:image/png;base64,") == 5  # self-contained: every image embedded
    assert "src=\"http" not in html and "src='http" not in html


def test_cli_compares_runs_into_out_dir(tmp_path: Path) -> None:
    fast = write_run(tmp_path / "fcfs")
    slow = write_run(tmp_path / "sjf", {**SUMMARY, "mean_ttft_ms": 80.0, "extra_metric": 1})
    out = tmp_path / "report"
    run_cli(fast, slow, "--out", out)
    _assert_png(out / "latency_cdf.png")
    for label in ("fcfs", "sjf"):
        for name in ("timeline", "kv_usage", "batch", "cache"):
            _assert_png(out / label / f"{name}.png")
    html = (out / "report.html").read_text()
    for key in [*SUMMARY, "extra_metric", "fcfs", "sjf"]:
        assert key in html
    assert html.count("data:image/png;base64,") == 1 + 2 * 4


def test_empty_run_still_plots(tmp_path: Path) -> None:
    from nanovllm.harness.viz import write_report

    run_dir = tmp_path / "empty"
    run_dir.mkdir()
    report = write_report([run_dir], tmp_path / "out")
    assert report.is_file()
    _assert_png(tmp_path / "out" / "timeline.png")
    assert load_run(run_dir).summary == {}
