"""Warm-up before serving: run the model once on each representative batch shape, so the first requests of a
run do not pay for what any first call pays (oneDNN creating and JIT-compiling its matmul primitives for a new
row count, the OpenMP pool starting, the allocator growing its arenas, the kernels' first touch of the KV cache)
and every TTFT percentile of a short run measures the policy, not the warm-up. vLLM does the same with its
profile run before it serves.

The shapes: one prefill chunk of each size in a ladder up to the step's token budget (capped, see
``MAX_PREFILL_WARMUP``), one decode step of each batch size in a ladder up to ``max_num_seqs``, and both
samplers (greedy and temperature/top-k/top-p, the latter on a throwaway generator so the engine's sampling
stream is untouched). The batches go through the runner's own ``execute`` (the same preparation, attention
planning, forward and sampling as a real step) on synthetic requests whose block tables point at blocks the
allocator has not handed out: the allocator, the scheduler and the step counter never see them, and what they
write into the cache is overwritten by the first real request that gets those blocks.

What a warm-up warms is the process's (oneDNN's primitive cache, the thread pool, the allocator), so a batch
shape runs once per process for each loaded model and attention backend: a second engine over the same weights
(the loader shares them between engines) finds those shapes warm and skips them.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from nanovllm.request import Request
from nanovllm.sampling import SamplingParams

# Prefill chunks beyond this many tokens reuse the kernels the largest warmed chunk created (oneDNN blocks the
# rows of a matmul), and each costs a whole prefill of that length: no larger chunk is warmed. The prefill
# ladder grows 4x a rung (16, 64, 256): a few seconds at most on a CPU without bf16 instructions.
MAX_PREFILL_WARMUP = 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
RANDOM = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=1)


def ladder(limit: int, start: int = 1, factor: int = 2) -> list[int]:
    """``start``, ``factor`` times that, ... below ``limit``, then ``limit`` itself: the sizes a warm-up visits."""
    sizes, n = [], start
    while n < limit:
        sizes.append(n)
        n *= factor
    return sizes + [limit] if limit >= 1 else sizes


def warmup_batches(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, num_blocks: int,
                   block_size: int) -> list[list[tuple[int, int]]]:
    """The warm-up steps as lists of ``(context_tokens, new_tokens)`` per sequence: prefill chunks first, then
    decode batches (one new token on a short context each), all within ``num_blocks`` blocks."""
    longest = min(max_num_batched_tokens, max_model_len, num_blocks * block_size, MAX_PREFILL_WARMUP)
    steps = [[(0, n)] for n in ladder(longest, start=min(16, longest), factor=4)]
    context = min(max(1, block_size - 1), max_model_len - 1)  # the decode's token then ends its block
    if context >= 1:
        blocks_each = -(-(context + 1) // block_size)
        most_seqs = min(max_num_seqs, max_num_batched_tokens, num_blocks // blocks_each)
        steps += [[(context, 1)] * n for n in ladder(most_seqs)]
    return steps


def _requests(batch: list[tuple[int, int]], block_size: int, vocab_size: int, params: SamplingParams,
              generator: torch.Generator) -> list[tuple[Request, int]]:
    scheduled, next_block = [], 0
    for i, (context, new) in enumerate(batch):
        total = context + new
        request = Request(request_id=f"warmup-{i}", prompt_token_ids=[(7 * i + j) % vocab_size for j in range(total)],
                          sampling_params=params, arrival_time=0.0)
        blocks = -(-total // block_size)
        request.block_table = list(range(next_block, next_block + blocks))
        request.num_computed_tokens = context
        request.generator = generator
        next_block += blocks
        scheduled.append((request, new))
    return scheduled


# Per loaded model (weakly held: a freed model takes its entry along), the warm-up shapes this process has run.
_WARMED: "weakref.WeakKeyDictionary[Any, set[tuple]]" = weakref.WeakKeyDictionary()


def warm_up(runner: Any, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, num_blocks: int,
            block_size: int, vocab_size: int) -> tuple[int, float]:
    """Run every warm-up step this process has not yet run for this model and backend through
    ``runner.execute``; returns ``(steps run, seconds)``. Called by ``LLMEngine.__init__`` once the KV cache is
    bound, before any request exists (``engine.warmup``)."""
    generator = torch.Generator(device=runner.device).manual_seed(0)
    start = time.perf_counter()
    batches = warmup_batches(max_num_seqs, max_num_batched_tokens, max_model_len, num_blocks, block_size)
    try:
        warmed = _WARMED.setdefault(getattr(runner, "model", runner), set())
    except TypeError:  # a runner that cannot be weakly referenced: warm it every time
        warmed = set()
    backend = type(runner.backend).__qualname__
    steps = 0
    for i, batch in enumerate(batches):
        # Greedy everywhere; the largest decode batch also samples, so both samplers are warm.
        params = RANDOM if i == len(batches) - 1 else GREEDY
        shape = (backend, block_size, tuple(batch), params is RANDOM)
        if shape in warmed:
            continue
        runner.execute(_requests(batch, block_size, vocab_size, params, generator))
        warmed.add(shape)
        steps += 1
    return steps, time.perf_counter() - start
