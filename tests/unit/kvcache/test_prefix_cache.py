"""The radix prefix cache on hand-built KV tensors: matching, splitting, block layout and byte
accounting, LRU eviction order and locking. (RSBCM's omega order: tests/unit/kvcache/test_rsbcm.py.)"""

import random

import pytest
import torch
from conftest import RADIX_BYTES_PER_TOKEN as BYTES_PER_TOKEN
from conftest import radix_kv as kv_for

from rksc_engine.kvcache.radix import RadixPrefixCache, make_eviction_policy


def make_cache(budget_tokens=1000, block_size=16, policy="lru"):
    return RadixPrefixCache(budget_tokens * BYTES_PER_TOKEN, policy=policy, block_size=block_size)


def block_widths(node):
    return [b.shape[3] for b in node.blocks]


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


def test_an_insert_smaller_than_one_block_that_does_not_fit_is_not_kept():
    cache = make_cache(budget_tokens=2)
    assert cache.insert([1, 2, 3], kv_for([1, 2, 3])) == 0
    assert cache.total_bytes == 0 and cache.num_nodes() == 0


def test_an_insert_that_does_not_fit_keeps_its_longest_block_aligned_leading_part():
    cache = make_cache(budget_tokens=7, block_size=3)
    ids = list(range(1, 11))
    assert cache.insert(ids, kv_for(ids)) == 6, "7 tokens of room hold two whole 3-token blocks"
    match = cache.match_prefix(ids)
    assert match.num_tokens == 6
    assert torch.equal(match.kv, kv_for(ids)[:, :, :, :6])
    assert cache.total_bytes == 6 * BYTES_PER_TOKEN


def test_unlock_without_lock_is_an_error():
    cache = make_cache()
    cache.insert([1], kv_for([1]))
    with pytest.raises(RuntimeError):
        cache.unlock(cache.match_prefix([1]).last_node)


def test_unknown_policy_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="lru"):
        make_eviction_policy("fifo")


def test_blocks_are_aligned_to_absolute_positions_and_a_partial_block_counts_its_real_bytes():
    cache = make_cache(block_size=4)
    cache.insert([1, 2, 3, 4, 5, 6], kv_for([1, 2, 3, 4, 5, 6]))
    first = cache.root.children[1]
    assert block_widths(first) == [4, 2]
    assert cache.total_bytes == 6 * BYTES_PER_TOKEN, "a 2-token partial block must count 2 tokens, not 4"
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    cache.insert(ids, kv_for(ids))
    second = first.children[7]
    assert second.start == 6
    assert block_widths(second) == [2, 3], "the child starts mid-block: positions 6-7, then 8-10"
    assert cache.total_bytes == 11 * BYTES_PER_TOKEN
    assert all(n.storage.is_contiguous() and n.storage.untyped_storage().nbytes() == n.num_bytes
               for n in (first, second)), "each node's storage must hold exactly its own bytes"
    assert all(b.untyped_storage().data_ptr() == n.storage.untyped_storage().data_ptr()
               for n in (first, second) for b in n.blocks), "blocks must be views of their node's storage"
    cache.check_consistency()


def test_a_split_copies_nothing_and_keeps_bytes_exact():
    cache = make_cache(block_size=4)
    ids = list(range(1, 11))  # blocks [0-3] [4-7] [8-9]
    cache.insert(ids, kv_for(ids))
    node = cache.root.children[1]
    memory = node.storage.untyped_storage().data_ptr()
    other = ids[:6] + [50, 51]
    cache.insert(other, kv_for(other))  # splits after position 5, inside block [4-7]
    upper = cache.root.children[1]
    assert upper.storage.untyped_storage().data_ptr() == memory, "the upper part must be a view, not a copy"
    assert upper.children[7].storage.untyped_storage().data_ptr() == memory, "so must the lower part"
    assert block_widths(upper) == [4, 2]
    assert block_widths(upper.children[7]) == [2, 2]
    assert block_widths(upper.children[50]) == [2]
    assert cache.total_bytes == 12 * BYTES_PER_TOKEN
    assert torch.equal(cache.match_prefix(ids).kv, kv_for(ids))
    assert torch.equal(cache.match_prefix(other).kv, kv_for(other))
    cache.check_consistency()


