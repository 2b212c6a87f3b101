"""Cold vs warm start of a run: the first steps' durations against the median of the same step kind later in
the same run (a run's own steady state, so machines compare as ratios).

    python experiments/warm_start.py                 # serves the default experiment twice: engine.warmup=false, then true
    python experiments/warm_start.py RUN_DIR ...     # or reads runs already made (their steps.jsonl)

A step's kind: prefill-only, decode-only or mixed. Each of the first steps is set against the median of the
``NEAREST`` later steps of its kind closest to it in tokens computed (prefill tokens + decode sequences), the
same work at the run's steady state; an exact match of batch composition is rare in a short run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

FIRST = 4
NEAREST = 5


def step_kind(step: dict) -> str:
    prefill, decode = step["num_prefill_tokens"], step["num_decode_seqs"]
    return "mixed" if prefill and decode else "prefill" if prefill else "decode"


def step_tokens(step: dict) -> int:
    return step["num_prefill_tokens"] + step["num_decode_seqs"]


def first_steps_vs_steady(run_dir: Path) -> list[dict]:
    """Per one of the first ``FIRST`` steps: its duration, the median of the ``NEAREST`` later steps of its kind
    closest in tokens computed, and the ratio of the two."""
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()]
    steps = [s for s in steps if s["num_prefill_tokens"] or s["num_decode_seqs"]]
    rows = []
    for step in steps[:FIRST]:
        later = [s for s in steps[FIRST:] if step_kind(s) == step_kind(step)]
        later.sort(key=lambda s: abs(step_tokens(s) - step_tokens(step)))
        nearest = later[:NEAREST]
        median = statistics.median(s["duration"] for s in nearest) if nearest else None
        rows.append({"step": step["step"], "kind": step_kind(step), "tokens": step_tokens(step),
                     "ms": 1e3 * step["duration"],
                     "steady_tokens": [step_tokens(s) for s in nearest],
                     "steady_ms": None if median is None else 1e3 * median,
                     "ratio": None if not median else step["duration"] / median})
    return rows


def _serve(run_dir: Path, warmup: bool, overrides: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "nanovllm.run", f"engine.warmup={str(warmup).lower()}", "progress=false",
                    f"hydra.run.dir={run_dir}", *overrides], check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="run directories (default: serve cold, then warm)")
    parser.add_argument("--override", action="append", default=[], help="a Hydra override for both runs")
    args = parser.parse_args()
    from nanovllm import machine

    print(machine.header())
    runs = args.runs
    if not runs:
        base = Path(tempfile.mkdtemp(prefix="warm_start_"))
        runs = [base / "cold", base / "warm"]
        for run_dir, warmup in zip(runs, (False, True)):
            _serve(run_dir, warmup, args.override)
    for run_dir in runs:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        print(f"\n{run_dir} (warm-up {metrics.get('warmup_steps', 0)} steps, {metrics.get('warmup_time_s', 0)} s)")
        print("| step | kind | tokens | ms | later steps of its kind nearest in tokens | their median, ms | ratio |")
        print("|---|---|---|---|---|---|---|")
        for row in first_steps_vs_steady(run_dir):
            steady = "-" if row["steady_ms"] is None else f"{row['steady_ms']:.1f}"
            ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
            nearest = ", ".join(map(str, row["steady_tokens"])) or "-"
            print(f"| {row['step']} | {row['kind']} | {row['tokens']} | {row['ms']:.1f} | {nearest} | {steady} | {ratio} |")

if __name__ == "__main__":
    main()
