"""The copy of a KV-tier load into the paged pool (``ModelRunner.write_kv``), its paths side by side: numpy per run
of consecutive pool blocks (``copy_runs_numpy``) and the C++ kernel in one call (``copy_runs_kernel``,
``csrc/kv_copy.cpp``), in each kernel build this CPU runs. Issue 57's target: a load at least half the machine's
memory copy bandwidth.

The pool and the host tier's slabs have the default model's geometry (SmolLM2-135M, float32: 30 layers, blocks of
16 tokens x 3 KV heads x 64, 12 KB per (layer, K/V) slab of a block) and ``experiments/bench_kv_tiers.py``'s sizes
(a pool of 64 blocks, 64 MiB slab chunks). Each load reads a run of consecutive slots of one chunk into pool
blocks that come in ascending, descending and scattered runs, as a pool's free list hands them out. Before every
copy a buffer (``--flush-mib``, 1 GiB) is read, so that it finds the tier and the pool mostly out of the caches,
as a real engine's loads do, with forward passes reading the model's weights in between. Every path copies every load, in a shuffled order per load (a path that ran just before
would leave the load's source in the caches for the next); each reports bytes loaded over the time of its copies,
and that over the memory copy bandwidth measured in the same process (``copy_bandwidth_gbs``, halved: it counts
read and write).

    taskset -c 0 python experiments/bench_kv_copy.py
    taskset -c 0 python experiments/bench_kv_copy.py --loads 400 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from nanovllm import kernels, machine
from nanovllm.engine.model_runner import copy_runs_kernel, copy_runs_numpy, kernel_copy_fits

CHUNK_BYTES = 64 << 20


def pool_block_ids(rng: random.Random, pool_blocks: int, n: int) -> list[int]:
    """``n`` distinct pool blocks in runs of 1-8: ascending, descending or one alone."""
    free = list(range(pool_blocks))
    rng.shuffle(free)
    ids: list[int] = []
    while len(ids) < n:
        start = free.pop()
        length = min(rng.randint(1, 8), n - len(ids))
        run = [b for b in range(start, start + length) if b < pool_blocks and b not in ids]
        run = run or [start]
        ids.extend(reversed(run) if rng.random() < 0.5 else run)
    return ids[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", type=int, default=100)
    parser.add_argument("--pool-blocks", type=int, default=64)
    parser.add_argument("--tier-blocks", type=int, default=256)
    parser.add_argument("--max-run", type=int, default=24, help="the most blocks one load reads")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "uint8"])
    parser.add_argument("--flush-mib", type=int, default=1024, help="read before each load (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    block = (16, 3, 64) if dtype != torch.uint8 else (16, 3, 68)   # an 8-bit cache's rows carry their scales
    layers = 30
    slot_bytes = layers * 2 * int(np.prod(block)) * torch.tensor([], dtype=dtype).element_size()
    chunk_slots = CHUNK_BYTES // slot_bytes
    chunks = [torch.zeros(layers, 2, chunk_slots, *block, dtype=dtype)
              for _ in range(-(-args.tier_blocks // chunk_slots))]
    for chunk in chunks:
        chunk.view(torch.uint8).random_()
    pool = torch.zeros(layers, 2, args.pool_blocks, *block, dtype=dtype)
    flush = np.ones(args.flush_mib << 20, dtype=np.uint8)

    paths: dict[str, object] = {"numpy": None}
    for level in machine.supported_isas():
        build = kernels.kernel_build(level)
        if f"kernel {build}" not in paths:
            paths[f"kernel {build}"] = kernels.load(level)
    rng = random.Random(args.seed)
    loads = []
    for _ in range(args.loads):
        n = rng.randint(1, args.max_run)
        chunk = rng.randrange(len(chunks))
        first = rng.randrange(chunk_slots - n + 1)
        loads.append((chunk, first, pool_block_ids(rng, args.pool_blocks, n)))

    seconds = {name: 0.0 for name in paths}
    total = 0
    for chunk, first, ids in loads:
        src = chunks[chunk][:, :, first:first + len(ids)]
        total += src.numel() * src.element_size()
        order = list(paths.items())
        rng.shuffle(order)
        for name, compiled in order:
            if args.flush_mib:
                flush.view(np.int64).sum()
            start = time.perf_counter()
            if compiled is None:
                copy_runs_numpy(pool, src, ids)
            else:
                assert kernel_copy_fits(pool, src)
                copy_runs_kernel(compiled, pool, src, ids)   # type: ignore[arg-type]
            seconds[name] += time.perf_counter() - start
    copy = machine.copy_bandwidth_gbs() / 2
    print(f"{machine.cpu_model()} | {args.loads} loads of 1-{args.max_run} blocks ({slot_bytes / 1e6:.2f} MB each), "
          f"{args.dtype}, pool {args.pool_blocks} blocks, flush {args.flush_mib} MiB")
    print(f"memory copy (256 MiB arrays): {copy:.2f} GB/s")
    print("| path | load GB/s | load / copy |")
    print("|---|---|---|")
    for name, s in seconds.items():
        print(f"| {name} | {total / s / 1e9:.2f} | {total / s / 1e9 / copy:.2f} |")


if __name__ == "__main__":
    main()
