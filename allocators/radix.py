"""A radix tree of cached prefixes (SGLang's RadixAttention; Zheng et al., "SGLang: Efficient Execution of
Structured Language Model Programs", NeurIPS 2024, section 3).

The tree is keyed by tokens: each node's label is the exact token sequence it caches, and a request follows
the path whose labels equal its own tokens, so matches are checked token by token and never trust a hash.
Sharing happens at block granularity because the KV cache is paged: a block's K/V can only be shared whole,
so every edge is exactly one block (``block_size`` tokens) and a prefix that diverges inside a block is
shared up to the last full block before the divergence (SGLang does the same with ``page_size > 1``). With
one-block edges there is no path compression; matching, sharing and eviction are those of a radix tree.

Each node counts the running requests that hold it (a request holds its whole path). Nodes nobody holds stay
cached until a fresh block is needed; then an unreferenced *leaf* is evicted, chosen by ``eviction`` (``lru``,
the default, ``lfu`` or ``fifo``; see ``nanovllm.eviction``), and its parent may become the next candidate.
Evicting leaves first means a cached prefix never loses its head while its tail survives unreachable (the
hash cache can drop a head block and strand the blocks after it until they age out).

A request publishes each block it has fully computed as a child of its previous block. If an identical child
appeared meanwhile (two requests with one prompt computed side by side), the request keeps its own copy
private for the rest of its life and publishes nothing further; its copy returns to the free list on free."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm import BlockAllocator, EvictionTracker, Request, prefix_block_key, register_allocator


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    block: int
    parent: "_Node | None"
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    ref: int = 0          # running requests whose path includes this node


@register_allocator("radix")
class RadixTreeAllocator(BlockAllocator):
    def __init__(self, num_blocks: int, block_size: int, eviction: str = "lru") -> None:
        super().__init__(num_blocks, block_size)
        self.eviction = EvictionTracker(eviction)
        self._root = _Node(tokens=(), block=-1, parent=None)
        self._free = list(range(num_blocks - 1, -1, -1))   # stack: pop() gives block 0 first
        self._node_of_block: dict[int, _Node] = {}
        self._num_unreferenced = 0
        # request_id -> (deepest node of the path it holds, blocks of its table in the tree, still publishing)
        self._cursor: dict[str, tuple[_Node, int, bool]] = {}

    # -- accounting -----------------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        # Every unreferenced node is evictable: nobody holds its descendants either (a request holds its path).
        return len(self._free) + self._num_unreferenced

    def num_cached_blocks(self) -> int:
        return self._num_unreferenced

    def _take_block(self) -> int:
        if self._free:
            return self._free.pop()
        block = self.eviction.victim()
        node = self._node_of_block.pop(block)
        if self.evict_listener is not None:   # the key costs a walk to the root: only when someone listens
            self._notify_evicted(block, self._key_of(node), node.tokens, self.eviction.uses(block))
        self.eviction.forget(block)
        parent = node.parent
        assert parent is not None   # only the root has none, and the root holds no block
        del parent.children[node.tokens]
        self._num_unreferenced -= 1
        self.num_evictions += 1
        if parent is not self._root and parent.ref == 0 and not parent.children:
            self.eviction.release(parent.block, touch=False)
        return block

    # -- the BlockAllocator interface -----------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int) -> None:
        needed = self.num_new_blocks(request, num_new_tokens)
        if needed > self.num_free_blocks():
            raise MemoryError(f"{request.request_id}: needs {needed} blocks, {self.num_free_blocks()} free")
        request.block_table.extend(self._take_block() for _ in range(needed))
        self._cursor.setdefault(request.request_id, (self._root, 0, True))

    def free(self, request: Request) -> None:
        cursor = self._cursor.pop(request.request_id, (self._root, 0, True))[0]
        in_tree = self._held_path(cursor)
        for block in reversed(request.block_table):
            node = in_tree.get(block)
            if node is None:
                self._free.append(block)
                continue
            node.ref -= 1
            if node.ref == 0:
                self._num_unreferenced += 1
                if not node.children:
                    self.eviction.release(block)
        request.block_table.clear()

    def free_tail(self, request: Request, num_tokens: int) -> None:
        # Blocks past the request's tokens were taken fresh for proposals: never in the tree.
        self._free.extend(reversed(self._tail(request, num_tokens)))

    def _held_path(self, node: _Node) -> dict[int, _Node]:
        """The tree nodes a request holds: the path from the root to its cursor."""
        path: dict[int, _Node] = {}
        while node is not self._root:
            path[node.block] = node
            assert node.parent is not None   # every node but the root has a parent
            node = node.parent
        return path

    def _walk(self, request: Request) -> list[_Node]:
        """The nodes whose labels spell a prefix of ``request``'s tokens, never its last token (the step must
        compute at least one token to produce logits)."""
        nodes, node = [], self._root
        for i in range((request.num_tokens - 1) // self.block_size):
            child = node.children.get(self._chunk(request.token_ids, i))
            if child is None:
                break
            nodes.append(child)
            node = child
        return nodes

    def cached_prefix_len(self, request: Request) -> int:
        return len(self._walk(request)) * self.block_size

    def cached_block_keys(self) -> set[int]:
        keys: set[int] = set()
        stack: list[tuple[_Node, int | None]] = [(self._root, None)]
        while stack:
            node, parent = stack.pop()
            for child in node.children.values():
                key = prefix_block_key(parent, child.tokens)
                keys.add(key)
                stack.append((child, key))
        return keys

    def match_prefix(self, request: Request) -> int:
        nodes = self._walk(request)
        for node in nodes:
            if node.ref == 0:
                self._num_unreferenced -= 1
                self.eviction.pin(node.block)
            node.ref += 1
            self.eviction.hit(node.block)
            request.block_table.append(node.block)
        self._cursor[request.request_id] = (nodes[-1] if nodes else self._root, len(nodes), True)
        return len(nodes) * self.block_size

    def on_tokens_computed(self, request: Request) -> None:
        node, published, publishing = self._cursor.get(request.request_id, (self._root, 0, True))
        if not publishing:
            return
        full = min(request.num_computed_tokens // self.block_size, len(request.block_table))
        for i in range(published, full):
            tokens = self._chunk(request.token_ids, i)
            if tokens in node.children:
                # Someone cached this block first: ours stays private, and so does everything after it.
                self._cursor[request.request_id] = (node, published, False)
                return
            child = _Node(tokens=tokens, block=request.block_table[i], parent=node, ref=1)
            node.children[tokens] = child
            self._node_of_block[child.block] = child
            self.eviction.cached(child.block)
            node, published = child, i + 1
        self._cursor[request.request_id] = (node, max(published, full), True)

    def _key_of(self, node: _Node) -> int:
        """``prefix_block_key`` of ``node``'s block: the chain of its path's labels from the root."""
        path = []
        while node is not self._root:
            path.append(node.tokens)
            assert node.parent is not None   # every node but the root has a parent
            node = node.parent
        key: int | None = None
        for tokens in reversed(path):
            key = prefix_block_key(key, tokens)
        assert key is not None   # an evicted node is never the root
        return key

    def _chunk(self, token_ids: list[int], index: int) -> tuple[int, ...]:
        return tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
