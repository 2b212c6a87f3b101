"""Decode attention alone, through the cpu backend's kernel: the default model's shapes (9 query heads, 3 KV
heads, head_dim 64), bf16, a batch of sequences decoding one token each over scattered KV blocks.

Each of the 30 layers has its own part of one cache tensor, as the engine allocates it (``--hot`` shares one
layer's), so the K/V rows stream from memory as in a decode step. The figures are the median ms per step over
the rounds (this machine's runs move by 10-30%, so one step is no measurement) and the K/V bytes read per second.

    python experiments/bench_decode_attention.py [--seqs 32] [--keys 128] [--hot] [--rounds 15]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from nanovllm import kernels, machine

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--keys", type=int, default=128, help="keys per sequence (its context)")
    parser.add_argument("--hot", action="store_true", help="one cache for every layer, so it stays in cache")
    parser.add_argument("--rounds", type=int, default=15, help="timed steps")
    args = parser.parse_args()
    compiled = kernels.load()
    torch.manual_seed(0)
    blocks_per_seq = -(-args.keys // BLOCK)
    num_blocks = args.seqs * blocks_per_seq
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)  # block tables are never contiguous in a running engine
    tables = torch.tensor([order[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(args.seqs)],
                          dtype=torch.int32)

    cache = torch.randn(1 if args.hot else LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    caches = [(cache[0 if args.hot else i, 0], cache[0 if args.hot else i, 1]) for i in range(LAYERS)]
    q = torch.randn(args.seqs, HEADS, HEAD_DIM).bfloat16()
    k, v = (torch.randn(args.seqs, KV_HEADS, HEAD_DIM).bfloat16() for _ in range(2))
    last = args.keys - 1
    pos = torch.full((args.seqs,), last, dtype=torch.int32)
    seq = torch.arange(args.seqs, dtype=torch.int32)
    slots = torch.tensor([int(tables[i, last // BLOCK]) * BLOCK + last % BLOCK for i in range(args.seqs)])

    def step() -> None:
        for k_cache, v_cache in caches:
            compiled.paged_attention(q, k, v, k_cache, v_cache, slots, tables, seq, pos, HEAD_DIM ** -0.5)

    step()
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    megabytes = LAYERS * args.seqs * args.keys * KV_HEADS * HEAD_DIM * 2 * 2 / 1e6
    print(machine.header())
    print(f"decode attention, {args.seqs} sequences x {args.keys} keys, {LAYERS} layers"
          f"{' (one cache, hot)' if args.hot else ''}: {median * 1e3:.2f} ms per step (median of {args.rounds}), "
          f"{megabytes:.0f} MB of K/V, {megabytes / median / 1e3:.1f} GB/s")

if __name__ == "__main__":
    main()
