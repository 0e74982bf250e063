"""The radix prefix cache on hand-built KV tensors: matching, splitting, byte accounting, LRU
eviction order and locking."""

import pytest
import torch

from rksc_engine.prefix_cache import RadixPrefixCache, make_eviction_policy

L, H, D = 2, 2, 4
BYTES_PER_TOKEN = L * 2 * H * D * 4  # float32


def kv_for(token_ids):
    """KV whose values encode (token id, position) so slices can be checked exactly."""
    t = torch.zeros(L, 2, H, len(token_ids), D)
    for pos, tok in enumerate(token_ids):
        t[:, :, :, pos, 0] = tok
        t[:, :, :, pos, 1] = pos
    return t


def make_cache(budget_tokens=1000):
    return RadixPrefixCache(budget_tokens * BYTES_PER_TOKEN)


def test_match_returns_the_longest_cached_prefix_and_its_exact_kv():
    cache = make_cache()
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    match = cache.match_prefix([1, 2, 3, 9, 9])
    assert match.num_tokens == 3
    assert torch.equal(match.kv, kv_for([1, 2, 3, 4])[:, :, :, :3])


def test_match_respects_max_tokens():
    cache = make_cache()
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    match = cache.match_prefix([1, 2, 3, 4], max_tokens=3)
    assert match.num_tokens == 3 and match.kv.shape[3] == 3


def test_a_miss_matches_nothing():
    cache = make_cache()
    cache.insert([1, 2], kv_for([1, 2]))
    match = cache.match_prefix([5, 6])
    assert match.num_tokens == 0 and match.kv is None


def test_insert_stores_only_the_uncached_suffix_and_counts_bytes_exactly():
    cache = make_cache()
    assert cache.insert([1, 2, 3], kv_for([1, 2, 3])) == 3
    assert cache.insert([1, 2, 3, 4, 5], kv_for([1, 2, 3, 4, 5])) == 2
    assert cache.insert([1, 2, 7], kv_for([1, 2, 7])) == 1  # splits the [1,2,3] edge
    assert cache.total_tokens == 6
    assert cache.total_bytes == 6 * BYTES_PER_TOKEN
    # Each branch reads back exactly its own KV across the split.
    assert torch.equal(cache.match_prefix([1, 2, 7]).kv, kv_for([1, 2, 7]))
    assert torch.equal(cache.match_prefix([1, 2, 3, 4, 5]).kv, kv_for([1, 2, 3, 4, 5]))


def test_reinserting_a_cached_sequence_adds_nothing():
    cache = make_cache()
    cache.insert([1, 2, 3], kv_for([1, 2, 3]))
    assert cache.insert([1, 2, 3], kv_for([1, 2, 3])) == 0
    assert cache.total_tokens == 3


def test_eviction_removes_least_recently_used_leaves_first():
    cache = make_cache(budget_tokens=6)
    cache.insert([1, 2], kv_for([1, 2]))          # leaf A
    cache.insert([3, 4], kv_for([3, 4]))          # leaf B
    cache.insert([5, 6], kv_for([5, 6]))          # leaf C; cache full
    cache.match_prefix([1, 2])                    # touch A: B is now least recent
    cache.insert([7, 8], kv_for([7, 8]))          # needs 2 tokens of room
    assert cache.match_prefix([3, 4]).num_tokens == 0, "B (least recently used) should be evicted"
    assert cache.match_prefix([1, 2]).num_tokens == 2
    assert cache.match_prefix([5, 6]).num_tokens == 2
    assert cache.match_prefix([7, 8]).num_tokens == 2
    assert cache.total_bytes <= cache.budget_bytes


def test_evicting_a_leaf_can_expose_its_parent_for_eviction():
    cache = make_cache(budget_tokens=10)
    cache.insert([1, 2, 3], kv_for([1, 2, 3]))
    cache.insert([1, 2, 4], kv_for([1, 2, 4]))  # tree: [1,2] -> {[3], [4]}
    freed = cache.evict(cache.total_bytes)
    assert freed == 4 * BYTES_PER_TOKEN
    assert cache.total_bytes == 0 and cache.num_nodes() == 0


def test_a_locked_node_is_never_evicted():
    cache = make_cache(budget_tokens=4)
    cache.insert([1, 2], kv_for([1, 2]))
    match = cache.match_prefix([1, 2])
    cache.lock(match.last_node)
    cache.insert([3, 4], kv_for([3, 4]))
    cache.insert([5, 6], kv_for([5, 6]))  # over budget: only [3,4] may go
    assert cache.match_prefix([1, 2]).num_tokens == 2
    assert cache.match_prefix([3, 4]).num_tokens == 0
    cache.unlock(match.last_node)
    assert cache.evict(10**9) == 4 * BYTES_PER_TOKEN


def test_an_insert_larger_than_the_budget_is_not_kept():
    cache = make_cache(budget_tokens=2)
    assert cache.insert([1, 2, 3], kv_for([1, 2, 3])) == 0
    assert cache.total_bytes == 0


def test_unlock_without_lock_is_an_error():
    cache = make_cache()
    cache.insert([1], kv_for([1]))
    with pytest.raises(RuntimeError):
        cache.unlock(cache.match_prefix([1]).last_node)


def test_unknown_policy_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="lru"):
        make_eviction_policy("fifo")