def test_evicting_one_part_of_a_split_node_frees_its_memory_by_compacting_the_other():
    cache = make_cache(block_size=4)
    ids = list(range(1, 11))
    cache.insert(ids, kv_for(ids))
    other = ids[:6] + [50, 51]
    cache.insert(other, kv_for(other))
    upper = cache.root.children[1]
    shared = upper.storage.untyped_storage().data_ptr()
    cache.evict(cache.total_bytes - 8 * BYTES_PER_TOKEN)  # the LRU leaf [7..10] goes
    assert 7 not in upper.children
    assert upper.storage.untyped_storage().data_ptr() != shared, "the survivor kept the evicted part's memory"
    assert upper.storage.untyped_storage().nbytes() == upper.num_bytes
    assert torch.equal(cache.match_prefix(other).kv, kv_for(other))
    cache.check_consistency()


def test_a_match_lends_the_nodes_storage_in_place_as_segments():
    cache = make_cache(block_size=4)
    ids = list(range(1, 11))
    cache.insert(ids, kv_for(ids))
    cache.insert(ids[:6] + [50, 51], kv_for(ids[:6] + [50, 51]))
    match = cache.match_prefix(ids[:8] + [99])
    assert match.num_tokens == 8 and [seg.shape[3] for seg in match.segments] == [6, 2]
    node = cache.root.children[1]
    assert match.segments[0].data_ptr() == node.storage.data_ptr(), "a segment must be the node's own memory"
    assert torch.equal(torch.cat(match.segments, dim=3), kv_for(ids)[:, :, :, :8])


def test_eviction_takes_trailing_blocks_so_a_long_leaf_keeps_its_prefix():
    cache = make_cache(block_size=4)
    ids = list(range(1, 11))
    cache.insert(ids, kv_for(ids))
    freed = cache.evict(3 * BYTES_PER_TOKEN)
    assert freed == 6 * BYTES_PER_TOKEN, "the 2-token tail block, then the whole block before it"
    match = cache.match_prefix(ids)
    assert match.num_tokens == 4
    assert torch.equal(match.kv, kv_for(ids)[:, :, :, :4])
    assert cache.evicted_tokens == 6
    cache.check_consistency()


@pytest.mark.parametrize("policy", ["lru", "omega"])
def test_random_inserts_matches_and_locks_keep_the_cache_consistent_and_within_budget(policy):
    rng = random.Random(0)
    cache = make_cache(budget_tokens=40, block_size=4, policy=policy)
    locked = []
    for step in range(300):
        ids = [rng.randrange(3) for _ in range(rng.randrange(1, 25))]
        action = rng.random()
        if action < 0.6:
            cache.insert(ids, kv_for(ids), branch_score=rng.random(), depth=rng.randrange(5))
            assert cache.total_bytes <= cache.budget_bytes, f"step {step}: over budget after an insert"
        elif action < 0.8:
            match = cache.match_prefix(ids)
            if match.num_tokens:
                assert torch.equal(match.kv, kv_for(ids)[:, :, :, :match.num_tokens]), f"step {step}: wrong KV"
                if rng.random() < 0.5:
                    cache.lock(match.last_node)
                    locked.append((match.last_node, match.segments))
        elif locked:
            cache.unlock(locked.pop(rng.randrange(len(locked)))[0])
        cache.check_consistency()
        held = {n.storage.untyped_storage().data_ptr() for n in cache._iter_nodes()}
        for _, segments in locked:
            assert all(s.untyped_storage().data_ptr() in held for s in segments), (
                f"step {step}: a running request reads memory the cache no longer counts")
    assert cache.peak_bytes <= cache.budget_bytes
    for node, _ in locked:
        cache.unlock(node)
    cache.clear()
    assert cache.total_bytes == 0 and cache.num_nodes() == 0


def memory_held(cache):
    """Bytes of the distinct memory the cache's nodes view, each storage counted once in full."""
    memory = {n.storage.untyped_storage().data_ptr(): n.storage.untyped_storage().nbytes()
              for n in cache._iter_nodes()}
    return sum(memory.values())


def locked_split(cache):
    """Cache 8 tokens as one node, then match and lock its first 4 (splitting it): a running request
    now reads the upper part in place. Returns ``(ids, match)``."""
    ids = list(range(1, 9))
    cache.insert(ids, kv_for(ids))
    match = cache.match_prefix(ids[:4] + [99])
    cache.lock(match.last_node)
    return ids, match


