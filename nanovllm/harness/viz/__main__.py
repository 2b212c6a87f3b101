"""``python -m nanovllm.viz RUN_DIR [RUN_DIR ...] [--out DIR]``: PNGs and a self-contained report.html."""

from __future__ import annotations

import argparse
from pathlib import Path

from nanovllm.harness.viz.plots import default_out_dir
from nanovllm.harness.viz.report import write_report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.viz", description=__doc__)
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories (requests.jsonl, steps.jsonl, "
                        "metrics.json); several are compared on one latency figure")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: viz/ in the run, or in the runs' common parent)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = write_report(args.run_dirs, args.out or default_out_dir(args.run_dirs))
    print(report)


if __name__ == "__main__":
    main()
