"""TEST HELPER: batches of one engine step as the scheduler makes them (prefill chunks on cached prefixes,
decodes, preempted requests recomputed from scratch in new blocks), without a model, for checking attention
backends against each other (tests/kernels/test_flashinfer_plan.py on CPU, tests/kernels/test_gpu.py on CUDA)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from nanovllm.attention.base import AttentionMetadata


def step_meta(query_lens, seq_lens, tables, block_size) -> AttentionMetadata:
    """Metadata of sequences computing query_lens[i] tokens up to seq_lens[i] through tables[i]."""
    slots = [table[p // block_size] * block_size + p % block_size
             for q, s, table in zip(query_lens, seq_lens, tables) for p in range(s - q, s)]
    return AttentionMetadata(query_lens=list(query_lens), seq_lens=list(seq_lens), block_tables=tables,
                             slot_mapping=torch.tensor(slots, dtype=torch.long), block_size=block_size)


@dataclass
class _Req:
    num_tokens: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    preempted: bool = False


class RandomBatches:
    """Requests moving through chunked prefill, decode and preemption (blocks freed, recomputed from scratch
    in new blocks), over a free list in random order so that block tables are never contiguous."""

    def __init__(self, rng: random.Random, block_size: int, num_blocks: int) -> None:
        self.rng, self.block_size = rng, block_size
        self.free = list(range(num_blocks))
        rng.shuffle(self.free)
        self.requests: list[_Req] = []
        self.seen = {"decode_only": 0, "chunk_on_cache": 0, "resumed": 0, "mixed": 0}

    def next_step(self) -> tuple[AttentionMetadata, list[_Req]]:
        rng = self.rng
        if not self.requests or (len(self.requests) < 6 and rng.random() < 0.5):
            self.requests.append(_Req(num_tokens=rng.randint(1, 90)))
        started = [r for r in self.requests if r.num_computed > 0]
        if started and rng.random() < 0.1:
            victim = rng.choice(started)
            self.free.extend(victim.blocks)
            rng.shuffle(self.free)
            victim.blocks, victim.num_computed, victim.preempted = [], 0, True
        batch = [r for r in self.requests if rng.random() < 0.8] or self.requests[:1]
        query_lens, seq_lens = [], []
        for r in batch:
            if r.num_computed < r.num_tokens:
                num_new = rng.randint(1, r.num_tokens - r.num_computed)
                if r.num_computed > 0 and num_new > 1:
                    self.seen["chunk_on_cache"] += 1
                if r.preempted and r.num_computed == 0:
                    self.seen["resumed"] += 1
            else:
                r.num_tokens += 1  # the token sampled last step
                num_new = 1
            end = r.num_computed + num_new
            while len(r.blocks) * self.block_size < end:
                r.blocks.append(self.free.pop())
            query_lens.append(num_new)
            seq_lens.append(end)
        self.seen["decode_only" if all(q == 1 for q in query_lens) else "mixed"] += 1
        meta = step_meta(query_lens, seq_lens, [list(r.blocks) for r in batch], self.block_size)
        for r, q in zip(batch, query_lens):
            r.num_computed += q
        for r in [r for r in self.requests if r.num_tokens >= 120]:
            self.free.extend(r.blocks)
            self.requests = [x for x in self.requests if x is not r]
        return meta, batch
