"""Hash-based automatic prefix caching (vLLM's APC): full blocks are keyed by a hash of their tokens and of
everything before them, so requests sharing a prompt prefix share its KV blocks. Freed blocks keep their
content and are evicted least-recently-used only when a fresh block is needed."""

from __future__ import annotations

from collections import OrderedDict

from nanovllm import BlockAllocator, Request, register_allocator


@register_allocator("prefix")
class PrefixCachingAllocator(BlockAllocator):
    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._ref_count = [0] * num_blocks
        self._never_used = list(range(num_blocks - 1, -1, -1))   # stack: pop() gives block 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()   # ref 0 but cached, oldest first
        self._hash_of_block: dict[int, int] = {}
        self._block_of_hash: dict[int, int] = {}
        self._published: dict[str, tuple[int, int | None]] = {}   # request_id -> (blocks hashed, last hash)

    # -- accounting -----------------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return len(self._never_used) + len(self._evictable)

    def num_cached_blocks(self) -> int:
        return len(self._evictable)

    def _take_block(self) -> int:
        if self._never_used:
            block = self._never_used.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of_hash[self._hash_of_block.pop(block)]
        self._ref_count[block] = 1
        return block

    # -- the BlockAllocator interface -----------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int) -> None:
        needed = self.num_new_blocks(request, num_new_tokens)
        if needed > self.num_free_blocks():
            raise MemoryError(f"{request.request_id}: needs {needed} blocks, {self.num_free_blocks()} free")
        request.block_table.extend(self._take_block() for _ in range(needed))

    def free(self, request: Request) -> None:
        # Tail blocks first, so the evictable order drops a prompt's tail before its (more shared) head.
        for block in reversed(request.block_table):
            self._ref_count[block] -= 1
            if self._ref_count[block] == 0:
                if block in self._hash_of_block:
                    self._evictable[block] = None
                else:
                    self._never_used.append(block)
        request.block_table.clear()
        self._published.pop(request.request_id, None)

    def match_prefix(self, request: Request) -> int:
        # Never match the last token: the step must compute at least one token to produce logits.
        max_blocks = (request.num_tokens - 1) // self.block_size
        parent: int | None = None
        matched = 0
        for i in range(max_blocks):
            key = self._block_hash(parent, request.token_ids, i)
            block = self._block_of_hash.get(key)
            if block is None:
                break
            if self._ref_count[block] == 0:
                del self._evictable[block]
            self._ref_count[block] += 1
            request.block_table.append(block)
            parent, matched = key, matched + 1
        self._published[request.request_id] = (matched, parent)
        return matched * self.block_size

    def on_tokens_computed(self, request: Request) -> None:
        done, parent = self._published.get(request.request_id, (0, None))
        full = min(request.num_computed_tokens // self.block_size, len(request.block_table))
        for i in range(done, full):
            key = self._block_hash(parent, request.token_ids, i)
            block = request.block_table[i]
            if key not in self._block_of_hash and block not in self._hash_of_block:
                self._block_of_hash[key] = block
                self._hash_of_block[block] = key
            parent = key
        self._published[request.request_id] = (max(done, full), parent)

    def _block_hash(self, parent: int | None, token_ids: list[int], index: int) -> int:
        start = index * self.block_size
        return hash((parent, tuple(token_ids[start:start + self.block_size])))
