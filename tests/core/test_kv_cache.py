"""KVCacheManager: block pool, ref counts, chained-hash prefix cache, LRU eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.core.kv_cache import KVCacheManager
from nanoserve.core.request import Request
from nanoserve.model.batch import NULL_BLOCK
from nanoserve.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(
        request_id, prompt, SamplingParams(max_tokens=8), eos_token_ids=(), arrival_time=0.0, max_tokens=8
    )


def admit(kv: KVCacheManager, request: Request) -> int:
    """What the scheduler does for a fresh request: look up, allocate the whole prompt, compute it."""
    num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, num_cached)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    return num_cached


def test_alloc_free_refcount():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    r = make_request("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert len(kv.block_ids("a")) == 3
    assert kv.num_free_blocks == 5
    assert kv.usage == 3 / 8
    # growing within the last block needs no new block; crossing its end does
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2)
    assert len(kv.block_ids("a")) == 3
    assert kv.allocate_slots(r, 3)
    assert len(kv.block_ids("a")) == 4
    kv.free(r)
    assert kv.num_free_blocks == 8
    assert kv.block_ids("a") == []
    assert kv.usage == 0.0


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    b = make_request("b", list(range(8)))
    assert not kv.allocate_slots(b, 8)
    assert kv.block_ids("b") == []
    assert kv.num_free_blocks == 1
    assert kv.allocate_slots(b, 4)


def test_blocks_are_distinct_and_reused():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    a, b = make_request("a", list(range(8))), make_request("b", list(range(8)))
    assert kv.allocate_slots(a, 8) and kv.allocate_slots(b, 8)
    assert sorted(kv.block_ids("a") + kv.block_ids("b")) == [0, 1, 2, 3]
    kv.free(a)
    c = make_request("c", list(range(8)))
    assert kv.allocate_slots(c, 8)
    assert sorted(kv.block_ids("c")) == sorted(set(range(4)) - set(kv.block_ids("b")))


def test_prefix_hit_shares_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(kv, a) == 0
    assert len(a.block_hashes) == 2
    b = make_request("b", list(range(8)) + [50, 51, 52])
    assert admit(kv, b) == 8
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.block_ids("b")[2] != kv.block_ids("a")[2]
    assert b.block_hashes[:2] == a.block_hashes
    # shared blocks stay held while one owner remains
    free_before = kv.num_free_blocks
    kv.free(a)
    assert kv.num_free_blocks == free_before + 1  # only a's private tail block
    assert kv.prefix_cache_queries == 21
    assert kv.prefix_cache_hits == 8


def test_differing_block_breaks_the_chain():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    admit(kv, make_request("a", list(range(12)) + [99]))
    # second block differs: the third block (equal tokens) must not hit, its parent differs
    prompt = list(range(4)) + [70, 71, 72, 73] + list(range(8, 12)) + [99]
    assert kv.get_computed_blocks(make_request("b", prompt)) == 4
    # first block differs: nothing hits
    assert kv.get_computed_blocks(make_request("c", [1] + list(range(1, 12)) + [99])) == 0


def test_last_token_is_always_computed():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    # the whole 8-token prompt is cached, but one token must be computed to sample from: the first block
    # is shared, the first 3 tokens of the second come from a copy of a's second block
    b = make_request("b", list(range(8)))
    assert kv.get_computed_blocks(b) == 7
    assert kv.allocate_slots(b, 1, 7)
    a_blocks, b_blocks = kv.block_ids("a"), kv.block_ids("b")
    assert b_blocks[0] == a_blocks[0] and b_blocks[1] != a_blocks[1]
    assert kv.take_block_copies() == [(a_blocks[1], b_blocks[1])]
    assert kv.take_block_copies() == []
    assert kv.get_computed_blocks(make_request("c", list(range(9)))) == 8


def test_prefix_that_ends_inside_a_block_hits_its_tokens():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    admit(kv, make_request("a", list(range(10))))
    # 0-3 whole, then 4 and 5 of a's second block: 6 tokens, the second block a private copy
    b = make_request("b", [0, 1, 2, 3, 4, 5, 90, 91, 92])
    assert admit(kv, b) == 6
    assert kv.take_block_copies() == [(kv.block_ids("a")[1], kv.block_ids("b")[1])]
    assert kv.prefix_cache_hits == 6
    # the copy is b's own block, named for its own tokens
    assert kv.get_computed_blocks(make_request("c", [0, 1, 2, 3, 4, 5, 90, 91, 92, 93])) == 8
    # a partial hit in the first block: its parent is the root
    assert kv.get_computed_blocks(make_request("d", [0, 1, 70, 71, 72])) == 2
    assert kv.get_computed_blocks(make_request("e", [5, 1, 2, 3, 4])) == 0


def test_evicted_blocks_give_no_partial_hits():
    kv = KVCacheManager(num_blocks=2, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(100, 108)))  # evicts both of a's blocks
    admit(kv, b)
    kv.free(b)
    assert kv.get_computed_blocks(make_request("c", [0, 1, 2, 3, 4, 5, 6, 7])) == 0
    assert kv.get_computed_blocks(make_request("d", [100, 101, 102, 103, 104, 105, 106, 107])) == 7


def test_a_partial_hit_on_a_block_evicted_by_its_own_allocation():
    """With no other free block, the copy's source is evicted into the request's own table: its slots
    are still intact when the copy is made, before any forward pass."""
    kv = KVCacheManager(num_blocks=2, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)  # a's blocks: evictable, the second (a tail block) first
    b = make_request("b", list(range(8)))
    assert admit(kv, b) == 7
    source, destination = kv.take_block_copies()[0]
    assert kv.block_ids("b")[1] == destination
    assert source == destination  # the block was its own source: nothing to move


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@settings(max_examples=200, deadline=None)
@given(
    cached=st.lists(st.lists(st.integers(0, 2), min_size=BS, max_size=BS), max_size=12),
    query=st.lists(st.integers(0, 2), min_size=BS, max_size=BS),
)
def test_a_partial_hit_shares_the_longest_prefix_of_any_cached_sibling(cached, query):
    kv = KVCacheManager(num_blocks=64, block_size=BS, enable_prefix_caching=True)
    for i, tokens in enumerate(cached):  # one more token makes the first block full and computed
        admit(kv, make_request(f"c{i}", [*tokens, 9]))
    wanted = query[: BS - 1]  # the last token is always computed
    expected = max((common_prefix(tokens, wanted) for tokens in cached), default=0)
    assert kv.get_computed_blocks(make_request("q", query)) == expected


def test_evicting_some_sibling_blocks_keeps_the_others_found():
    kv = KVCacheManager(num_blocks=7, block_size=BS, enable_prefix_caching=True)
    for t in range(5):  # five named first blocks under the root, sharing [1, 2]
        sibling = make_request(f"s{t}", [1, 2, t, 0, 9])
        admit(kv, sibling)
        kv.free(sibling)
    # the siblings' unnamed second blocks are free, 2 of them: 4 blocks take those and evict s0's, s1's
    admit(kv, make_request("other", list(range(100, 116))))
    for t in range(5):
        assert kv.get_computed_blocks(make_request(f"q{t}", [1, 2, t, 0, 5])) == (2 if t < 2 else 4)


def test_generated_tokens_become_cached():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(6)))
    admit(kv, a)
    assert len(a.block_hashes) == 1
    for token in (6, 7, 8):  # decode: each new token is computed in the next step
        a.append_output_token(token)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        kv.cache_computed_blocks(a)
    assert len(a.block_hashes) == 2
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", list(range(10)))) == 8


def test_hit_revives_an_evictable_block():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.usage == 0.0
    b = make_request("b", list(range(9)))
    assert admit(kv, b) == 8
    assert kv.num_free_blocks == 1
    assert kv.usage == 3 / 4


def test_lru_eviction_of_cached_free_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(100, 104)) + [1])  # 1 cached block + 1 private
    b = make_request("b", list(range(200, 204)) + [1])
    admit(kv, a)
    admit(kv, b)
    kv.free(a)  # a's blocks freed first: least recently used
    kv.free(b)
    assert kv.num_free_blocks == 4
    # two fresh blocks: the unhashed tail blocks go first, no cached block is evicted
    c = make_request("c", list(range(300, 308)))
    assert kv.allocate_slots(c, 8)
    assert kv.get_computed_blocks(make_request("a2", list(range(100, 104)) + [2])) == 4
    assert kv.get_computed_blocks(make_request("b2", list(range(200, 204)) + [2])) == 4
    # one more block evicts a's (older) cached block, b's stays
    c.num_computed_tokens = 8
    assert kv.allocate_slots(c, 1)
    assert kv.get_computed_blocks(make_request("a3", list(range(100, 104)) + [2])) == 0
    assert kv.get_computed_blocks(make_request("b3", list(range(200, 204)) + [2])) == 4


def test_a_prompt_reusing_freed_blocks_gets_them_in_ascending_order():
    """Freed tail first, an earlier request's cached blocks would come back last to first; the decode
    attention kernel reads a sequence's blocks faster laid out forward."""
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(100, 116)))
    admit(kv, a)
    assert kv.block_ids("a") == [0, 1, 2, 3]
    kv.free(a)
    b = make_request("b", list(range(200, 232)))
    admit(kv, b)
    assert kv.block_ids("b") == [0, 1, 2, 3, 4, 5, 6, 7]


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == 8
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("c", list(range(9)))) == 0
    assert kv.num_free_blocks == 8


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == 0
    assert a.block_hashes == []
    assert kv.prefix_cache_queries == 0


