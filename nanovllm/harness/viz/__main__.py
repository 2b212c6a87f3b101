"""``python -m nanovllm.viz RUN_DIR [RUN_DIR ...] [--out DIR]``: PNGs and a self-contained report.html.

``python -m nanovllm.viz --live RUN_DIR [--port 5006] [--host 127.0.0.1]``: a live dashboard in the browser of a
run in progress (attached by its files, so from any process or machine) or a finished one (with a time
scrubber), or of a multirun directory (the jobs side by side)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nanovllm.harness.viz.plots import default_out_dir
from nanovllm.harness.viz.report import write_report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.viz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories (requests.jsonl, steps.jsonl, "
                        "metrics.json); several are compared on one latency figure")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: viz/ in the run, or in the runs' common parent)")
    parser.add_argument("--live", action="store_true",
                        help="serve a live browser dashboard of one run (or multirun) directory instead")
    parser.add_argument("--host", default="127.0.0.1", help="--live: address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=5006, help="--live: port (default 5006; 0 = any free one)")
    parser.add_argument("--starting", action="store_true",
                        help="--live: the run is still starting (as live=web launches it): serve before its files exist")
    parser.add_argument("--update-ms", type=int, default=500, help="--live: refresh period in ms (default 500)")
    return parser.parse_args(argv)


def _live(args: argparse.Namespace) -> None:
    # Bokeh's server only for --live: the static report does not need it.
    from nanovllm.harness.live.feed import NotARunError
    from nanovllm.harness.live.web import PortInUseError, serve_dashboard

    if len(args.run_dirs) != 1:
        sys.exit("error: --live takes one run (or multirun) directory")
    try:
        serve_dashboard(args.run_dirs[0], args.host, args.port, args.update_ms, args.starting)
    except (NotARunError, PortInUseError) as exc:
        sys.exit(f"error: {exc}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.live:
        _live(args)
        return
    report = write_report(args.run_dirs, args.out or default_out_dir(args.run_dirs))
    print(report)


if __name__ == "__main__":
    main()
