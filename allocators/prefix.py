"""Hash-based automatic prefix caching (vLLM's APC): full blocks are keyed by a hash of their tokens and of
everything before them, so requests sharing a prompt prefix share its KV blocks. Freed blocks keep their
content and are evicted only when a fresh block is needed, in the order ``eviction`` says (``lru``, the
default, ``lfu`` or ``fifo``; see ``nanovllm.eviction``).

When a block becomes a hit (``publish``): ``computed`` (the default) publishes it after the step that computed
it; ``scheduled`` publishes it when that step is planned, as vLLM V1 does (``KVCacheManager.allocate_slots``
caches the blocks of the tokens it schedules), so a request admitted later in the same step shares the blocks
an earlier one is computing. That is exact: every attention backend writes all of a step's new K/V into the
cache before any attention of that layer reads it. Proposals to verify are never published (only the tokens a
request already has).

A hash hit is not trusted on the hash alone: the cached block's own tokens are compared with the request's
(Python's tuple hash can collide), and a mismatch is a miss."""

from __future__ import annotations

from nanovllm import BlockAllocator, EvictionTracker, Request, prefix_block_key, register_allocator


# When a full block becomes a prefix hit: after the step that computes it, or when that step is planned (vLLM V1).
PUBLISH_WHEN = ("computed", "scheduled")


@register_allocator("prefix")
class PrefixCachingAllocator(BlockAllocator):
    # append takes a block only when one is needed; on_tokens_computed publishes only blocks that just filled.
    decode_stretches = True

    def __init__(self, num_blocks: int, block_size: int, eviction: str = "lru", publish: str = "computed") -> None:
        super().__init__(num_blocks, block_size)
        if publish not in PUBLISH_WHEN:
            raise ValueError(f"allocator.publish must be one of {', '.join(PUBLISH_WHEN)} (when a full block "
                             f"becomes a prefix hit), got {publish!r}")
        self.publish_when_scheduled = publish == "scheduled"
        self.eviction = EvictionTracker(eviction)
        self._ref_count = [0] * num_blocks
        self._never_used = list(range(num_blocks - 1, -1, -1))   # stack: pop() gives block 0 first
        self._hash_of_block: dict[int, int] = {}
        self._tokens_of_block: dict[int, tuple[int, ...]] = {}
        self._block_of_hash: dict[int, int] = {}
        self._published: dict[str, tuple[int, int | None]] = {}   # request_id -> (blocks hashed, last hash)

    # -- accounting -----------------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return len(self._never_used) + self.eviction.num_evictable()

    def num_cached_blocks(self) -> int:
        return self.eviction.num_evictable()

    def _take_block(self) -> int:
        if self._never_used:
            block = self._never_used.pop()
        else:
            block = self.eviction.victim()
            self._notify_evicted(block, self._hash_of_block[block], self._tokens_of_block[block],
                                 self.eviction.uses(block))
            self.eviction.forget(block)
            del self._block_of_hash[self._hash_of_block.pop(block)]
            del self._tokens_of_block[block]
            self.num_evictions += 1
        self._ref_count[block] = 1
        return block

    # -- the BlockAllocator interface -----------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int) -> None:
        needed = self.num_new_blocks(request, num_new_tokens)
        if needed > self.num_free_blocks():
            raise MemoryError(f"{request.request_id}: needs {needed} blocks, {self.num_free_blocks()} free")
        request.block_table.extend(self._take_block() for _ in range(needed))

    def free(self, request: Request) -> None:
        # Tail blocks first, so LRU order drops a prompt's tail before its (more shared) head.
        for block in reversed(request.block_table):
            self._ref_count[block] -= 1
            if self._ref_count[block] == 0:
                if block in self._hash_of_block:
                    self.eviction.release(block)
                else:
                    self._never_used.append(block)
        request.block_table.clear()
        self._published.pop(request.request_id, None)

    def free_tail(self, request: Request, num_tokens: int) -> None:
        # Blocks past the request's tokens were taken fresh for proposals: never shared, never published.
        for block in reversed(self._tail(request, num_tokens)):
            self._ref_count[block] = 0
            self._never_used.append(block)

    def _cached_blocks(self, request: Request) -> tuple[list[int], int | None]:
        """The cached blocks holding a prefix of ``request`` (never its last token: the step must compute at
        least one token to produce logits), and the hash of the last one."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        parent: int | None = None
        blocks: list[int] = []
        for i in range(max_blocks):
            key = self._block_hash(parent, request.token_ids, i)
            block = self._block_of_hash.get(key)
            if block is None or self._tokens_of_block[block] != self._chunk(request.token_ids, i):
                break
            blocks.append(block)
            parent = key
        return blocks, parent

    def cached_prefix_len(self, request: Request) -> int:
        return len(self._cached_blocks(request)[0]) * self.block_size

    def match_prefix(self, request: Request) -> int:
        blocks, parent = self._cached_blocks(request)
        for block in blocks:
            if self._ref_count[block] == 0:
                self.eviction.pin(block)
            self._ref_count[block] += 1
            self.eviction.hit(block)
            request.block_table.append(block)
        self._published[request.request_id] = (len(blocks), parent)
        return len(blocks) * self.block_size

    def on_tokens_scheduled(self, request: Request, num_new_tokens: int) -> None:
        if self.publish_when_scheduled:
            self._publish(request, min(request.num_computed_tokens + num_new_tokens, request.num_tokens))

    def on_tokens_computed(self, request: Request) -> None:
        self._publish(request, request.num_computed_tokens)

    def _publish(self, request: Request, num_tokens: int) -> None:
        """Make the full blocks holding ``request``'s first ``num_tokens`` tokens prefix hits (those not yet)."""
        done, parent = self._published.get(request.request_id, (0, None))
        full = min(num_tokens // self.block_size, len(request.block_table))
        for i in range(done, full):
            key = self._block_hash(parent, request.token_ids, i)
            block = request.block_table[i]
            if key not in self._block_of_hash and block not in self._hash_of_block:
                self._block_of_hash[key] = block
                self._hash_of_block[block] = key
                self._tokens_of_block[block] = self._chunk(request.token_ids, i)
                self.eviction.cached(block)
            parent = key
        self._published[request.request_id] = (max(done, full), parent)

    def _chunk(self, token_ids: list[int], index: int) -> tuple[int, ...]:
        return tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])

    def _block_hash(self, parent: int | None, token_ids: list[int], index: int) -> int:
        return prefix_block_key(parent, self._chunk(token_ids, index))

    def cached_block_keys(self) -> set[int]:
        return set(self._block_of_hash)
