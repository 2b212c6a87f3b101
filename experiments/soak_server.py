"""The server's soak: a hundred thousand requests through the HTTP server's engine loop over the simulated engine
(``runner=sim``'s: no weights), with resident memory sampled as it goes, to show that a server that runs for days
holds bounded memory (issue 59).

    python experiments/soak_server.py                          # 100,000 requests through EngineLoop in-process
    python experiments/soak_server.py --http --requests 5000   # the same through uvicorn + httpx on 127.0.0.1
    python experiments/soak_server.py --real --minutes 30      # the default model behind python -m nanovllm.serve

``--real`` (``soak_real.py``) starts ``python -m nanovllm.serve`` on the default model on 127.0.0.1 and keeps
``--concurrency`` (50) streams open against it for ``--minutes``, some clients disconnecting mid-stream, while it
samples the server process's resident memory.

In-process (the default) it drives the very ``EngineLoop`` the HTTP routes use (``make_request``, ``submit``,
one ``asyncio.Queue`` per request, aborts as a client disconnect sends them), minus the HTTP framing, which
costs a few milliseconds per request on one core and holds nothing between requests; ``--http`` goes through
the real server for a check of that claim at a smaller count. Clients keep ``--concurrency`` requests in flight
with random token prompts and lengths; one in ``--abort-every`` is aborted after its first token.

It prints one row per ``--sample-every`` ended requests: RSS (``/proc/self/status`` VmRSS through psutil), the
request and step records the loop holds (at most ``server.records_window`` each) and the lines in the run's
files (every one). At the end it checks (exit status 1 if not): every request ended once and is in
``requests.jsonl``; ``metrics.json`` counts them all; the records held never passed the window; and RSS grew by
at most ``--max-growth-mib`` from the first sample after ``--warmup`` requests to the last.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

from nanovllm.config import EngineConfig
from nanovllm.harness.sim import Simulation
from nanovllm.sampling import SamplingParams
from nanovllm.server.app import ServerState
from nanovllm.server.config import ServerConfig
from nanovllm.server.engine_loop import EngineLoop
from nanovllm.server.http import start_in_thread
from nanovllm.server.prometheus import ServerMetrics
from nanovllm.serving.loggers import JsonlLogger

MiB = 2**20
MODEL = "sim-soak"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--window", type=int, default=ServerConfig().records_window,
                        help="server.records_window: request / step records held in memory")
    parser.add_argument("--sample-every", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=10_000, help="requests before the RSS baseline")
    parser.add_argument("--max-growth-mib", type=float, default=16.0)
    parser.add_argument("--abort-every", type=int, default=50, help="one request in N is aborted mid-stream")
    parser.add_argument("--http", action="store_true", help="through uvicorn + httpx on 127.0.0.1")
    parser.add_argument("--run-dir", type=Path, default=None, help="keep the run's files here (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--real", action="store_true",
                        help="the default model behind python -m nanovllm.serve (soak_real.py); --concurrency 50")
    parser.add_argument("--minutes", type=float, default=30.0, help="--real: minutes of load")
    parser.add_argument("--warmup-minutes", type=float, default=5.0, help="--real: minutes before the RSS baseline")
    parser.add_argument("--disconnect-fraction", type=float, default=0.2,
                        help="--real: share of requests whose client disconnects at a random chunk")
    parser.add_argument("--rss-every", type=float, default=5.0, help="--real: seconds between RSS samples")
    parser.add_argument("--max-slope-mib-per-hour", type=float, default=16.0,
                        help="--real: RSS slope after warm-up above which the soak fails")
    args = parser.parse_args(argv)
    if args.real and "--concurrency" not in (argv if argv is not None else sys.argv):
        args.concurrency = 50
    return args


def line_count(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


class Soak:
    """The clients, the counts and the samples of one soak."""

    def __init__(self, args: argparse.Namespace, state: ServerState, run_dir: Path) -> None:
        self.args, self.state, self.run_dir = args, state, run_dir
        self.rng = random.Random(args.seed)
        self.process = psutil.Process()
        self.ended = 0
        self.aborted = 0
        self.max_held = (0, 0)
        self.rows: list[tuple[int, float, int, int, int, int, float]] = []
        self.started = time.perf_counter()

    def body(self) -> tuple[list[int], int]:
        return [self.rng.randrange(1, 2000) for _ in range(self.rng.randint(1, 32))], self.rng.randint(1, 16)

    def done_one(self, aborted: bool) -> None:
        loop = self.state.running_loop()
        self.ended += 1
        self.aborted += aborted
        held = loop.num_records_held
        self.max_held = (max(self.max_held[0], held[0]), max(self.max_held[1], held[1]))
        if self.ended % self.args.sample_every == 0:
            self.sample(held)

    def sample(self, held: tuple[int, int]) -> None:
        gc.collect()
        rss = self.process.memory_info().rss / MiB
        files = (line_count(self.run_dir / "requests.jsonl"), line_count(self.run_dir / "steps.jsonl"))
        row = (self.ended, rss, *held, *files, time.perf_counter() - self.started)
        self.rows.append(row)
        print(f"{row[0]:>9,} {row[1]:>9.1f} {row[2]:>9,} {row[3]:>9,} {row[4]:>12,} {row[5]:>12,} {row[6]:>8.1f}",
              flush=True)

    # -- in-process: the engine loop the routes use --------------------------------------------------------------
    async def one_in_process(self, loop: EngineLoop, i: int) -> None:
        prompt, max_tokens = self.body()
        request = loop.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                    request_id=f"soak-{i}")
        queue: asyncio.Queue = asyncio.Queue()
        loop.submit(request, queue)
        abort = i % self.args.abort_every == 0
        while True:
            _, delta = await queue.get()
            if abort and delta.token_ids and not delta.final:
                loop.abort(request.request_id, "client disconnected")
                abort = False
            if delta.final:
                self.done_one(delta.finish_reason == "abort")
                return

    # -- over HTTP -----------------------------------------------------------------------------------------------
    async def one_http(self, client, i: int) -> None:  # type: ignore[no-untyped-def]
        prompt, max_tokens = self.body()
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                "stream": True}
        aborted = False
        async with client.stream("POST", "/v1/completions", json=body, headers={"x-request-id": f"soak-{i}"}) as r:
            async for line in r.aiter_lines():
                if i % self.args.abort_every == 0 and line.startswith("data: {"):
                    aborted = True
                    break   # closing the stream is a client disconnect: the server aborts the request
        self.done_one(aborted)

    async def drive(self) -> None:
        limit = asyncio.Semaphore(self.args.concurrency)
        if self.args.http:
            import httpx
            client = httpx.AsyncClient(base_url=self._url, timeout=120,
                                       limits=httpx.Limits(max_connections=self.args.concurrency))
            one = lambda i: self.one_http(client, i)  # noqa: E731
        else:
            self.state.start()
            loop = self.state.running_loop()
            one = lambda i: self.one_in_process(loop, i)  # noqa: E731

        async def bounded(i: int) -> None:
            try:
                await one(i)
            finally:
                limit.release()

        tasks = set()
        for i in range(self.args.requests):
            await limit.acquire()
            task = asyncio.create_task(bounded(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.gather(*list(tasks))
        if self.args.http:
            await client.aclose()
        else:
            await self.state.stop()

    _url = ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.real:
        from soak_real import soak_real   # experiments/ is on sys.path when this script runs

        return soak_real(args)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="soak_server_"))
    engine = Simulation.build(EngineConfig(num_kv_blocks=512, max_num_seqs=32, max_model_len=256, dtype="bfloat16",
                                           warmup=False, seed=args.seed),
                              {"name": "token_cost", "step_overhead": 0.001, "time_per_token": 0.0001}).engine
    files = JsonlLogger()
    files.start(run_dir, {"soak": vars(args) | {"run_dir": str(run_dir)}})
    state = ServerState(engine, ServerConfig(port=0, records_window=args.window, max_waiting=None), MODEL,
                        ServerMetrics(MODEL, "fcfs", "paged"), loggers=[files])
    soak = Soak(args, state, run_dir)
    print(f"soak: {args.requests:,} requests, {args.concurrency} in flight, server.records_window={args.window}, "
          f"{'HTTP (uvicorn + httpx, 127.0.0.1)' if args.http else 'in-process EngineLoop'}; run files in {run_dir}")
    print(f"{'ended':>9} {'RSS MiB':>9} {'held req':>9} {'held step':>9} {'file req':>12} {'file steps':>12} "
          f"{'wall s':>8}", flush=True)
    soak.sample((0, 0))
    if args.http:
        running = start_in_thread(state)
        soak._url = running.url
        try:
            asyncio.run(soak.drive())
        finally:
            running.stop()
    else:
        asyncio.run(soak.drive())
    summary = state.running_loop().write_summary()
    files.finish()

    problems = []
    num_records = line_count(run_dir / "requests.jsonl")
    if soak.ended != args.requests or num_records != args.requests:
        problems.append(f"{soak.ended} ended, {num_records} in requests.jsonl, of {args.requests}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    counted = metrics["completed"] + metrics["aborted"] + metrics["failed"]
    if counted != args.requests:
        problems.append(f"metrics.json counts {counted} requests")
    if max(soak.max_held) > args.window:
        problems.append(f"held {soak.max_held} records, over the window of {args.window}")
    after = [row for row in soak.rows if row[0] >= args.warmup]
    growth = after[-1][1] - after[0][1] if len(after) >= 2 else 0.0
    if growth > args.max_growth_mib:
        problems.append(f"RSS grew {growth:.1f} MiB after warm-up (limit {args.max_growth_mib})")
    print(f"ended {soak.ended:,} ({soak.aborted:,} aborted), {summary['num_steps']:,} steps, "
          f"{time.perf_counter() - soak.started:.0f} s; RSS after warm-up: {after[0][1] if after else 0:.1f} -> "
          f"{after[-1][1] if after else 0:.1f} MiB ({growth:+.1f}); held at most {soak.max_held[0]} request and "
          f"{soak.max_held[1]} step records; metrics.json: {metrics['completed']:,} completed, "
          f"{metrics['aborted']:,} aborted, p99 TTFT {metrics['p99_ttft_ms']:.1f} ms (simulated time)")
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    if args.run_dir is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
