"""RSBCM: omega = branch_score / (depth + 1) eviction of trailing blocks on hand-built trees, locks,
the config, exact recompute of evicted prefixes, and out-of-memory recovery of forward passes."""

import pytest
import torch
from conftest import RADIX_BYTES_PER_TOKEN as BYTES_PER_TOKEN
from conftest import radix_kv as kv_for

from rksc_engine import EngineConfig, ForwardOutOfMemoryError, RKSCEngine, SamplingParams
from rksc_engine.config import RSBCMConfig
from rksc_engine.kvcache.memory import cache_lengths, run_with_oom_retry
from rksc_engine.kvcache.radix import RadixPrefixCache

TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny model: 2 layers, K and V, 2 KV heads, head_dim 16, fp32


A = [1, 2, 3, 4]                # positions 0-3,  omega 1.0 (the prompt)
B = A + [10, 11, 12, 13, 14]    # positions 4-8,  omega 0.9 / 2 = 0.45
C = A + [20, 21, 22]            # positions 4-6,  omega 0.3 / 2 = 0.15
D_ = B + [30, 31, 32, 33]       # positions 9-12, omega 0.8 / 3 = 0.267
E = A + [40, 41]                # positions 4-5,  omega 0.9 / 4 = 0.225


def build_tree(policy="omega"):
    """root -> A -> {B -> D, C, E}, block size 2 (blocks cover positions [0,1], [2,3], [4,5], ...)."""
    cache = RadixPrefixCache(1000 * BYTES_PER_TOKEN, policy=policy, block_size=2)
    cache.insert(A, kv_for(A), branch_score=1.0, depth=0)
    cache.insert(B, kv_for(B), branch_score=0.9, depth=1)
    cache.insert(C, kv_for(C), branch_score=0.3, depth=1)
    cache.insert(D_, kv_for(D_), branch_score=0.8, depth=2)
    cache.insert(E, kv_for(E), branch_score=0.9, depth=3)
    return cache


def order(blocks):
    return [b.token_ids for b in blocks]


def test_omega_evicts_trailing_blocks_of_leaves_in_increasing_omega_then_exposed_parents():
    cache = build_tree("omega")
    evicted = cache.evict_blocks(cache.total_bytes)
    assert order(evicted) == [
        (22,), (20, 21),                 # C, omega 0.15: its partial tail block first
        (40, 41),                        # E, omega 0.225
        (33,), (31, 32), (30,),          # D, omega 0.267: block-aligned at positions 12 | 10-11 | 9
        (14,), (12, 13), (10, 11),       # B became a leaf, omega 0.45
        (3, 4), (1, 2),                  # A, the prompt, last
    ]
    assert [b.start for b in evicted[:3]] == [6, 4, 4]
    assert cache.total_bytes == 0 and cache.num_nodes() == 0


def test_lru_evicts_the_same_tree_least_recently_used_first():
    cache = build_tree("lru")
    assert order(cache.evict_blocks(cache.total_bytes)) == [
        (22,), (20, 21),                 # C: inserted third, never touched again
        (33,), (31, 32), (30,),          # D
        (14,), (12, 13), (10, 11),       # B, last touched when D was inserted under it
        (40, 41),                        # E, the newest leaf
        (3, 4), (1, 2),
    ]


def test_eviction_stops_once_enough_bytes_are_freed_and_the_node_keeps_its_prefix():
    cache = build_tree("omega")
    freed = cache.evict(2 * BYTES_PER_TOKEN)
    assert freed == 3 * BYTES_PER_TOKEN, "C's 1-token tail block, then its 2-token block"
    assert cache.match_prefix(C).num_tokens == 4, "C is gone, A is intact"
    assert cache.match_prefix(D_).num_tokens == len(D_)
    assert cache.match_prefix(E).num_tokens == len(E)
    cache.check_consistency()


def test_equal_omega_falls_back_to_least_recently_used():
    cache = RadixPrefixCache(1000 * BYTES_PER_TOKEN, policy="omega", block_size=2)
    cache.insert([1, 2], kv_for([1, 2]), branch_score=0.5, depth=1)
    cache.insert([3, 4], kv_for([3, 4]), branch_score=0.5, depth=1)
    cache.match_prefix([1, 2])  # [3, 4] is now the least recently used of the two
    assert order(cache.evict_blocks(1)) == [(3, 4)]


def test_with_default_scores_omega_orders_exactly_like_lru():
    caches = {}
    for policy in ("omega", "lru"):
        cache = RadixPrefixCache(1000 * BYTES_PER_TOKEN, policy=policy, block_size=2)
        for ids in (A, B, C, D_, E):
            cache.insert(ids, kv_for(ids))
        cache.match_prefix(C)
        caches[policy] = order(cache.evict_blocks(cache.total_bytes))
    assert caches["omega"] == caches["lru"]


