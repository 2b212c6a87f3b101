"""The server's real-model soak (issue 59), ``python experiments/soak_server.py --real``: ``python -m
nanovllm.serve`` on the default model on 127.0.0.1, ``--concurrency`` streaming clients (httpx, 50 by default) for
``--minutes``, a ``--disconnect-fraction`` of the requests closed by their client at a random chunk (the server
aborts them), and the server process's resident memory sampled every ``--rss-every`` seconds.

It prints one row per minute (RSS, requests ended, disconnects, the run's record count) and at the end: RSS at
the start, after ``--warmup-minutes`` and at the end, and the least-squares slopes after warm-up of RSS and of
its anonymous part (``RssAnon``). It checks (exit status 1 if not): ``/health`` still answers 200 after the load; every request sent is in ``requests.jsonl``
exactly once; every record ended finished (``length``) or aborted with ``client disconnected``, never more
aborted than disconnected; ``metrics.json`` counts them all; the anonymous slope stays under
``--max-slope-mib-per-hour``.
The server runs in the affinity this process has (``taskset -c 1 ...`` pins both)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

MiB = 2**20
REPO = Path(__file__).resolve().parent.parent
# Short prompts (random token ids) and outputs, a cache that holds every stream at once: the soak is about what
# the server holds between requests, not about preemption.
ENGINE = ["engine.num_kv_blocks=512", "engine.max_model_len=512", "engine.max_num_seqs=64", "engine.warmup=false"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(run_dir: Path, port: int) -> subprocess.Popen:
    """``python -m nanovllm.serve`` in its own process group (so SIGINT reaches it alone), one OpenMP thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    log = open(run_dir.parent / f"{run_dir.name}.server.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "nanovllm.serve", *ENGINE, "monitor.calibrate=false", "records.steps=interval:10",
         f"server.port={port}", f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it served")
        with contextlib.suppress(httpx.HTTPError):   # not listening yet: asked again in a second
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(1)
    raise SystemExit(f"the server at {url} did not answer /health within {timeout:.0f} s")


def slope_per_hour(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) samples, in MiB per hour."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_m = sum(m for _, m in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    return 3600 * sum((t - mean_t) * (m - mean_m) for t, m in samples) / var if var else 0.0


def anonymous_rss_mib(pid: int) -> float:
    """The process's anonymous resident memory (``RssAnon``: heaps and tensors; a leak grows it), apart from
    file-backed pages (``RssFile``: the mmapped weights and libraries, which the kernel fills and reclaims)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class RealSoak:
    """The clients, counts and RSS samples of one real-model soak."""

    def __init__(self, args: argparse.Namespace, url: str, server: psutil.Process) -> None:
        self.args, self.url, self.server = args, url, server
        self.rng = random.Random(args.seed)
        self.sent = self.finished = self.disconnected = self.errors = 0
        self.transport_errors: list[str] = []
        self.samples: list[tuple[float, float]] = []   # (seconds since the start, RSS MiB)
        self.anon_samples: list[tuple[float, float]] = []   # (seconds, anonymous RSS MiB: heap, not mapped files)
        self.started = time.monotonic()
        self.stop_at = self.started + 60 * args.minutes

    async def one(self, client: httpx.AsyncClient, i: int) -> None:
        max_tokens = self.rng.randint(8, 64)
        prompt = [self.rng.randrange(100, 40_000) for _ in range(self.rng.randint(4, 48))]
        # A disconnecting client reads a random number of chunks (at least one, so the server has the request),
        # then closes the connection.
        cut = self.rng.randint(1, max_tokens - 1) if self.rng.random() < self.args.disconnect_fraction else None
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        chunks = 0
        answered = False
        try:
            async with client.stream("POST", "/v1/completions", json=body,
                                     headers={"x-request-id": f"soak-{i}"}) as r:
                answered = True
                self.sent += 1
                if r.status_code != 200:
                    self.errors += 1
                    return
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                        if cut is not None and chunks >= cut:
                            self.disconnected += 1
                            return     # leaving the block closes the stream: a client disconnect
        except httpx.TransportError as exc:
            # The connection broke (e.g. a keep-alive connection the server closed as it was reused): before
            # the response, the server may not have the request; after it, it is a disconnect to the server.
            self.transport_errors.append(f"{'after' if answered else 'before'} the response: {exc!r}")
            if answered:
                self.disconnected += 1
            return
        self.finished += 1

    async def sample_rss(self) -> None:
        minute = 0
        while True:
            now = time.monotonic() - self.started
            rss = self.server.memory_info().rss / MiB
            self.samples.append((now, rss))
            self.anon_samples.append((now, anonymous_rss_mib(self.server.pid)))
            if now >= 60 * minute:
                print(f"{now / 60:>6.1f} {rss:>9.1f} {self.sent:>9,} {self.finished:>9,} {self.disconnected:>9,} "
                      f"{self.errors:>6,}", flush=True)
                minute += 1
            await asyncio.sleep(self.args.rss_every)

    async def drive(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=300,
                                     limits=httpx.Limits(max_connections=self.args.concurrency + 4)) as client:
            self.model = (await client.get("/v1/models")).json()["data"][0]["id"]
            sampler = asyncio.create_task(self.sample_rss())
            counter = iter(range(10**9))

            async def worker() -> None:
                while time.monotonic() < self.stop_at:
                    await self.one(client, next(counter))

            await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))
            await asyncio.sleep(self.args.rss_every)   # the aborts of the last disconnects land
            sampler.cancel()
            self.samples.append((time.monotonic() - self.started, self.server.memory_info().rss / MiB))
            self.anon_samples.append((self.samples[-1][0], anonymous_rss_mib(self.server.pid)))

    model = ""
    health = 0


def soak_real(args: argparse.Namespace) -> int:
    """Run the real-model soak; 0 when every check held."""
    base = Path(tempfile.mkdtemp(prefix="soak_real_", dir="/tmp"))
    run_dir, port = base / "run", free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"real soak: the default model behind python -m nanovllm.serve at {url}, {args.concurrency} streams, "
          f"{args.minutes:g} min, {args.disconnect_fraction:.0%} disconnecting; files in {base}", flush=True)
    proc = start_server(run_dir, port)
    problems: list[str] = []
    try:
        wait_healthy(proc, url)
        soak = RealSoak(args, url, psutil.Process(proc.pid))
        print(f"{'min':>6} {'RSS MiB':>9} {'sent':>9} {'finished':>9} {'discon.':>9} {'errors':>6}", flush=True)
        asyncio.run(soak.drive())
        health = httpx.get(f"{url}/health", timeout=10)
        soak.health = health.status_code
        if health.status_code != 200:
            problems.append(f"/health answered {health.status_code} after the load: {health.text}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            problems.append("the server did not stop within 120 s of SIGINT")

    records = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    ids = [r["request_id"] for r in records]
    aborted = [r for r in records if r["finish_reason"] == "abort"]
    unanswered = sum(e.startswith("before") for e in soak.transport_errors)   # the server may have these or not
    if not soak.sent <= len(ids) <= soak.sent + unanswered or len(set(ids)) != len(ids):
        problems.append(f"{soak.sent} requests answered (+{unanswered} with a broken connection before the "
                        f"response), {len(ids)} records ({len(set(ids))} distinct)")
    odd = [r for r in records if not (r["finish_reason"] == "length" and r["error"] is None
                                      or r["finish_reason"] == "abort" and "disconnect" in (r["error"] or ""))]
    if odd:
        problems.append(f"{len(odd)} records neither finished nor aborted by a disconnect, e.g. {odd[0]}")
    if len(aborted) > soak.disconnected + unanswered:
        problems.append(f"{len(aborted)} aborted records, {soak.disconnected} disconnects")
    if soak.errors:
        problems.append(f"{soak.errors} requests answered with an error status")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    counted = metrics["completed"] + metrics["aborted"] + metrics["failed"]
    if counted != soak.sent:
        problems.append(f"metrics.json counts {counted} requests of {soak.sent}")

    warm = [(t, m) for t, m in soak.samples if t >= 60 * args.warmup_minutes]
    slope = slope_per_hour(warm)
    warm_anon = [(t, m) for t, m in soak.anon_samples if t >= 60 * args.warmup_minutes]
    anon_slope = slope_per_hour(warm_anon)
    # The check is on anonymous memory: file-backed pages (the mmapped weights) fill as they are touched and
    # are the kernel's to reclaim, so they say nothing of a leak.
    if anon_slope > args.max_slope_mib_per_hour:
        problems.append(f"anonymous RSS grew {anon_slope:.1f} MiB/hour after warm-up "
                        f"(limit {args.max_slope_mib_per_hour})")
    first, last = soak.samples[0][1], soak.samples[-1][1]
    print(f"sent {soak.sent:,}: {len(records):,} records, {len(records) - len(aborted):,} finished, {len(aborted):,} "
          f"aborted ({soak.disconnected:,} client disconnects; the rest had all their tokens generated first); "
          f"{sum(r['num_output_tokens'] for r in records):,} tokens generated; {len(soak.samples)} RSS samples")
    print(f"server RSS: start {first:.1f} MiB, after {args.warmup_minutes:g} min warm-up "
          f"{warm[0][1] if warm else float('nan'):.1f}, end {last:.1f}, min/max after warm-up "
          f"{min(m for _, m in warm) if warm else float('nan'):.1f}/{max(m for _, m in warm) if warm else float('nan'):.1f};"
          f" slope after warm-up {slope:+.2f} MiB/hour (anonymous: {warm_anon[0][1] if warm_anon else float('nan'):.1f}"
          f" -> {soak.anon_samples[-1][1]:.1f} MiB, {anon_slope:+.2f} MiB/hour); /health after the load {soak.health}; "
          f"p50 TTFT {metrics['median_ttft_ms']:.0f} ms, p99 {metrics['p99_ttft_ms']:.0f} ms (server-side)")
    (base / "rss.json").write_text(json.dumps({"rss": soak.samples, "anonymous": soak.anon_samples}))
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0
