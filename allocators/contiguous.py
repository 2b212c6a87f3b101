"""Contiguous reservation, as in pre-paging servers (FasterTransformer, Orca): at admission a request
reserves one contiguous run of blocks for its whole prompt plus ``max_tokens``. Useful as the baseline that
shows what paging buys: internal (over-reservation) and external (no long-enough run) fragmentation."""

from __future__ import annotations

from nanovllm import BlockAllocator, Request, register_allocator


@register_allocator("contiguous")
class ContiguousAllocator(BlockAllocator):
    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._owner: list[str | None] = [None] * num_blocks
        self._num_free = num_blocks

    def num_free_blocks(self) -> int:
        return self._num_free

    def _reservation(self, request: Request) -> int:
        return self.blocks_for(request.num_prompt_tokens + request.max_tokens)

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        if not request.block_table:
            return self._reservation(request)
        return super().num_new_blocks(request, num_new_tokens)

    def _find_run(self, length: int) -> int | None:
        """First-fit: the start of the first run of ``length`` free blocks."""
        run = 0
        for block, owner in enumerate(self._owner):
            run = run + 1 if owner is None else 0
            if run == length:
                return block - length + 1
        return None

    def can_allocate(self, request: Request, num_new_tokens: int, reserve: int = 0) -> bool:
        needed = self.num_new_blocks(request, num_new_tokens)
        if needed == 0:
            return True
        if request.block_table or needed + reserve > self._num_free:
            return False
        return self._find_run(needed) is not None

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        needed = self.num_new_blocks(request, num_new_tokens)
        if needed == 0:
            return
        start = None if request.block_table else self._find_run(needed)
        if start is None:
            raise MemoryError(f"{request.request_id}: no contiguous run of {needed} free blocks")
        for block in range(start, start + needed):
            self._owner[block] = request.request_id
        request.block_table.extend(range(start, start + needed))
        self._num_free -= needed

    def free(self, request: Request) -> None:
        for block in request.block_table:
            self._owner[block] = None
        self._num_free += len(request.block_table)
        request.block_table.clear()