def test_eviction_never_copies_a_locked_node_and_total_bytes_counts_all_the_memory_held():
    cache = make_cache(block_size=4)
    ids, match = locked_split(cache)
    lent = match.segments[0]
    cache.evict(10**9)  # only the unlocked lower part [5..8] is a candidate
    upper = match.last_node
    assert upper.storage.untyped_storage().data_ptr() == lent.untyped_storage().data_ptr(), (
        "the locked node was copied away from the memory its request reads")
    assert upper.storage.data_ptr() == lent.data_ptr()
    assert cache.total_bytes == memory_held(cache) == 8 * BYTES_PER_TOKEN, (
        f"total_bytes {cache.total_bytes}, but the nodes hold {memory_held(cache)} bytes of memory")
    assert cache.locked_bytes == 8 * BYTES_PER_TOKEN, "memory a locked node views cannot be freed"
    assert cache.match_prefix(ids).num_tokens == 8, "evicting the lower part would free nothing while it is lent"
    assert torch.equal(torch.cat(match.segments, dim=3), kv_for(ids)[:, :, :, :4])
    cache.check_consistency()


def test_a_request_matching_a_locked_node_after_an_eviction_shares_its_memory():
    cache = make_cache(block_size=4)
    ids, first = locked_split(cache)
    cache.insert([50, 51, 52, 53], kv_for([50, 51, 52, 53]))
    cache.evict(10**9)
    second = cache.match_prefix(ids[:4] + [77])
    assert second.last_node is first.last_node
    assert second.segments[0].data_ptr() == first.segments[0].data_ptr(), (
        "two requests reading the same cached prefix must read one copy of it")
    assert cache.total_bytes == memory_held(cache) == 8 * BYTES_PER_TOKEN
    cache.check_consistency()


def test_once_unlocked_the_memory_a_lock_kept_whole_is_freed_by_eviction():
    cache = make_cache(block_size=4)
    ids, match = locked_split(cache)
    cache.evict(10**9)
    cache.unlock(match.last_node)
    freed = cache.evict(4 * BYTES_PER_TOKEN)  # the LRU leaf is the lower part
    assert freed == 4 * BYTES_PER_TOKEN
    upper = cache.root.children[1]
    assert upper.storage.untyped_storage().nbytes() == upper.num_bytes == 4 * BYTES_PER_TOKEN
    assert cache.total_bytes == memory_held(cache) == 4 * BYTES_PER_TOKEN
    assert torch.equal(cache.match_prefix(ids).kv, kv_for(ids)[:, :, :, :4])
    cache.check_consistency()


def test_an_insert_may_evict_the_other_part_of_the_node_it_extends():
    cache = make_cache(budget_tokens=10, block_size=4)
    ids = list(range(1, 9))
    cache.insert(ids, kv_for(ids))
    other = ids[:4] + [50, 51, 52, 53, 54, 55]
    assert cache.insert(other, kv_for(other)) == 6, "the insert splits [1..8]; its lower part must make room"
    assert cache.match_prefix(ids).num_tokens == 4
    assert cache.total_bytes == memory_held(cache) == 10 * BYTES_PER_TOKEN
    cache.check_consistency()


def test_the_tokens_cached_after_a_context_follow_the_child_used_last():
    cache = make_cache()
    cache.insert([1, 2, 3, 4, 5], kv_for([1, 2, 3, 4, 5]))
    cache.insert([1, 2, 3, 8, 9], kv_for([1, 2, 3, 8, 9]))  # splits after [1, 2, 3]; [8, 9] used last
    assert cache.continuation([1, 2], 2) == [3, 8], "mid-edge: the edge's rest, then the child used last"
    assert cache.continuation([1, 2, 3], 5) == [8, 9], "a node's end: its child used last, up to its leaf"
    cache.match_prefix([1, 2, 3, 4, 5])  # now [4, 5] is the child used last
    assert cache.continuation([1, 2, 3], 1) == [4]
    assert cache.continuation([1, 2, 3, 4, 5], 3) == [], "all of it cached, nothing after it"
    assert cache.continuation([1, 2, 7], 3) is None, "the context left the tree"
    assert cache.continuation([6], 3) is None
    before = [(n.token_ids, n.last_access) for n in cache.root.children.values()]
    cache.continuation([1], 4)
    assert [(n.token_ids, n.last_access) for n in cache.root.children.values()] == before, "a look-up touched the tree"
