"""What watching costs: engine throughput with the live dashboard on vs off, side by side in one process.

One engine serves the same synthetic workload (all requests at t=0, so the run is engine-bound) repeatedly,
alternating: ``off`` writes the run's files only; ``web`` also writes block snapshots every
``--snapshot-every`` steps, runs the Bokeh dashboard process on the run and keeps a headless Chromium tab
open on it (the dashboard's whole cost on this machine: its process, the browser, the websocket updates).
Prints output tokens/s of each, the median of ``--repeats`` runs, and the ratio.

    python experiments/bench_live.py [--num-requests 16] [--output-len 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from nanovllm import LLM, machine
from nanovllm.harness.live.config import LiveConfig
from nanovllm.harness.live.launch import start_live
from nanovllm.harness.serving import serve
from nanovllm.harness.workload import LengthDist, SyntheticWorkloadConfig, generate_workload
from nanovllm.serving.loggers import JsonlLogger, RunLogger


def open_browser(url: str):
    """A headless Chromium tab on ``url`` (Debian's chromium through Playwright), once the page is up."""
    from playwright.sync_api import Error, sync_playwright

    pw = sync_playwright().start()
    browser = pw.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
    page = browser.new_page(viewport={"width": 1400, "height": 1500})
    for _ in range(300):
        try:
            page.goto(url)
            page.wait_for_selector(".nv-step", timeout=60_000)
            return pw, browser
        except Error:
            time.sleep(1)
    raise RuntimeError(f"the dashboard at {url} never came up")


class Timed(RunLogger):
    """Adds up the seconds a logger's per-step and per-request hooks take: what the live view costs the engine's
    own process directly (the rest is CPU the dashboard process and the browser take from the machine)."""

    def __init__(self, inner: RunLogger) -> None:
        self.inner = inner
        self.seconds = 0.0

    def start(self, *args, **kwargs) -> None:
        self.inner.start(*args, **kwargs)

    def log_step(self, step: dict) -> None:
        start = time.perf_counter()
        self.inner.log_step(step)
        self.seconds += time.perf_counter() - start

    def log_request(self, record: dict) -> None:
        start = time.perf_counter()
        self.inner.log_request(record)
        self.seconds += time.perf_counter() - start

    def finish(self) -> None:
        self.inner.finish()


def wait_until_serving(url: str) -> None:
    for _ in range(600):
        try:
            urllib.request.urlopen(url, timeout=30).read()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the dashboard at {url} never came up")


def serve_once(engine, workload, run_dir: Path, live: str, snapshot_every: int,
               browser_tab: bool = True) -> tuple[float, float]:
    """Output tokens per second of one ``serve`` of ``workload`` with the live view ``live`` on, and the share of
    the run's wall time spent in the live loggers."""
    session = start_live(LiveConfig(mode=live, port=0, snapshot_every=snapshot_every), run_dir)
    timed = [Timed(logger) for logger in session.attach(engine, len(workload))]
    loggers = [JsonlLogger(), *timed]
    for logger in loggers:
        logger.start(run_dir, {"engine": {"max_num_seqs": engine.config.max_num_seqs}})
    browser = open_browser(session.url) if session.url and browser_tab else None
    if session.url and not browser_tab:
        wait_until_serving(session.url)  # its start-up (imports) overlaps the model's loading in a real run
    try:
        result = serve(engine, workload, progress=False, loggers=loggers)
    finally:
        for logger in loggers:
            logger.finish()
        if browser is not None:
            browser[1].close()
            browser[0].stop()
        session.close()
    return result.summary["output_throughput"], sum(t.seconds for t in timed) / result.wall_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--snapshot-every", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-browser", action="store_true", help="dashboard process only, no Chromium tab")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()

    info = machine.describe(torch.get_num_threads())
    print(machine.header(info=info), flush=True)
    engine = LLM(num_kv_blocks=256, max_num_seqs=args.max_num_seqs, max_model_len=1024).engine
    workload = generate_workload(SyntheticWorkloadConfig(
        num_requests=args.num_requests, input_len=LengthDist(kind="fixed", mean=args.input_len),
        output_len=LengthDist(kind="fixed", mean=args.output_len)), engine.tokenizer)
    tokens_per_s: dict[str, list[float]] = {"off": [], "web": []}
    logger_share: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        serve_once(engine, workload[:2], Path(tmp) / "warmup", "off", args.snapshot_every)
        for i in range(args.repeats):
            for mode in ("off", "web"):  # alternated, so drifts in machine load hit both alike
                throughput, share = serve_once(engine, workload, Path(tmp) / f"{mode}{i}", mode, args.snapshot_every,
                                             not args.no_browser)
                tokens_per_s[mode].append(throughput)
                if mode == "web":
                    logger_share.append(share)
                print(f"repeat {i} {mode}: {throughput:.1f} output tok/s; live loggers {share:.3%} of wall time",
                      flush=True)
    off, web = (statistics.median(tokens_per_s[m]) for m in ("off", "web"))
    print(f"\n| live | output tok/s (median of {args.repeats}) | ratio |\n|---|---|---|\n"
          f"| off | {off:.1f} | 1.00x |\n| web ({'dashboard process only' if args.no_browser else 'dashboard + headless Chromium tab'}) | {web:.1f} | {web / off:.3f}x |\n"
          f"\nthe engine's process spent {max(logger_share):.3%} of its wall time (worst run) in the live loggers")
    if args.json:
        Path(args.json).write_text(json.dumps({"off": tokens_per_s["off"], "web": tokens_per_s["web"],
                                               "ratio": web / off, "live_logger_share": logger_share,
                                               **vars(args), "machine": info}, indent=2))


if __name__ == "__main__":
    main()
