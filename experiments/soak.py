"""The long soak: a hundred thousand requests through the simulator (or a few thousand through the real engine)
with random sampling parameters, priorities and aborts, some refused prompts, and a KV cache small enough
that requests are preempted all the time, with the process's resident memory sampled as it goes.

    python experiments/soak.py                                  # 100,000 requests, simulated (runner=sim)
    python experiments/soak.py --real --requests 3000           # the real engine (SmolLM2-135M, float32)
    python experiments/soak.py --requests 20000 --sample-every 1000 --out experiments/results/soak.md

What must hold, checked at the end (exit status 1 if not): every request ended exactly once, finished
(``stop``/``length``), aborted (``abort``, with the reason given) or failed (with an error); every KV block is
free again and nothing is queued; and resident memory is flat after warm-up (grows by at most
``--max-growth-mib`` from the first sample after ``--warmup`` requests to the last). The table printed (and
written with ``--out``) shows RSS, Python's tracked objects and the largest engine container over time.

The soak keeps no per-request history of its own (only counts and the requests in flight), so the memory it
measures is the engine's. Requests arrive a few per step (0-8), as at an online server, except while
``--max-waiting`` of them already wait: the tiny cache serves far fewer per step, and an ever longer queue would
measure the queue rather than the engine.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from nanovllm import LLM, RequestStatus, SamplingParams
from nanovllm.config import EngineConfig
from nanovllm.engine.engine import LLMEngine
from nanovllm.harness.sim import Simulation

MiB = 2**20


@dataclass
class Sample:
    """One row of the table: where the soak was and what the process held then."""

    submitted: int
    ended: int
    steps: int
    in_flight: int
    rss_mib: float
    gc_objects: int
    largest_container: str
    wall_s: float


@dataclass
class Outcome:
    """What the soak counted: how each request ended, and what the engine did on the way."""

    by_status: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    preemptions: int = 0
    steps: int = 0
    problems: list[str] = field(default_factory=list)


def build_engine(args: argparse.Namespace) -> LLMEngine:
    """The engine under soak: the real one (``--real``) or the simulated one on the shipped calibrated profile.
    The same scheduler, allocator and tight cache either way."""
    options = dict(num_kv_blocks=args.num_kv_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                   max_model_len=64, max_num_batched_tokens=128, seed=args.seed)
    scheduler = {"name": "priority", "preempt_for_priority": True}
    if args.real:
        return LLM(scheduler=scheduler, allocator=args.allocator, **options).engine
    return Simulation.build(EngineConfig(**options), "calibrated", scheduler=scheduler,
                            allocator=args.allocator).engine


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.0, 0.7, 1.0, 1.5]),
        top_k=rng.choice([-1, 1, 5, 50]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        max_tokens=rng.randint(1, 4),
        ignore_eos=rng.random() < 0.5,
        stop_token_ids=rng.choice([None, [rng.randrange(vocab)]]),
        seed=rng.choice([None, rng.randrange(2**31)]),
    )


def largest_container(engine: LLMEngine) -> tuple[str, int]:
    """The biggest list/dict/set/deque held by the engine, its scheduler, allocator or policy: what would grow
    with the number of requests served if the engine kept history."""
    best = ("-", 0)
    for owner_name, owner in (("engine", engine), ("scheduler", engine.scheduler),
                              ("allocator", engine.allocator), ("policy", engine.policy)):
        for name, value in vars(owner).items():
            if isinstance(value, (list, tuple, dict, set, frozenset, deque)) and len(value) > best[1]:
                best = (f"{owner_name}.{name}", len(value))
    return best


def soak(engine: LLMEngine, args: argparse.Namespace) -> tuple[Outcome, list[Sample]]:
    rng = random.Random(args.seed)
    vocab = engine.vocab_size
    process = psutil.Process()
    outcome, samples = Outcome(), []
    in_flight: dict[str, object] = {}  # added, not yet ended: the only per-request state the soak keeps
    submitted = ended = 0
    start = time.perf_counter()

    def sample() -> None:
        gc.collect()
        name, size = largest_container(engine)
        samples.append(Sample(submitted, ended, outcome.steps, len(in_flight), process.memory_info().rss / MiB,
                              len(gc.get_objects()), f"{name} ({size})", time.perf_counter() - start))

    sample()
    while submitted < args.requests or engine.has_unfinished():
        for _ in range(rng.randint(0, 8)):
            # An open queue that always outgrows the tiny cache would soak the waiting queue, not the engine.
            if submitted == args.requests or len(engine.scheduler.waiting) >= args.max_waiting:
                break
            request_id = f"r{submitted}"
            submitted += 1
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
            params = random_params(rng, vocab)
            if rng.random() < 0.02:
                prompt = prompt + [vocab + 5]  # out of the vocabulary: refused, and it must still end
            try:
                request, error = engine.make_request(prompt, params, priority=rng.randint(0, 3),
                                                     request_id=request_id), None
            except ValueError as exc:
                request, error = engine.rejected_request(prompt, params, request_id=request_id), str(exc)
            engine.add_request(request, error=error)
            in_flight[request_id] = request
            if submitted % args.sample_every == 0:
                sample()
        queued = [r.request_id for r in (*engine.scheduler.running, *engine.scheduler.waiting)]
        if queued and rng.random() < 0.15:
            if not engine.abort_request(rng.choice(queued), "soak abort"):
                outcome.problems.append("abort_request refused a queued request")
        for request in engine.step().finished:
            if in_flight.pop(request.request_id, None) is None:
                outcome.problems.append(f"{request.request_id} ended twice or was never added")
                continue
            ended += 1
            _count(outcome, request)
        outcome.steps += 1
    sample()
    if in_flight:
        outcome.problems.append(f"{len(in_flight)} requests never ended, e.g. {next(iter(in_flight))}")
    if engine.allocator.num_free_blocks() != engine.allocator.num_blocks:
        outcome.problems.append(f"block leak: {engine.allocator.num_blocks - engine.allocator.num_free_blocks()} "
                                f"of {engine.allocator.num_blocks} blocks still allocated")
    return outcome, samples


def _count(outcome: Outcome, request) -> None:
    """Count how a request ended, and note it if it ended without the reason its status calls for."""
    outcome.by_status[request.status.value] += 1
    outcome.preemptions += request.num_preemptions
    if request.status is RequestStatus.FINISHED:
        outcome.finish_reasons[request.finish_reason] += 1
        ok = request.finish_reason in ("stop", "length") and 1 <= request.num_output_tokens <= request.max_tokens
    elif request.status is RequestStatus.ABORTED:
        outcome.errors[request.error] += 1
        ok = request.finish_reason == "abort" and request.error == "soak abort"
    elif request.status is RequestStatus.FAILED:
        outcome.errors[str(request.error).split(":", 1)[0][:60]] += 1
        ok = bool(request.error)
    else:
        ok = False
    if not ok:
        outcome.problems.append(f"{request.request_id} ended {request.status.value} with finish_reason="
                                f"{request.finish_reason!r} error={request.error!r}")


def table(samples: list[Sample]) -> str:
    lines = ["| requests submitted | ended | steps | in flight | RSS (MiB) | gc objects | largest engine container "
             "| wall (s) |", "|---:|---:|---:|---:|---:|---:|---|---:|"]
    for s in samples:
        lines.append(f"| {s.submitted:,} | {s.ended:,} | {s.steps:,} | {s.in_flight} | {s.rss_mib:.1f} | "
                     f"{s.gc_objects:,} | {s.largest_container} | {s.wall_s:.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=None, help="default: 100,000 (sim), 2,000 (--real)")
    parser.add_argument("--real", action="store_true", help="the real engine instead of the simulator")
    parser.add_argument("--sample-every", type=int, default=None, help="requests between RSS samples "
                        "(default: a tenth of --requests)")
    parser.add_argument("--warmup", type=int, default=None, help="requests before the flatness check starts "
                        "(default: a tenth of --requests)")
    parser.add_argument("--max-growth-mib", type=float, default=16.0)
    parser.add_argument("--num-kv-blocks", type=int, default=12)
    parser.add_argument("--block-size", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-waiting", type=int, default=32, help="no arrivals while this many requests wait")
    parser.add_argument("--allocator", default="prefix")
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--out", type=Path, default=None, help="also write the table and accounting here (.md)")
    args = parser.parse_args()
    args.requests = args.requests or (2_000 if args.real else 100_000)
    args.sample_every = args.sample_every or max(1, args.requests // 10)
    args.warmup = args.warmup if args.warmup is not None else args.requests // 10

    engine = build_engine(args)
    outcome, samples = soak(engine, args)

    after_warmup = [s for s in samples if s.submitted >= args.warmup]
    growth = after_warmup[-1].rss_mib - after_warmup[0].rss_mib
    if growth > args.max_growth_mib:
        outcome.problems.append(f"RSS grew {growth:.1f} MiB after warm-up (limit {args.max_growth_mib} MiB)")
    kind = "real engine" if args.real else "simulator (calibrated step times)"
    report = "\n".join([
        f"Soak: {args.requests:,} requests through the {kind}, priority policy with preemption, "
        f"{args.allocator} allocator, {args.num_kv_blocks} KV blocks of {args.block_size} tokens, "
        f"max_num_seqs={args.max_num_seqs}, at most {args.max_waiting} waiting, seed {args.seed}.",
        "",
        table(samples),
        "",
        f"Ended: {dict(outcome.by_status)}; finish reasons {dict(outcome.finish_reasons)}; "
        f"errors {dict(outcome.errors)}.",
        f"Steps: {outcome.steps:,}; preemptions: {outcome.preemptions:,}; blocks free at the end: "
        f"{engine.allocator.num_free_blocks()} of {engine.allocator.num_blocks}.",
        f"RSS after warm-up ({after_warmup[0].submitted:,} requests): {after_warmup[0].rss_mib:.1f} MiB -> "
        f"{after_warmup[-1].rss_mib:.1f} MiB at the end ({growth:+.1f} MiB).",
        "Problems: " + ("; ".join(outcome.problems[:10]) if outcome.problems else "none"),
    ])
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n", encoding="utf-8")
    return 1 if outcome.problems else 0


if __name__ == "__main__":
    sys.exit(main())
