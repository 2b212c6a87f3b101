"""Decode attention alone, through the cpu backend's kernel: the default model's shapes (9 query heads, 3 KV
heads, head_dim 64), bf16 (or an 8-bit cache), a batch of sequences decoding one token each over scattered KV blocks.

Each of the 30 layers has its own part of one cache tensor, as the engine allocates it (``--hot`` shares one
layer's), so the K/V rows stream from memory as in a decode step. The figures are the median ms per step over
the rounds (runs on a shared machine move, so one step is no measurement) and the K/V bytes read per second.
``--prefill`` times each sequence's ``--keys`` tokens as one prompt instead (every token a query, causally),
where a chunk's tokens share their sequence's rows. ``--kv-cache-dtype int8`` / ``fp8_e4m3`` times the 8-bit
cache kernel (``paged_attention_8bit``) on the same shapes (bytes per row: 64 codes + a 4-byte scale).

    python experiments/bench_decode_attention.py [--seqs 32] [--keys 128] [--hot] [--prefill] [--rounds 15]
        [--kv-cache-dtype auto|int8|fp8_e4m3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from nanovllm import kernels, machine
from nanovllm.attention import kv_quant

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--keys", type=int, default=128, help="keys per sequence (its context)")
    parser.add_argument("--hot", action="store_true", help="one cache for every layer, so it stays in cache")
    parser.add_argument("--prefill", action="store_true", help="each sequence's keys as one prompt, every token a query")
    parser.add_argument("--rounds", type=int, default=15, help="timed steps")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *kv_quant.FORMATS],
                        help="auto: a bf16 cache; else the 8-bit cache format")
    args = parser.parse_args()
    compiled = kernels.load()
    torch.manual_seed(0)
    blocks_per_seq = -(-args.keys // BLOCK)
    num_blocks = args.seqs * blocks_per_seq
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)  # block tables are never contiguous in a running engine
    tables = torch.tensor([order[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(args.seqs)],
                          dtype=torch.int32)

    fmt = kv_quant.kv_format(args.kv_cache_dtype)
    cache = torch.randn(1 if args.hot else LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    if fmt is not None:  # packed rows (codes, then the float32 scale), as the engine's 8-bit cache holds them
        cache = kv_quant.quantize(cache, fmt)
    attend = compiled.paged_attention if fmt is None else compiled.paged_attention_8bit
    caches = [(cache[0 if args.hot else i, 0], cache[0 if args.hot else i, 1]) for i in range(LAYERS)]
    # The query tokens: each sequence's last key (a decode step), or all its keys in order (a prompt).
    queries = range(args.keys) if args.prefill else [args.keys - 1]
    tokens = args.seqs * len(queries)
    q = torch.randn(tokens, HEADS, HEAD_DIM).bfloat16()
    k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM).bfloat16() for _ in range(2))
    pos = torch.tensor([p for _ in range(args.seqs) for p in queries], dtype=torch.int32)
    seq = torch.tensor([i for i in range(args.seqs) for _ in queries], dtype=torch.int32)
    slots = torch.tensor([int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for i in range(args.seqs) for p in queries])

    def step() -> None:
        for k_cache, v_cache in caches:
            attend(q, k, v, k_cache, v_cache, slots, tables, seq, pos, HEAD_DIM ** -0.5)

    step()
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    row_bytes = cache.shape[-1] * cache.element_size()  # one token's one KV head: 128 bytes, or 68 when 8-bit
    megabytes = LAYERS * args.seqs * args.keys * KV_HEADS * row_bytes * 2 / 1e6
    print(machine.header())
    # A prompt's tokens read their sequence's rows over and over, from cache: no bandwidth figure for it.
    bandwidth = "" if args.prefill else f", {megabytes:.0f} MB of K/V, {megabytes / median / 1e3:.1f} GB/s"
    print(f"{'prefill' if args.prefill else 'decode'} attention, {args.seqs} sequences x {args.keys} keys, {LAYERS} layers"
          f"{' (one cache, hot)' if args.hot else ''}"
          f"{'' if fmt is None else f', {fmt.name} cache'}: {median * 1e3:.2f} ms per step (median of {args.rounds})"
          f"{bandwidth}")

if __name__ == "__main__":
    main()
