"""The first study: FCFS vs priority under increasing request rate (Hydra multirun), and its results table.

    python experiments/priority_vs_rate.py            # runs the sweep, then writes the table
    python experiments/priority_vs_rate.py --table-only [--sweep-dir outputs/priority_vs_rate]

The sweep is ``python -m nanovllm.run -m +experiment=priority_vs_rate`` (conf/experiment/priority_vs_rate.yaml);
the table (throughput, p50/p99 TTFT and TPOT per policy and per priority class) goes to stdout and to
``experiments/results/priority_vs_rate.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

RESULTS = Path(__file__).parent / "results" / "priority_vs_rate.md"
MACHINE_FILE = "machine.json"  # in the sweep directory: where the sweep ran (nanovllm.machine.describe)


def run_sweep(sweep_dir: Path, extra: list[str]) -> None:
    import torch  # only for the thread count the sweep's jobs get by default

    from nanovllm import machine

    info = machine.describe(torch.get_num_threads())
    print(machine.header(info=info), flush=True)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / MACHINE_FILE).write_text(json.dumps({"machine": info}, indent=2) + "\n")
    command = [sys.executable, "-m", "nanovllm.run", "-m", "+experiment=priority_vs_rate",
               f"hydra.sweep.dir={sweep_dir}", *extra]
    print("running:", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def _fmt(value, digits=0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def table(sweep_dir: Path) -> str:
    rows = []
    for metrics_path in sorted(sweep_dir.glob("*/metrics.json")):
        job = metrics_path.parent
        cfg = OmegaConf.load(job / ".hydra" / "config.yaml")
        metrics = json.loads(metrics_path.read_text())
        by_class = metrics.get("breakdowns", {}).get("priority", {})
        rows.append((float(cfg.workload.request_rate), str(cfg.scheduler.name), metrics, by_class))
    rows.sort(key=lambda r: (r[0], r[1]))
    header = ("| rate (req/s) | policy | output tok/s | p50 TTFT ms | p99 TTFT ms | p50 TPOT ms | p99 TPOT ms "
              "| urgent p50 / p99 TTFT ms | background p50 / p99 TTFT ms | preemptions |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    machine_file = sweep_dir / MACHINE_FILE
    if machine_file.is_file():
        from nanovllm import machine

        lines[:0] = [f"Measured on: {machine.header(info=json.loads(machine_file.read_text())['machine'])}", ""]
    for rate, policy, m, by_class in rows:
        urgent, background = by_class.get("0", {}), by_class.get("1", {})
        lines.append(
            f"| {rate:g} | {policy} | {_fmt(m.get('output_throughput'), 1)} | {_fmt(m.get('median_ttft_ms'))} "
            f"| {_fmt(m.get('p99_ttft_ms'))} | {_fmt(m.get('median_tpot_ms'))} | {_fmt(m.get('p99_tpot_ms'))} "
            f"| {_fmt(urgent.get('median_ttft_ms'))} / {_fmt(urgent.get('p99_ttft_ms'))} "
            f"| {_fmt(background.get('median_ttft_ms'))} / {_fmt(background.get('p99_ttft_ms'))} "
            f"| {m.get('num_preemptions', 0)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep-dir", type=Path, default=Path("outputs/priority_vs_rate"))
    parser.add_argument("--table-only", action="store_true", help="only build the table from an existing sweep")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for the sweep")
    args = parser.parse_args()
    if not args.table_only:
        run_sweep(args.sweep_dir, args.overrides)
    text = table(args.sweep_dir)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
