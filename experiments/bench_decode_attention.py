"""Decode attention alone, through the cpu backend's kernel: the default model's shapes (9 query heads, 3 KV
heads, head_dim 64), bf16, a batch of sequences decoding one token each over scattered KV blocks.

Each of the 30 layers has its own cache (``--hot`` shares one), so the K/V rows stream from memory as in a
decode step; the figure is ms per step and the K/V bytes read per second.

    python experiments/bench_decode_attention.py [--seqs 32] [--keys 128] [--hot]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from nanovllm import kernels, machine

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--keys", type=int, default=128, help="keys per sequence (its context)")
    parser.add_argument("--hot", action="store_true", help="one cache for every layer, so it stays in cache")
    args = parser.parse_args()
    compiled = kernels.load()
    torch.manual_seed(0)
    blocks_per_seq = -(-args.keys // BLOCK)
    num_blocks = args.seqs * blocks_per_seq
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)  # block tables are never contiguous in a running engine
    tables = torch.tensor([order[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(args.seqs)],
                          dtype=torch.int32)

    def cache() -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16() for _ in range(2))

    caches = [cache()] * LAYERS if args.hot else [cache() for _ in range(LAYERS)]
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
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    megabytes = LAYERS * args.seqs * args.keys * KV_HEADS * HEAD_DIM * 2 * 2 / 1e6
    print(machine.header())
    print(f"decode attention, {args.seqs} sequences x {args.keys} keys, {LAYERS} layers"
          f"{' (one cache, hot)' if args.hot else ''}: {best * 1e3:.2f} ms per step, {megabytes:.0f} MB of K/V, "
          f"{megabytes / best / 1e3:.1f} GB/s")


if __name__ == "__main__":
    main()
