"""KVCacheManager: the block pool, per-request block tables and the prefix cache.

The KV cache is `num_blocks` blocks of `block_size` token slots. A request owns a block table, the
list of block ids holding its tokens in order; the model runner reads it to find each token's slot.

Prefix caching: every FULL, computed block is named by a chained hash, hash((parent hash, its token
ids)), so equal hashes mean equal whole prefixes. A new request whose leading blocks hash to cached
blocks shares them (ref count + 1) instead of recomputing them. A freed block keeps its hash and stays
in the pool as an evictable free block until a fresh allocation needs it (least recently freed first).

Where the chain of whole-block hits ends, the request's next tokens may still begin a cached block with
the same parent: the same prompt sent again (its last block holds the last prompt token, which must be
computed), or a shared prefix that ends inside a block. That block is copied into a fresh block of the
request's own (copy on write: the copy's later slots are overwritten), the shared tokens count as
computed, and only the rest is: a repeated prompt computes one token instead of up to a block of them.
The runner makes the copies (`take_block_copies`) before the step's forward pass writes any slot.

Sliding windows: when every layer of the model attends only to the last `sliding_window` positions, the
blocks wholly behind the window of a request's next query are never read again. Each allocation frees
them first; their table entries become NULL_BLOCK, so a long request holds about window / block_size
blocks instead of its whole length.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict

from nanoserve.core.request import Request
from nanoserve.model.batch import NULL_BLOCK

_ROOT_HASH = 0
"""Parent hash of a request's first block (a constant, unlike hash(None) on Python 3.11)."""


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, sliding_window: int | None = None
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be at least 1, got {num_blocks}, {block_size}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        self._block_contents: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks
        """Each named block's parent hash and token ids: its entry in `_children`."""
        self._children: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        """Parent hash -> (token ids, block) of the named blocks that continue it, in token order: the
        one sharing the most leading tokens with a sequence sits next to where that sequence would go."""
        self._block_copies: list[tuple[int, int]] = []
        """(source, destination) block pairs to copy before the next forward pass, in this order."""
        # Free blocks come from two places: never-hashed blocks (a stack, handed out first) and cached
        # blocks nobody uses (an ordered dict, oldest first: the LRU eviction order). Both are O(1).
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        """Per request: how many leading blocks of its table are already in the prefix cache."""
        self._num_skipped: dict[str, int] = {}
        """Per request: how many leading blocks of its table fell behind the sliding window (NULL_BLOCK)."""
        self.prefix_cache_queries = 0
        """Tokens of requests looked up in the prefix cache at their first allocation."""
        self.prefix_cache_hits = 0
        """Of those, tokens served from the cache."""

    # ---- pool state ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take, evictable cached blocks included."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (evictable cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    # ---- prefix cache ----------------------------------------------------------------------------

    def _hash_blocks(self, request: Request, num_full_blocks: int) -> None:
        """Extend `request.block_hashes` to cover its first `num_full_blocks` blocks."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else _ROOT_HASH
            hashes.append(hash((parent, tuple(tokens[i * bs : (i + 1) * bs]))))

    def get_computed_blocks(self, request: Request) -> int:
        """Leading tokens of `request` whose K/V are in the prefix cache: whole blocks whose chained hashes
        hit, then the tokens a cached block shares with what follows (`_partial_hit`).

        The last token is never served from the cache, so the request still computes one token and
        samples from it. Allocates nothing; pass the result to `allocate_slots` in the same step.
        """
        if not self.enable_prefix_caching:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._hash_blocks(request, max_blocks)
        num_hit = 0
        for h in request.block_hashes[:max_blocks]:
            if h not in self._hash_to_block:
                break
            num_hit += 1
        _, num_shared = self._partial_hit(request, num_hit)
        return num_hit * self.block_size + num_shared

    def _partial_hit(self, request: Request, num_full_hits: int) -> tuple[int | None, int]:
        """The named block under the parent of the request's block after its whole-block hits that shares
        the most leading tokens with the request's tokens there (its last token excluded), and how many;
        (None, 0) when none shares any."""
        bs = self.block_size
        start = num_full_hits * bs
        wanted = request.all_token_ids[start : min(start + bs, request.num_tokens - 1)]
        if not wanted:
            return None, 0
        parent = request.block_hashes[num_full_hits - 1] if num_full_hits else _ROOT_HASH
        children = self._children.get(parent, [])
        at = bisect_left(children, (tuple(wanted),))
        best: tuple[int | None, int] = (None, 0)
        for tokens, block in children[max(at - 1, 0) : at + 1]:
            pairs = zip(tokens, wanted, strict=False)
            shared = next((i for i, (a, b) in enumerate(pairs) if a != b), len(wanted))
            if shared > best[1]:
                best = (block, shared)
        return best

    def cache_computed_blocks(self, request: Request) -> None:
        """Name the request's newly full and computed blocks in the prefix cache.

        Call after `request.num_computed_tokens` advanced (prompt chunks and generated tokens alike).
        Amortised O(1) per token: each block is hashed once.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        if table is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered[request.request_id]
        if num_full <= start:
            return
        self._hash_blocks(request, num_full)
        for i in range(start, num_full):
            h = request.block_hashes[i]
            block = table[i]
            # Two requests may compute the same block at once; the first one named keeps the name.
            if h not in self._hash_to_block and self._block_hash[block] is None:
                self._hash_to_block[h] = block
                self._block_hash[block] = h
                parent = request.block_hashes[i - 1] if i else _ROOT_HASH
                tokens = tuple(request.all_token_ids[i * self.block_size : (i + 1) * self.block_size])
                self._block_contents[block] = (parent, tokens)
                insort(self._children.setdefault(parent, []), (tokens, block))
        self._num_registered[request.request_id] = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is held by a request."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self._hash_to_block.clear()
        self._block_hash = [None] * self.num_blocks
        self._block_contents = [None] * self.num_blocks
        self._children.clear()
        self._free_uncached.extend(self._free_cached)
        self._free_cached.clear()
        return True

    # ---- allocation ------------------------------------------------------------------------------

    def _pop_free_block(self) -> int:
        if self._free_uncached:
            return self._free_uncached.pop()
        block, _ = self._free_cached.popitem(last=False)  # evict the least recently freed
        block_hash = self._block_hash[block]
        assert block_hash is not None, "cached free blocks all have hashes"
        del self._hash_to_block[block_hash]
        self._block_hash[block] = None
        contents = self._block_contents[block]
        assert contents is not None, "named blocks keep their contents"
        self._block_contents[block] = None
        parent, tokens = contents
        children = self._children[parent]
        del children[bisect_left(children, (tokens, block))]
        if not children:
            del self._children[parent]
        return block

    def allocate_slots(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """Grow the request's table so that num_computed_tokens + num_cached_tokens + num_new_tokens fit.

        On the request's first allocation, `num_cached_tokens` (from `get_computed_blocks`) selects the
        shared cached blocks that start its table, and the block its partial hit copies; later ones first
        free the blocks behind the sliding window. Returns False, allocating nothing, when the pool is too small.
        """
        bs = self.block_size
        table = self._tables.get(request.request_id)
        hit_blocks: list[int] = []
        copy_from: int | None = None
        if table is None:
            hit_blocks = [self._hash_to_block[h] for h in request.block_hashes[: num_cached_tokens // bs]]
            table_len = len(hit_blocks)
            if num_cached_tokens % bs:
                copy_from, num_shared = self._partial_hit(request, table_len)
                assert copy_from is not None and num_shared >= num_cached_tokens % bs, (
                    "from get_computed_blocks"
                )
        else:
            assert num_cached_tokens == 0, "cached tokens are only taken at the first allocation"
            self._free_behind_window(request, table)
            table_len = len(table)
        num_tokens = request.num_computed_tokens + num_cached_tokens + num_new_tokens
        num_fresh = max(0, -(-num_tokens // bs) - table_len)
        # Hits on unused cached blocks take them out of the free pool too.
        num_revived = sum(1 for b in hit_blocks if self._ref_counts[b] == 0)
        if num_fresh + num_revived > self.num_free_blocks:
            return False

        if table is None:
            table = self._tables[request.request_id] = []
            self._num_registered[request.request_id] = len(hit_blocks)
            self._num_skipped[request.request_id] = 0
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_cached_tokens
            for b in hit_blocks:
                if self._ref_counts[b] == 0:
                    del self._free_cached[b]
                self._ref_counts[b] += 1
                table.append(b)
        # in ascending order: a request frees its tail first, so the blocks of one earlier request come
        # back last to first, and the decode attention kernel reads blocks laid out forward faster
        for b in sorted(self._pop_free_block() for _ in range(num_fresh)):
            self._ref_counts[b] = 1
            table.append(b)
        if copy_from is not None:
            # copy_from may have been evicted (even into this very table) by the pops above: its slots
            # stay as they are until a forward pass writes them, after the copies
            self._block_copies.append((copy_from, table[len(hit_blocks)]))
        return True

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies the allocations since the last call asked for, to make
        in this order before the forward pass that follows."""
        copies, self._block_copies = self._block_copies, []
        return copies

    def _free_behind_window(self, request: Request, table: list[int]) -> None:
        """Free the blocks no query from num_computed_tokens on can see: the next query, at position
        num_computed_tokens, sees keys from num_computed_tokens - sliding_window + 1."""
        if self.sliding_window is None:
            return
        first_needed = request.num_computed_tokens - self.sliding_window + 1
        num_behind = min(max(first_needed, 0) // self.block_size, len(table))
        for i in range(self._num_skipped[request.request_id], num_behind):
            self._release(table[i])
            table[i] = NULL_BLOCK
        self._num_skipped[request.request_id] = max(num_behind, self._num_skipped[request.request_id])

    def _release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if self._block_hash[block] is None:
                self._free_uncached.append(block)
            else:
                self._free_cached[block] = None

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` slots: after speculative decoding, the slots
        of rejected draft tokens (never hashed: only computed blocks are). What they hold is overwritten
        before it is read, so trimming is about the pool, not correctness."""
        table = self._tables.get(request.request_id)
        if table is None:
            return
        num_needed = -(-num_tokens // self.block_size)
        while len(table) > num_needed:
            self._release(table.pop())

    def free(self, request: Request) -> None:
        """Release the request's blocks; hashed ones stay cached until evicted."""
        table = self._tables.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        self._num_skipped.pop(request.request_id, None)
        if table is None:
            return
        # Tail blocks first, so they are evicted before the prefix blocks other requests are likelier
        # to share.
        for b in reversed(table):
            if b != NULL_BLOCK:
                self._release(b)
