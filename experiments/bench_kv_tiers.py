"""The KV tiers benchmark of issue 57 (docs/kv_tiers.md): a real engine on the default model, in one process,
serving a multi-turn workload with long shared contexts whose working set is about four primary pools, without
tiers and with a host tier (``kv_offload=host``, large enough for the whole working set), side by side in
interleaved rounds (none, host, none, host, ...; a fresh engine each run, the same workload every run).

Reports per round the p50 TTFT of each and their ratio (the issue's target: host at most half of none), and the
host tier's load bandwidth (``kv_tiers.host.bytes_loaded / load_seconds`` from the run's summary, what
``metrics.json`` holds: reading the blocks out of the tier and copying them into the pool) against this
machine's memory copy bandwidth measured in the same process: bytes copied per second between two 256 MiB
arrays (``nanovllm.machine.copy_bandwidth_gbs``, the figure profiles record, which counts read and write, halved
here because a loaded byte is also read once and written once), the issue's target being at least half; and,
for context, a copy of one block's bytes repeated in place, which stays in the CPU's caches and so runs faster
than any load of blocks spread over the tier and the pool can.

``--numpy-copy`` adds a third run per round, the host tier again with the pool's writes copied by the numpy path
instead of the C++ kernel (``ModelRunner.write_kv``'s fallback; ``experiments/bench_kv_copy.py`` compares the two
alone), so both load bandwidths come from the same rounds.

Pin it to one core (``taskset -c N``, any core: ideally one nothing else runs on, since loads share the memory
and last-level cache with every core):

    taskset -c 0 python experiments/bench_kv_tiers.py               # 2 rounds (~4 minutes on one core)
    taskset -c 0 python experiments/bench_kv_tiers.py --rounds 1 --working-set 4096 --rate 0.3 --numpy-copy
    taskset -c 0 python experiments/bench_kv_tiers.py --rounds 3 --working-set 12288
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from typing import Any

import torch

from nanovllm import machine
from nanovllm.config import EngineConfig
from nanovllm.engine import model_runner
from nanovllm.engine.engine import LLMEngine
from nanovllm.harness.serving import ServedEngine, WallClock
from nanovllm.serving.monitor import ModelCost
from nanovllm.harness.workload.config import LengthDist, MultiTurnWorkloadConfig
from nanovllm.harness.workload.generate import generate_workload

BLOCK = 16


def workload_config(working_set: int, rate: float, seed: int) -> MultiTurnWorkloadConfig:
    """Sessions of about 1,000 tokens: a 384-token system prompt (one of 2), 5 turns of ~96-token user messages
    and 16-token replies."""
    return MultiTurnWorkloadConfig(turns=LengthDist(kind="fixed", mean=5, max=64),
                                   user_len=LengthDist(kind="uniform", mean=96),
                                   reply_len=LengthDist(kind="fixed", mean=16), num_system_prompts=2,
                                   system_len=384, think_time_s=0.5, request_rate=rate,
                                   working_set_tokens=working_set, seed=seed)


def run(kv_offload: Any, pool_blocks: int, workload_cfg: MultiTurnWorkloadConfig) -> dict[str, Any]:
    config = EngineConfig(num_kv_blocks=pool_blocks, max_model_len=4096, max_num_seqs=8, warmup=True,
                          kv_offload=kv_offload)
    engine = LLMEngine(config, allocator="prefix")
    served = ServedEngine(engine, WallClock(), ModelCost.from_model(engine.runner.model, config.kv_cache_dtype))
    workload = generate_workload(workload_cfg, engine.tokenizer)
    result = served.serve(workload, progress=False)
    engine.close()
    return {"summary": result.summary, "block_bytes": engine.kv_block_bytes, "requests": len(workload)}


@contextlib.contextmanager
def numpy_copy(on: bool):
    """With ``on``, the pool's writes take ``write_kv``'s numpy path, as where the C++ kernels are not built."""
    saved = model_runner._copy_kernels
    if on:
        model_runner._copy_kernels = lambda: None   # type: ignore[assignment]
    try:
        yield
    finally:
        model_runner._copy_kernels = saved   # type: ignore[assignment]


def cached_copy_bandwidth(block_bytes: int, blocks: int, repeats: int = 20) -> float:
    """Bytes/s of a torch copy of ``blocks`` blocks' worth of float32, the same source to the same destination
    ``repeats`` times (so both stay in the caches; the median)."""
    n = block_bytes * blocks // 4
    src, dst = torch.randn(n), torch.empty(n)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return n * 4 / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--working-set", type=int, default=8192, help="tokens (workload.working_set_tokens)")
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s")
    parser.add_argument("--numpy-copy", action="store_true",
                        help="also run the host tier with the pool's writes on the numpy path, each round")
    args = parser.parse_args()
    logging.getLogger("nanovllm").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    pool = args.working_set // BLOCK // 4   # the primary pool: about a quarter of the working set
    cfg = workload_config(args.working_set, args.rate, seed=0)
    host = {"name": "host", "capacity": 1 << 40, "policy": "evict"}
    print(f"working set {args.working_set} tokens, primary pool {pool} blocks of {BLOCK} ({pool * BLOCK} tokens), "
          f"{args.rate} req/s, torch threads {torch.get_num_threads()}")
    print("| round | tiers | requests | p50 TTFT ms | p99 TTFT ms | hit pool | hit host | host GB loaded | "
          "host load GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios: list[float] = []
    loads: dict[str, list[float]] = {"host": [], "host numpy-copy": []}
    block_bytes = 0
    runs = [("none", None), ("host", host)] + ([("host numpy-copy", host)] if args.numpy_copy else [])
    for round_ in range(args.rounds):
        p50 = {}
        for name, spec in runs:
            with numpy_copy(name == "host numpy-copy"):
                out = run(spec, pool, cfg)
            s, block_bytes = out["summary"], out["block_bytes"]
            tier = (s.get("kv_tiers") or {}).get("host")
            p50[name] = s["median_ttft_ms"]
            hits = s["prefix_cache_hit_rate"]   # tier hits count as hits: the pool's is what is left
            cells = ["-"] * 3
            if tier is not None:
                bandwidth = tier["bytes_loaded"] / tier["load_seconds"] if tier["load_seconds"] else None
                if bandwidth is not None:
                    loads[name].append(bandwidth)
                hits -= tier["hit_rate"]
                cells = [f"{tier['hit_rate']:.1%}", f"{tier['bytes_loaded'] / 1e9:.2f}",
                         f"{bandwidth / 1e9:.2f}" if bandwidth else "-"]
            print(f"| {round_} | {name} | {out['requests']} | {s['median_ttft_ms']:.0f} | {s['p99_ttft_ms']:.0f} | "
                  f"{hits:.1%} | " + " | ".join(cells) + " |", flush=True)
        ratios.append(p50["host"] / p50["none"])
    copy_cached = cached_copy_bandwidth(block_bytes, 1)
    copy_memory = machine.copy_bandwidth_gbs() / 2 * 1e9   # bytes copied per second (it counts read + write)
    print(f"\np50 TTFT host / none per round: {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.2f}; target <= 0.5)")
    print(f"this machine's memory copy {copy_memory / 1e9:.2f} GB/s (256 MiB arrays); a cache-resident copy of one "
          f"block ({block_bytes / 1e6:.2f} MB) {copy_cached / 1e9:.2f} GB/s")
    for name, found in loads.items():
        if found:
            load = statistics.median(found)
            print(f"load bandwidth, {name} (median over rounds): {load / 1e9:.2f} GB/s, load / copy = "
                  f"{load / copy_memory:.2f} (target >= 0.5)")


if __name__ == "__main__":
    main()
