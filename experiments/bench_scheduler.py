"""Per-step scheduler cost against the number of waiting requests, before and after the waiting queue kept its
order incrementally (nanovllm/engine/waiting_queue.py).

    python experiments/bench_scheduler.py [--old-tree DIR]      # the table -> experiments/results/bench_scheduler.md
    python experiments/bench_scheduler.py --sizes 100 1000 --policies fcfs edf --steps 30 --no-write   # a look
    python experiments/bench_scheduler.py --e2e --old-tree DIR   # the end-to-end runs below, timed (~1 h)

``DIR``: a checkout of the commit before the waiting queue (``git worktree add /tmp/before 57b164a``).

``Scheduler.schedule`` timed alone (no model, no simulator), in CPU time of its thread (so other load on a shared
machine does not count): the median over ``--steps`` steps (fewer when their
planning passes ``--budget`` seconds, never under 15) with N = 100, 1,000, 10,000 and 100,000 requests waiting,
for fcfs, priority, sjf (``max_wait=30``: aging), edf (admission control, ``step_time=0.02``), fair and lpm:

* before: ``resorted_every_step(policy)``, the scheduler's old behaviour: the whole waiting queue re-sorted and
  every waiting request asked ``reject_reason`` at every step; with ``--old-tree`` also "before, old scheduler":
  the policy on the old checkout's own scheduler (this script run there), a check that the first is honest;
* after: the policy as it declares itself (fair and lpm stay exact, "dynamic": their after is the same full
  re-sort), and for fair and lpm also with the opt-in bounded window ``waiting_window=128`` (an approximation).

Each configuration: the prefix allocator (8,192 blocks of 16 tokens), max_num_seqs=256, max_num_batched_tokens=2048,
N waiting requests (prompts 16-128 tokens, a quarter behind one of 8 shared 64-token system prompts, outputs 8-64
tokens, priorities 0-3, 16 clients, TTFT SLOs of 30, 60 or 120 s, arrivals spread over the 60 s before the start).
Each step is planned (timed), its tokens sampled and applied (untimed), and each request that left the waiting
queue (admitted or rejected) replaced by a new arrival (untimed), so N wait at every step; the clock advances
20 ms a step. The first ``--warmup`` steps (the first orders all N) are not counted.

``--e2e``: the wall and CPU time of ``python -m nanovllm.run runner=sim workload=synthetic
workload.num_requests=100000 workload.request_rate=inf engine.max_num_seqs=256 engine.num_kv_blocks=8192``
(100,000 requests arriving at once) from this checkout (after) and from ``--old-tree`` (before).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nanovllm import ALLOCATORS, POLICIES, Request, SamplingParams, machine
from nanovllm.engine.scheduler import Scheduler
from nanovllm.policy import Policy

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results" / "bench_scheduler.md"
SIZES = (100, 1_000, 10_000, 100_000)
SPECS: dict[str, dict[str, Any]] = {
    "fcfs": {}, "priority": {}, "sjf": {"max_wait": 30.0}, "edf": {"step_time": 0.02}, "fair": {}, "lpm": {},
}
WINDOW = 128            # the opt-in bounded window benched for the dynamic policies
STEP_TIME = 0.02        # seconds the clock advances per step
E2E = ["runner=sim", "workload=synthetic", "workload.num_requests=100000", "workload.request_rate=inf",
       "engine.max_num_seqs=256", "engine.num_kv_blocks=8192"]


class Arrivals:
    """The benchmark's requests, reproducible from ``seed``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.systems = [[self.rng.randrange(1000, 30000) for _ in range(64)] for _ in range(8)]
        self.count = 0

    def make(self, arrival: float) -> Request:
        rng, self.count = self.rng, self.count + 1
        tail = [rng.randrange(1000, 30000) for _ in range(rng.randint(16, 64))]
        prompt = (rng.choice(self.systems) + tail) if rng.random() < 0.25 else tail
        return Request(f"b{self.count}", prompt, SamplingParams(max_tokens=rng.randint(8, 64), ignore_eos=True),
                       arrival, priority=rng.randrange(4), client_id=f"c{rng.randrange(16)}",
                       slo_ttft=rng.choice((30.0, 60.0, 120.0)))


