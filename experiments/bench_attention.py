"""Attention alone: the torch reference backend vs the cpu kernel on one layer of a paged cache, SmolLM2's
shape (9 query heads, 3 KV heads, head_dim 64), same process. A decode step (``--seqs`` sequences, one query
each, over ``--context`` cached tokens) and a prefill chunk (``--chunk`` tokens on top of ``--context`` cached).
Reports ms per layer call (plan once per step, amortized over ``--layers``).

``--kv-cache-dtype int8`` / ``fp8_e4m3`` runs the same steps over an 8-bit cache (``kv_quant``'s rows of codes and
a scale). ``--layer-caches`` gives each of the ``--layers`` calls its own cache, so the rows stream from memory
as in a model's step instead of staying in cache across calls.

    python experiments/bench_attention.py [--seqs 64] [--context 128] [--chunk 256] [--dtype bfloat16]
                                          [--kv-cache-dtype auto] [--layer-caches]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from nanovllm import machine
from nanovllm.attention import kv_quant
from nanovllm.attention.base import ATTENTION_BACKENDS, AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def layout(query_lens: list[int], contexts: list[int], block_size: int) -> tuple[AttentionMetadata, int]:
    blocks = list(range(sum(-(-(c + q) // block_size) for c, q in zip(contexts, query_lens))))
    random.Random(0).shuffle(blocks)
    tables, slots = [], []
    for q, c in zip(query_lens, contexts):
        need = -(-(c + q) // block_size)
        table, blocks = blocks[:need], blocks[need:]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
    meta = AttentionMetadata(query_lens=query_lens, seq_lens=[c + q for c, q in zip(contexts, query_lens)],
                             block_tables=tables, slot_mapping=torch.tensor(slots), block_size=block_size)
    return meta, sum(len(t) for t in tables)


def time_backend(spec, meta: AttentionMetadata, num_blocks: int, dtype, layers: int, repeats: int,
                 kv_cache_dtype: str = "auto", layer_caches: bool = False) -> float:
    backend = ATTENTION_BACKENDS.build(spec, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    fmt = kv_quant.kv_format(kv_cache_dtype)
    caches = []
    for _ in range(layers if layer_caches else 1):
        cache = torch.randn(2, num_blocks, meta.block_size, KV_HEADS, HEAD_DIM).to(dtype)
        cache = cache if fmt is None else kv_quant.quantize(cache.float(), fmt)
        caches.append((cache[0], cache[1]))
    backend.bind_kv_caches(caches)
    tokens = sum(meta.query_lens)
    q = torch.randn(tokens, HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM).to(dtype)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM).to(dtype)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            backend.plan(meta)
            for layer in range(layers):
                backend.forward(layer if layer_caches else 0, q, k, v)
            best = min(best, (time.perf_counter() - start) / layers)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *kv_quant.FORMATS])
    parser.add_argument("--layer-caches", action="store_true", help="one cache per layer call (rows from memory)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine.header(torch.get_num_threads()), flush=True)
    dtype = getattr(torch, args.dtype)
    rng = random.Random(1)
    contexts = [max(1, int(args.context * rng.uniform(0.5, 1.5))) for _ in range(args.seqs)]
    cases = {
        f"decode: {args.seqs} seqs, ~{args.context} cached tokens each": layout([1] * args.seqs, contexts,
                                                                               args.block_size),
        f"prefill chunk: {args.chunk} tokens on {args.context} cached": layout([args.chunk], [args.context],
                                                                              args.block_size),
    }
    print(f"{args.dtype}, kv_cache_dtype {args.kv_cache_dtype}{', one cache per layer' if args.layer_caches else ''}, "
          f"{torch.get_num_threads()} threads, block size {args.block_size}; ms per layer call")
    print("| case | torch (reference) | cpu backend (default) | speed-up | cpu, long chunks on SDPA (sdpa_min_query=16) |")
    print("|---|---|---|---|---|")
    on_sdpa = {"name": "cpu", "sdpa_min_query": 16}
    for label, (meta, num_blocks) in cases.items():
        cache_args = (args.kv_cache_dtype, args.layer_caches)
        ref = time_backend("torch", meta, num_blocks, dtype, args.layers, args.repeats, *cache_args)
        fast = time_backend("cpu", meta, num_blocks, dtype, args.layers, args.repeats, *cache_args)
        on_sdpa_ms = time_backend(on_sdpa, meta, num_blocks, dtype, args.layers, args.repeats, *cache_args)
        print(f"| {label} | {ref:.3f} | {fast:.3f} | {ref / fast:.1f}x | {on_sdpa_ms:.3f} |")


if __name__ == "__main__":
    main()
