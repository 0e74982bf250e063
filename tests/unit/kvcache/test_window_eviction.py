"""The radix cache frees sliding-window layers' KV that no cached sequence's window reaches before it
evicts anything (SGLang's tombstones), and matches only prefixes whose window keeps every layer."""

import pytest
import torch

from rksc_engine.kvcache.radix import RadixPrefixCache

LAYERS, SLIDING, WINDOW = 4, (1, 3), 4
BYTES_PER_TOKEN = LAYERS * 2 * 1 * 2 * 4  # (L, 2, H_kv=1, T, D=2) float32


def kv_for(token_ids):
    """KV whose values encode (layer, token id, position), so every slice can be checked exactly."""
    t = torch.zeros(LAYERS, 2, 1, len(token_ids), 2)
    for pos, tok in enumerate(token_ids):
        t[:, :, :, pos, 0] = tok + 1000 * torch.arange(1, LAYERS + 1).view(LAYERS, 1, 1)
        t[:, :, :, pos, 1] = pos
    return t


def make_cache(budget_tokens, sliding=SLIDING):
    cache = RadixPrefixCache(budget_tokens * BYTES_PER_TOKEN, policy="lru", block_size=4)
    cache.set_sliding_window(sliding, LAYERS, WINDOW)
    return cache


A = list(range(100, 132))  # 32 tokens
B = list(range(200, 224))  # 24 tokens


def test_pressure_frees_out_of_window_kv_first_and_a_repeated_sequence_still_matches_whole():
    cache = make_cache(48)
    cache.insert(A, kv_for(A))
    cache.insert(B, kv_for(B))  # 8 tokens over: freeing half the layers of A[:27] frees 13.5 tokens' worth
    cache.check_consistency()
    assert cache.evicted_tokens == 0
    assert cache.window_freed_tokens == len(A) - WINDOW - 1
    assert cache.total_bytes == (len(A) + len(B)) * BYTES_PER_TOKEN - 27 * BYTES_PER_TOKEN // 2
    for wanted in (len(A), len(A) - 1):  # an agent's next turn, and a repeated prompt
        match = cache.match_prefix(A, max_tokens=wanted)
        assert match.num_tokens == wanted
        kv = match.kv
        for layer in range(LAYERS):
            if layer in SLIDING:  # zeros out of the window, the exact KV in it
                assert torch.equal(kv[layer, :, :, :27], torch.zeros_like(kv[layer, :, :, :27]))
                assert torch.equal(kv[layer, :, :, 27:], kv_for(A)[layer, :, :, 27:wanted])
            else:
                assert torch.equal(kv[layer], kv_for(A)[layer, :, :, :wanted])
        zeros, _ = match.layer_kv(1)[0]
        assert zeros.stride() == (0, 0, 0), "freed KV must come back as zeros that take no memory"


def test_without_a_window_the_same_pressure_evicts_the_older_sequence():
    cache = RadixPrefixCache(48 * BYTES_PER_TOKEN, policy="lru", block_size=4)
    cache.insert(A, kv_for(A))
    cache.insert(B, kv_for(B))
    assert cache.evicted_tokens == 8 and cache.match_prefix(A).num_tokens == len(A) - 8


def test_a_match_is_cut_back_to_where_the_window_before_it_keeps_every_layer():
    cache = make_cache(48)
    cache.insert(A, kv_for(A))
    cache.insert(B, kv_for(B))
    # Freed: positions [0, 27). A match of length m needs positions [m - WINDOW, m) whole.
    assert cache.match_prefix(A, max_tokens=31).num_tokens == 31
    assert cache.match_prefix(A, max_tokens=30).num_tokens == 0
    assert cache.match_prefix(A[:20]).num_tokens == 0
    assert cache.match_prefix(A[:20] + [7, 7]).num_tokens == 0
    assert cache.match_prefix(B).num_tokens == len(B)


def test_locked_kv_is_never_freed():
    cache = make_cache(48)
    cache.insert(A, kv_for(A))
    held = cache.match_prefix(A)
    cache.lock(held.last_node)
    cache.insert(B, kv_for(B))
    assert cache.window_freed_tokens == 0
    assert torch.equal(held.kv, kv_for(A))
    cache.unlock(held.last_node)
    cache.check_consistency()


def cache_with_a_freed():
    """A and B cached, A's [0, 27) freed under a lower budget, then the budget back up."""
    cache = make_cache(72)
    cache.insert(A, kv_for(A))
    cache.insert(B, kv_for(B))
    cache.set_budget(48 * BYTES_PER_TOKEN)
    assert cache.window_freed_tokens == 27
    cache.restore_budget()
    return cache


