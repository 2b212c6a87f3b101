"""The policy-library study: every registered policy on two workloads (shared prefixes; bursty with priorities
and per-request SLOs), with the hash prefix cache and the radix cache, and its results table.

    python experiments/policy_library.py        # the grid through runner=sim, then its table (~2 min, 2 cores)
    python experiments/policy_library.py --table-only outputs/policy_library_sim   # the table of a finished sweep

It runs the Hydra multirun of ``conf/experiment/policy_library.yaml`` on the simulator, as any user would::

    python -m nanovllm.run -m +experiment=policy_library runner=sim runner.step_time=token_cost

the real ``Scheduler``, policies and allocators in the real engine, served by the same loop and summarized by
the same ``metrics.summarize`` as every run, with the model replaced by the ``token_cost`` step-time model: a
step lasts 16 ms plus 1 ms per token it computes, so long prefills make long steps as on real hardware, and every
number is reproducible on any machine. The table is read from the sweep's ``summary.csv``
(``nanovllm.harness.sweep``) and goes to stdout and to ``experiments/results/policy_library.md``. The same grid on
the real engine: the command above without the two ``runner`` overrides.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from nanovllm import POLICIES
from nanovllm.harness.sweep import summarize_sweep

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results" / "policy_library.md"
SWEEP_DIR = ROOT / "outputs" / "policy_library_sim"
COMMAND = ["-m", "+experiment=policy_library", "runner=sim", "runner.step_time=token_cost"]
WORKLOADS = ("shared_prefix", "bursty_slo")
ALLOCATORS = ("prefix", "radix")


def run_sweep(sweep_dir: Path) -> None:
    """The multirun, in its own process (Hydra owns the process it runs in), into a fresh ``sweep_dir``; fails
    loudly if a job failed."""
    shutil.rmtree(sweep_dir, ignore_errors=True)
    command = [sys.executable, "-m", "nanovllm.run", *COMMAND, f"hydra.sweep.dir={sweep_dir}"]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def rows_of(sweep_dir: Path) -> list[dict[str, Any]]:
    """The sweep's jobs in the table's order: workload, allocator, then the policies' registered order."""
    order = {name: i for i, name in enumerate(POLICIES.names())}
    rows = [row for row in summarize_sweep(sweep_dir) if not row["error"]]
    return sorted(rows, key=lambda r: (WORKLOADS.index(r["workload"]), ALLOCATORS.index(r["allocator"]),
                                       order[r["scheduler"]]))


def table(rows: list[dict[str, Any]]) -> str:
    """Goodput here is ``slo_attainment``: the fraction of requests meeting their own TTFT and E2E targets."""
    header = ("| workload | allocator | policy | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | goodput "
              "| failed | hit rate | preemptions | recomputed tok | evictions |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['allocator']} | {r['scheduler']} | {r['output_throughput']:.0f} "
                     f"| {r['median_ttft_ms']:,.0f} / {r['p99_ttft_ms']:,.0f} "
                     f"| {r['median_tpot_ms']:.0f} / {r['p99_tpot_ms']:.0f} | {r['slo_attainment']:.2f} "
                     f"| {r['failed']} | {r['prefix_cache_hit_rate']:.2f} | {r['num_preemptions']} "
                     f"| {r['recomputed_tokens']} | {r['num_evictions']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table-only", type=Path, metavar="SWEEP_DIR", help="tabulate a finished sweep")
    args = parser.parse_args()
    sweep_dir = args.table_only or SWEEP_DIR
    if args.table_only is None:
        run_sweep(sweep_dir)
    text = table(rows_of(sweep_dir))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