def test_blocks_behind_a_sliding_window_are_freed():
    """Window 6, blocks of 4: a query at position p sees p-5..p, so once the next query sits at 14, blocks
    0-1 (positions 0-7) are never read again and go back to the pool, their entries NULL_BLOCK."""
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=True, sliding_window=6)
    r = make_request("a", list(range(10)))
    admit(kv, r)
    assert kv.num_free_blocks == 3
    assert kv.allocate_slots(r, 1)  # next query at 10 sees 5..10: block 0 (0-3) goes
    assert kv.block_ids("a")[0] == NULL_BLOCK and kv.block_ids("a")[1] != NULL_BLOCK
    assert kv.num_free_blocks == 4
    for token in range(10, 14):
        r.append_output_token(token)
        r.num_computed_tokens += 1
        kv.cache_computed_blocks(r)
        assert kv.allocate_slots(r, 1)
    # next query at 14 sees 9..14: blocks 0 and 1 are gone; 4 blocks cover 15 tokens, 2 of them live
    assert kv.block_ids("a")[:2] == [NULL_BLOCK, NULL_BLOCK] and NULL_BLOCK not in kv.block_ids("a")[2:]
    assert kv.num_free_blocks == 4
    # the freed full blocks stay in the prefix cache until evicted; finishing frees the rest once
    other = make_request("b", list(range(9)))
    assert admit(kv, other) == 8
    kv.free(r)
    kv.free(other)
    assert kv.num_free_blocks == 6 and kv.usage == 0.0


def test_no_window_frees_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    r = make_request("a", list(range(20)))
    admit(kv, r)
    assert kv.allocate_slots(r, 1)
    assert NULL_BLOCK not in kv.block_ids("a")
