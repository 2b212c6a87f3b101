"""CUDA-graph decode: a decode step (every scheduled sequence computes one token) replays a graph captured
once per batch size of a ladder, instead of launching hundreds of small kernels from Python.

Contract:
- Sizes captured: 1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (and ``max_num_seqs`` itself,
  so every decode batch has a graph), at most ``MAX_CAPTURED_BATCH``; the largest is captured first so the
  smaller ones reuse its memory pool (as upstream nano-vllm does, which steps by 16).
- A decode batch of ``n`` sequences is padded to the smallest captured size ``>= n``. Padding rows decode
  token 0 at position 0 in a scratch block one past the allocator's range, so they never touch a real
  request's cache; only the first ``n`` rows of the output come back, so padding rows are never sampled.
- Prefill and mixed steps, and decode batches larger than the largest graph, run eagerly.
- The attention backend must keep every tensor its layers read at a fixed address
  (``AttentionBackend.supports_cuda_graphs``, ``prepare_cuda_graphs``, ``plan_cuda_graph``).

The graph object is behind a two-method interface (``capture(fn)``, ``replay()``) so that the bucket logic is
tested on CPU with a test double standing in for ``torch.cuda.CUDAGraph``.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn

from nanovllm.attention.base import AttentionBackend, AttentionMetadata

MAX_CAPTURED_BATCH = 512


class Graph(Protocol):
    """What ``DecodeGraphs`` needs of a CUDA graph."""

    def capture(self, fn: Callable[[], None]) -> None: ...

    def replay(self) -> None: ...

    def pool(self) -> Any: ...


class TorchCudaGraph:
    """``torch.cuda.CUDAGraph`` behind the ``Graph`` interface; graphs share the memory pool they are given."""

    def __init__(self, pool: Any = None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self._pool = pool

    def capture(self, fn: Callable[[], None]) -> None:
        with torch.cuda.graph(self.graph, pool=self._pool):
            fn()

    def replay(self) -> None:
        self.graph.replay()

    def pool(self) -> Any:
        return self.graph.pool()


@dataclass
class GraphSettings:
    """What the model runner needs to capture decode graphs."""

    max_num_seqs: int
    max_model_len: int
    graph_factory: Callable[[Any], Graph] = TorchCudaGraph  # called with the pool to share (None at first)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, 16, 24, ... up to and including ``max_num_seqs``."""
    top = min(max_num_seqs, MAX_CAPTURED_BATCH)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows, or None when the batch is too large."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def pad_decode_metadata(meta: AttentionMetadata, batch_size: int, scratch_block: int) -> AttentionMetadata:
    """``meta`` with rows appended up to ``batch_size``: each pads with one token at position 0 of
    ``scratch_block`` (its K/V written there, attending to itself)."""
    pad = batch_size - meta.num_seqs
    scratch_slot = scratch_block * meta.block_size
    return AttentionMetadata(
        query_lens=meta.query_lens + [1] * pad,
        seq_lens=meta.seq_lens + [1] * pad,
        block_tables=meta.block_tables + [[scratch_block]] * pad,
        slot_mapping=torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((pad,), scratch_slot)]),
        block_size=meta.block_size,
    )


class DecodeGraphs:
    """Decode graphs of one model and backend over one KV cache, captured at construction."""

    def __init__(
        self, model: nn.Module, backend: AttentionBackend, settings: GraphSettings, scratch_block: int,
        block_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.model, self.backend = model, backend
        self.sizes = capture_sizes(settings.max_num_seqs)
        self.scratch_block = scratch_block
        self.replays = {size: 0 for size in self.sizes}
        with torch.inference_mode():  # the buffers and the captured work are the runner's (inference) tensors
            self._capture(settings, block_size, hidden_size, dtype, device)

    def _capture(self, settings: GraphSettings, block_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        backend, scratch_block = self.backend, self.scratch_block
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.hidden = torch.zeros(top, hidden_size, dtype=dtype, device=device)
        max_num_pages = top * -(-settings.max_model_len // block_size)
        backend.prepare_cuda_graphs(self.sizes, max_num_pages)
        nothing = AttentionMetadata([], [], [], torch.zeros(0, dtype=torch.long, device=device), block_size)
        self.graphs: dict[int, Graph] = {}
        pool = None
        for size in reversed(self.sizes):
            backend.plan_cuda_graph(pad_decode_metadata(nothing, size, scratch_block), size)
            # One eager run first: lazy initialisation (cuBLAS handles, JIT-compiled kernels) cannot be captured.
            self._forward(size)
            graph = settings.graph_factory(pool)
            graph.capture(functools.partial(self._forward, size))
            pool = pool if pool is not None else graph.pool()
            self.graphs[size] = graph
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _forward(self, size: int) -> None:
        self.hidden[:size] = self.model(self.input_ids[:size], self.positions[:size], self.backend)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """A decode-only step no larger than the largest graph."""
        return 0 < meta.num_seqs <= self.sizes[-1] and all(q == 1 for q in meta.query_lens)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the ``meta.num_seqs`` real rows (a view into the graph's output buffer, valid until
        the next replay)."""
        n = meta.num_seqs
        size = padded_size(n, self.sizes)
        assert size is not None, "run() takes only a batch that can_run() accepted"
        self.input_ids[:n] = input_ids
        self.input_ids[n:size] = 0
        self.positions[:n] = positions
        self.positions[n:size] = 0
        self.backend.plan_cuda_graph(pad_decode_metadata(meta, size, self.scratch_block), size)
        self.graphs[size].replay()
        self.replays[size] += 1
        return self.hidden[:n]