def variants(name: str) -> dict[str, Policy]:
    """The policies compared for ``name``: before, after and (dynamic keys) after with the bounded window."""
    from nanovllm.policy import resorted_every_step   # here: step_time also runs on checkouts from before it

    cls, options = POLICIES.get(name), SPECS[name]
    built = {"before": resorted_every_step(cls)(**options), "after": cls(**options)}
    if built["after"].waiting_key == "dynamic":
        built[f"after, window {WINDOW}"] = cls(**options, waiting_window=WINDOW)
    return built


def step_time(policy: Policy, n: int, steps: int, warmup: int, budget: float, seed: int = 0) -> float:
    """The median seconds ``Scheduler.schedule`` takes with ``n`` requests waiting at every step."""
    scheduler = Scheduler(policy, ALLOCATORS.build("prefix", 8192, 16), max_num_seqs=256,
                          max_num_batched_tokens=2048)
    arrivals, now = Arrivals(seed), 60.0
    for _ in range(n):
        scheduler.add(arrivals.make(now - arrivals.rng.uniform(0.0, 60.0)), now)
    times: list[float] = []
    for step in range(warmup + steps):
        start = time.thread_time()   # CPU time: other load on a shared core does not count
        out = scheduler.schedule(now)
        elapsed = time.thread_time() - start
        if step >= warmup:
            times.append(elapsed)
        tokens = [7 if r.num_computed_tokens + k == r.num_tokens else None for r, k in out.scheduled]
        scheduler.update_from_output(out, tokens, now, max_model_len=10**9)
        for _ in range(n - len(scheduler.waiting)):
            scheduler.add(arrivals.make(now), now)
        now += STEP_TIME
        if len(times) >= 15 and sum(times) > budget:
            break
    return statistics.median(times)


def table(results: dict[tuple[str, str, int], float], sizes: list[int]) -> str:
    """Milliseconds per step: each policy's before rows, after rows, then before / each after."""
    head = "| policy (waiting key) | path | " + " | ".join(f"{n:,} waiting" for n in sizes)
    head += f" | {sizes[-1]:,} vs {sizes[0]:,} |" if len(sizes) > 1 else " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name in SPECS:
        paths = sorted({p for (policy, p, _) in results if policy == name}, key=lambda p: (p[:5] != "befor", p))
        if not paths:
            continue
        key = POLICIES.get(name)(**SPECS[name]).waiting_key
        for i, path in enumerate(paths):
            ms = [results[(name, path, n)] * 1000 for n in sizes]
            label = f"{name} ({key})" if i == 0 else ""
            row = f"| {label} | {path} | " + " | ".join(f"{m:.3f} ms" for m in ms)
            lines.append(row + (f" | {ms[-1] / ms[0]:.1f}x |" if len(sizes) > 1 else " |"))
        for path in (p for p in paths if p.startswith("after")):
            ratios = [results[(name, "before", n)] / results[(name, path, n)] for n in sizes]
            lines.append(f"| | before / {path} | " + " | ".join(f"**{r:.1f}x**" for r in ratios)
                         + (" | |" if len(sizes) > 1 else " |"))
    return "\n".join(lines)


def on_old_scheduler(tree: Path, name: str, n: int, args: argparse.Namespace) -> float:
    """``step_time`` of the policy ``name`` as the scheduler of ``tree`` (a checkout from before the waiting
    queue) runs it: this script in a child process that imports nanovllm from ``tree``."""
    command = [sys.executable, __file__, "--measure-old", name, str(n), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--budget", str(args.budget)]
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    return float(subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout.split()[-1])


def end_to_end(tree: Path) -> tuple[float, float]:
    """Wall and CPU seconds of the end-to-end simulator command, run from the checkout ``tree``."""
    command = [sys.executable, "-m", "nanovllm.run", *E2E, "progress=false",
               f"hydra.run.dir={tempfile.mkdtemp(prefix='bench_scheduler_e2e_')}"]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, cwd=tree, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(tree.resolve())})
    wall = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)