def test_an_exact_prefill_puts_freed_kv_back_where_its_window_needs_it():
    cache = cache_with_a_freed()
    turn = A[:20] + [7, 7, 7]
    assert cache.match_prefix(turn).num_tokens == 0  # its window reaches freed KV
    cache.insert(turn, kv_for(turn))  # KV read from this cache: nothing is put back
    assert cache.match_prefix(turn).num_tokens == 0
    cache.set_budget(64 * BYTES_PER_TOKEN)
    cache.insert(turn, kv_for(turn), computed_from=0)  # no room to put it back
    assert cache.match_prefix(turn).num_tokens == 0
    cache.restore_budget()
    cache.insert(turn, kv_for(turn), computed_from=0)  # all computed afresh
    match = cache.match_prefix(turn)
    assert match.num_tokens == len(turn) and torch.equal(match.kv, kv_for(turn))
    assert cache.match_prefix(A).num_tokens == len(A)
    cache.check_consistency()
    assert cache.total_bytes <= cache.budget_bytes


def test_a_model_of_sliding_layers_only_frees_all_of_the_old_kv():
    cache = make_cache(48, sliding=tuple(range(LAYERS)))
    cache.insert(A, kv_for(A))
    cache.insert(B, kv_for(B))
    cache.check_consistency()
    assert cache.evicted_tokens == 0
    assert cache.total_bytes == (len(A) + len(B) - 27) * BYTES_PER_TOKEN
    match = cache.match_prefix(A)
    assert match.num_tokens == len(A)
    assert torch.equal(match.kv[:, :, :, 27:], kv_for(A)[:, :, :, 27:])


def test_eviction_after_freeing_still_keeps_the_budget_and_the_tree_consistent():
    cache = make_cache(40)
    for first in range(6):
        ids = [first * 50 + i for i in range(30)]
        cache.insert(ids, kv_for(ids))
        cache.check_consistency()
        assert cache.total_bytes <= cache.budget_bytes
    assert cache.window_freed_tokens > 0 and cache.evicted_tokens > 0
    cache.clear()
    assert cache.total_bytes == 0 and cache.num_nodes() == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(sliding_layers=(), num_layers=4, window=4), "sliding_layers"),
    (dict(sliding_layers=(4,), num_layers=4, window=4), "sliding_layers"),
    (dict(sliding_layers=(1,), num_layers=0, window=4), "num_layers"),
    (dict(sliding_layers=(1,), num_layers=4, window=0), "window"),
])
def test_bad_window_settings_are_refused_by_name(kwargs, message):
    cache = RadixPrefixCache(1000)
    with pytest.raises(ValueError, match=message):
        cache.set_sliding_window(**kwargs)


def test_a_match_cut_by_the_window_locks_only_the_nodes_it_rests_on_and_the_freed_rest_comes_back():
    head, tail, other = list(range(300, 310)), list(range(400, 430)), list(range(500, 508))
    cache = make_cache(80)
    cache.insert(head + tail, kv_for(head + tail))
    cache.insert(head + other, kv_for(head + other))  # ``head`` is now a node of its own
    cache.set_budget(40 * BYTES_PER_TOKEN)
    assert cache.window_freed_tokens > 0
    cache.restore_budget()
    turn = head + tail[:20] + [7, 7, 7]
    match = cache.match_prefix(turn, max_tokens=len(turn) - 1)
    assert match.num_tokens == len(head) and not match.window_freed
    assert match.last_node.end == len(head), "the lock must not reach the freed nodes after the cut"
    cache.lock(match.last_node)  # as a prefill holds it while it inserts what it computed
    cache.insert(turn, kv_for(turn), computed_from=len(head))
    cache.unlock(match.last_node)
    again = cache.match_prefix(turn, max_tokens=len(turn) - 1)
    assert again.num_tokens == len(turn) - 1 and torch.equal(again.kv, kv_for(turn)[:, :, :, :-1])
    cache.check_consistency()


def test_a_freed_node_ending_just_inside_the_next_prompts_window_is_put_back():
    cache = cache_with_a_freed()
    turn = A[:19] + [7, 7, 7, 7]  # its prompt match (all but the last token) needs [18, 22) whole
    cache.insert(turn, kv_for(turn), computed_from=0)
    assert cache.match_prefix(turn, max_tokens=len(turn) - 1).num_tokens == len(turn) - 1


def test_a_match_says_whether_it_rests_on_freed_kv():
    cache = make_cache(48)
    cache.insert(A, kv_for(A))
    assert not cache.match_prefix(A).window_freed
    cache.insert(B, kv_for(B))
    assert cache.match_prefix(A).window_freed and not cache.match_prefix(B).window_freed