def test_a_locked_node_and_its_ancestors_are_never_evicted_even_with_the_lowest_omega():
    cache = build_tree("omega")
    node = cache.match_prefix(C).last_node
    cache.lock(node)
    evicted = cache.evict_blocks(cache.total_bytes)
    assert order(evicted) == [(40, 41), (33,), (31, 32), (30,), (14,), (12, 13), (10, 11)]
    assert cache.match_prefix(C).num_tokens == len(C), "the locked node lost KV"
    cache.unlock(node)
    assert order(cache.evict_blocks(cache.total_bytes)) == [(22,), (20, 21), (3, 4), (1, 2)]


def test_an_insert_never_evicts_the_path_it_attaches_to():
    cache = RadixPrefixCache(10 * BYTES_PER_TOKEN, policy="omega", block_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], kv_for([1, 2, 3, 4, 5, 6]), branch_score=0.01, depth=9)
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert cache.insert(ids, kv_for(ids)) == 4, "room for 4 of the 6 new tokens; the low-omega parent stays"
    assert torch.equal(cache.match_prefix(ids).kv, kv_for(ids)[:, :, :, :10])
    assert cache.peak_bytes <= cache.budget_bytes


def test_annotate_sets_score_and_depth_on_exactly_the_given_range():
    cache = RadixPrefixCache(1000 * BYTES_PER_TOKEN, block_size=4)
    ids = list(range(1, 13))
    cache.insert(ids, kv_for(ids))
    assert cache.annotate(ids[:9], start=5, branch_score=0.25, depth=3) == 4
    first = cache.root.children[1]
    second = first.children[6]
    third = second.children[10]
    assert (first.num_tokens, second.num_tokens, third.num_tokens) == (5, 4, 3)
    assert (first.branch_score, first.depth) == (1.0, 0)
    assert (second.branch_score, second.depth) == (0.25, 3)
    assert (third.branch_score, third.depth) == (1.0, 0)
    assert torch.equal(cache.match_prefix(ids).kv, kv_for(ids))
    cache.check_consistency()