def e2e_section(old_tree: Path | None, command: str) -> str:
    """The end-to-end runs, after (this checkout) and before (``old_tree``), as a Markdown section."""
    lines = ["## End to end", "", f"`{command}`: the wall and CPU time of", "",
             f"    python -m nanovllm.run {' '.join(E2E)}", "",
             "(100,000 requests arriving at once) from each checkout.", "",
             "| checkout | wall | CPU |", "|---|---:|---:|"]
    for label, tree in (("after (this checkout)", ROOT), (f"before ({old_tree})", old_tree)):
        if tree is not None:
            wall, cpu = end_to_end(tree)
            print(f"end to end, {label}: {wall:.0f} s wall, {cpu:.0f} s CPU", flush=True)
            lines.append(f"| {label} | {wall:,.0f} s | {cpu:,.0f} s |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--policies", nargs="+", default=list(SPECS), choices=list(SPECS))
    parser.add_argument("--steps", type=int, default=100, help="steps timed per configuration (at most)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--budget", type=float, default=20.0, help="seconds of timed planning per configuration")
    parser.add_argument("--old-tree", type=Path, help="a checkout of the commit before the waiting queue: also "
                        "time 'before' on its own scheduler, and run --e2e's 'before' from it")
    parser.add_argument("--e2e", action="store_true", help="time the end-to-end simulator runs instead (the "
                        f"section '## End to end' of {RESULTS.name} is replaced)")
    parser.add_argument("--no-write", action="store_true", help=f"print only; do not write {RESULTS.name}")
    parser.add_argument("--measure-old", nargs=2, metavar=("POLICY", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_old:   # the child of on_old_scheduler: nanovllm is the old tree's
        name, n = args.measure_old[0], int(args.measure_old[1])
        print(step_time(POLICIES.get(name)(**SPECS[name]), n, args.steps, args.warmup, args.budget))
        return

    import torch  # Request imports it anyway; the header names its thread count

    header = machine.header(torch.get_num_threads())
    print(header, flush=True)
    command = " ".join(["python experiments/bench_scheduler.py", *sys.argv[1:]])
    if args.e2e:
        section = e2e_section(args.old_tree, command)
        if not args.no_write:
            kept = RESULTS.read_text(encoding="utf-8").split("## End to end")[0] if RESULTS.exists() else ""
            RESULTS.write_text(kept.rstrip("\n") + "\n\n" + section, encoding="utf-8")
        return
    results: dict[tuple[str, str, int], float] = {}
    for name in args.policies:
        for n in args.sizes:
            runs = variants(name)
            if args.old_tree:
                results[(name, "before, old scheduler", n)] = on_old_scheduler(args.old_tree, name, n, args)
            for path, policy in runs.items():
                results[(name, path, n)] = step_time(policy, n, args.steps, args.warmup, args.budget)
            for path in runs if not args.old_tree else ["before, old scheduler", *runs]:
                print(f"{name:9s} {path:22s} {n:>7,} waiting: {results[(name, path, n)] * 1000:8.3f} ms/step",
                      flush=True)
    text = table(results, args.sizes)
    print(text)
    if not args.no_write:
        old = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else ""
        e2e = ("## End to end" + old.split("## End to end", 1)[1]) if "## End to end" in old else ""
        RESULTS.write_text(
            f"Per-step `Scheduler.schedule` time against the number of waiting requests, before and after the "
            f"incremental waiting queue: `{command}`\n\n{header}\n\nMedian CPU time of one step's planning "
            f"(the method in this script's docstring); before = `resorted_every_step(policy)` (the old path on "
            f"this checkout), before, old scheduler = the policy on the checkout before the waiting queue, after "
            f"= the policy as declared.\n\n{text}\n" + (f"\n{e2e}" if e2e else ""), encoding="utf-8")


if __name__ == "__main__":
    main()
