"""Paged allocation (vLLM's PagedAttention): blocks on demand from one free list, no sharing."""

from __future__ import annotations

from collections import deque

from nanovllm import BlockAllocator, Request, register_allocator


@register_allocator("paged")
class PagedAllocator(BlockAllocator):
    """Each request grows block by block as its tokens are computed; freed blocks go back to the free list."""

    decode_stretches = True   # append takes a block only when one is needed; nothing else happens per token

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._free: deque[int] = deque(range(num_blocks))

    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        needed = self.num_new_blocks(request, num_new_tokens)
        if needed > len(self._free):
            raise MemoryError(f"{request.request_id}: needs {needed} blocks, {len(self._free)} free")
        request.block_table.extend(self._free.popleft() for _ in range(needed))

    def free_tail(self, request: Request, num_tokens: int) -> None:
        self._free.extend(self._tail(request, num_tokens))

    def free(self, request: Request) -> None:
        self._free.extend(request.block_table)
        request.block_table.clear()