@pytest.mark.parametrize(
    "kwargs,error,fragment",
    [
        ({"cache_budget_mb": 0}, ValueError, "rsbcm.cache_budget_mb must be > 0"),
        ({"cache_budget_mb": "1"}, TypeError, "rsbcm.cache_budget_mb"),
        ({"block_size": 0}, ValueError, "rsbcm.block_size must be >= 1"),
        ({"block_size": 2.0}, TypeError, "rsbcm.block_size"),
        ({"policy": "fifo"}, ValueError, r"rsbcm.policy must be one of \['lru', 'omega'\]"),
        ({"oom_max_attempts": 0}, ValueError, "rsbcm.oom_max_attempts"),
        ({"oom_budget_shrink": 1.0}, ValueError, r"rsbcm.oom_budget_shrink must be in \(0, 1\)"),
        ({"oom_backoff_s": -1}, ValueError, "rsbcm.oom_backoff_s"),
    ],
)
def test_invalid_rsbcm_config_names_the_field_and_range(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        RSBCMConfig(**kwargs)


def test_the_engine_builds_its_cache_from_the_rsbcm_config(tiny_model, tiny_tokenizer):
    config = EngineConfig(rsbcm=RSBCMConfig(cache_budget_mb=0.5, block_size=8, policy="lru"))
    engine = RKSCEngine(tiny_model, tiny_tokenizer, config)
    assert engine.prefix_cache.budget_bytes == 512 * 1024
    assert engine.prefix_cache.block_size == 8
    assert engine.prefix_cache.policy.name == "lru"
    assert engine.stats().cache_budget_bytes == 512 * 1024


def _tiny_engine(model, tokenizer, budget_tokens=None, block_size=4, engine_kwargs=None, **rsbcm):
    budget_mb = 64.0 if budget_tokens is None else budget_tokens * TINY_BYTES_PER_TOKEN / 2**20
    config = EngineConfig(rsbcm=RSBCMConfig(cache_budget_mb=budget_mb, block_size=block_size, **rsbcm),
                          **(engine_kwargs or {}))
    return RKSCEngine(model, tokenizer, config)


def test_a_request_whose_prefix_was_partly_evicted_matches_a_cold_run(tiny_model, tiny_tokenizer):
    cold = RKSCEngine(tiny_model, tiny_tokenizer, EngineConfig(rsbcm=RSBCMConfig(enabled=False)))
    engine = _tiny_engine(tiny_model, tiny_tokenizer, budget_tokens=40, block_size=4)
    first, second = "The quick brown fox jumps over", "A lazy dog sleeps under the tree"
    probe = SamplingParams(max_new_tokens=1)  # prompt KV only, so the byte count is exact
    engine.generate(first, probe)
    assert engine.prefix_cache.total_tokens == 30
    engine.generate(second, probe)  # 32 more tokens: 22 of the first prompt's, as whole tail blocks, go
    assert engine.prefix_cache.match_prefix(engine.encode(first)).num_tokens == 8
    params = SamplingParams(max_new_tokens=16)
    again = engine.generate(first, params)
    assert again.num_cached_tokens == 8, "the surviving leading blocks should be reused"
    assert again.token_ids == cold.generate(first, params).token_ids, "recomputed KV changed the output"
    assert engine.stats().cache_peak_bytes <= engine.prefix_cache.budget_bytes
    engine.prefix_cache.check_consistency()


class InjectOOM:
    """Raises ``error`` from a decoder layer's forward, ``times`` times (mid-pass: earlier layers
    have already written the new positions into the request's cache)."""

    def __init__(self, model, times, error=torch.OutOfMemoryError, layer=1, skip=0):
        self.remaining, self.error, self.skip = times, error, skip
        self.handle = model.model.layers[layer].register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        if self.skip:
            self.skip -= 1
            return
        if self.remaining:
            self.remaining -= 1
            raise self.error("injected: out of memory")

    def remove(self):
        self.handle.remove()


@pytest.mark.parametrize("decode_attention", ["dynamic_cache", "shared_prefix"])
@pytest.mark.parametrize("error", [torch.OutOfMemoryError, MemoryError])
@pytest.mark.parametrize("skip", [0, 3], ids=["in-prefill", "in-decode"])
def test_an_oom_injected_once_is_survived_by_eviction_and_retry(tiny_model, tiny_tokenizer, error, skip, decode_attention):
    reference = RKSCEngine(tiny_model, tiny_tokenizer, EngineConfig(rsbcm=RSBCMConfig(enabled=False)))
    # Both decode caches crop their layers back after a failed pass, so a decode step is retried too.
    engine = _tiny_engine(tiny_model, tiny_tokenizer, oom_backoff_s=0,
                          engine_kwargs={"decode_attention": decode_attention})
    params = SamplingParams(max_new_tokens=12)
    engine.generate("something already cached", params)
    cached_before = engine.prefix_cache.total_bytes
    expected = reference.generate("a prompt that runs out of memory", params).token_ids
    oom = InjectOOM(tiny_model, times=1, error=error, skip=skip)
    try:
        out = engine.generate("a prompt that runs out of memory", params)
    finally:
        oom.remove()
    assert out.token_ids == expected, "the retried pass must produce the same tokens"
    stats = engine.stats()
    assert stats.oom_retries == 1
    assert stats.cache_budget_bytes < engine.prefix_cache.configured_budget_bytes, "the budget should shrink"
    assert engine.prefix_cache.evicted_tokens > 0, "the retry should have freed cache memory first"
    assert cached_before > 0
    engine.prefix_cache.check_consistency()


def test_a_persistent_oom_ends_in_a_clear_error_and_leaves_the_engine_usable(tiny_model, tiny_tokenizer):
    engine = _tiny_engine(tiny_model, tiny_tokenizer, oom_max_attempts=3, oom_backoff_s=0)
    params = SamplingParams(max_new_tokens=8)
    reference = engine.generate("kept prompt", params)
    oom = InjectOOM(tiny_model, times=10**6)
    try:
        with pytest.raises(ForwardOutOfMemoryError, match="all 3 tries") as info:
            engine.generate("a prompt that never fits", params)
    finally:
        oom.remove()
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert engine.stats().oom_retries == 2, "3 tries = 2 retries"
    cache = engine.prefix_cache
    cache.check_consistency()
    assert cache.evictable_bytes == cache.total_bytes, "a node stayed locked after the failure"
    cache.restore_budget()
    again = engine.generate("kept prompt", params)
    assert again.token_ids == reference.token_ids


class _Layer:
    """A cache layer that appends but cannot be cropped."""

    def __init__(self):
        self.length = 0

    def get_seq_length(self):
        return self.length


def test_an_oom_after_an_uncroppable_layer_was_written_is_not_retried():
    cache = type("Cache", (), {})()
    cache.layers = [_Layer(), _Layer()]
    calls = []

    def forward():
        calls.append(1)
        cache.layers[0].length += 3  # layer 0 wrote its new positions, then the pass ran out of memory
        raise torch.OutOfMemoryError("injected")

    with pytest.raises(ForwardOutOfMemoryError, match="cannot be cropped back"):
        run_with_oom_retry(forward, cache, on_oom=lambda *_: None, max_attempts=3, backoff_s=0)
    assert len(calls) == 1, "a retry would have fed the same positions twice"


def test_oom_retry_crops_each_layer_back_by_its_own_excess():
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer_idx in range(2):
        cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), layer_idx)
    attempts = []

    def forward():
        attempts.append(cache_lengths(cache))
        cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
        if len(attempts) == 1:
            raise MemoryError("injected")
        cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 1)
        return "done"

    assert run_with_oom_retry(forward, cache, on_oom=lambda *_: None, max_attempts=2, backoff_s=0) == "done"
    assert attempts == [[5, 5], [5, 5]], "the retry must start from the lengths before the failed try"
    assert cache_lengths(cache) == [8, 8]
