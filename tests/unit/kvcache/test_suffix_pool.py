"""The suffix pool: every running request's generated tokens in slots of one buffer per layer, so a
decode step writes and attends all pooled rows with one operation a layer."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    MIXED_LENGTH_PROMPTS,
    batched_attention_step,
    engine_hf_greedy,
    make_char_tokenizer,
    make_tiny_model,
)

import rksc_engine.kvcache.batch_decode as batch_decode
import rksc_engine.kvcache.shared_prefix as shared_prefix
import rksc_engine.kvcache.split_attention as split_attention
import rksc_engine.kvcache.suffix_pool as suffix_pool
from rksc_engine import EngineConfig, RKSCEngine, SamplingParams, SchedulerConfig
from rksc_engine.config import RSBCMConfig
from rksc_engine.kvcache.batch_decode import BatchDecodeCache
from rksc_engine.kvcache.shared_prefix import SharedPrefixCache
from rksc_engine.kvcache.suffix_pool import SUFFIX_ALIGNMENT, SuffixPool

NUM_KV_HEADS, HEAD_DIM, GROUP = 3, 16, 2


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


def requests_of_other_lengths(seed: int):
    """Four requests (1, 3, 2 and 1 rows) with their own prefixes and suffixes of 1 to 70 tokens,
    and their next token's KV and queries: tensors only, so each arm builds fresh caches."""
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for rows, prefix_len, suffix_len in ((1, 9, 1), (3, 17, 40), (2, 5, 70), (1, 12, 13)):
        segments = [(randn(gen, 1, NUM_KV_HEADS, prefix_len, HEAD_DIM), randn(gen, 1, NUM_KV_HEADS, prefix_len, HEAD_DIM))]
        suffix = (randn(gen, rows, NUM_KV_HEADS, suffix_len, HEAD_DIM), randn(gen, rows, NUM_KV_HEADS, suffix_len, HEAD_DIM))
        new = (randn(gen, rows, NUM_KV_HEADS, 1, HEAD_DIM), randn(gen, rows, NUM_KV_HEADS, 1, HEAD_DIM))
        query = randn(gen, rows, NUM_KV_HEADS * GROUP, 1, HEAD_DIM)
        requests.append((rows, segments, suffix, new, query))
    return requests


def pooled_cache(seed: int, rows: int, suffix_len: int, pool: SuffixPool, layers: int = 2) -> SharedPrefixCache:
    gen = torch.Generator().manual_seed(seed)
    prefix = [(randn(gen, 1, NUM_KV_HEADS, 4, HEAD_DIM), randn(gen, 1, NUM_KV_HEADS, 4, HEAD_DIM)) for _ in range(layers)]
    cache = SharedPrefixCache(prefix, rows, suffix_capacity=1)
    for layer in cache.layers:
        layer.update(randn(gen, rows, NUM_KV_HEADS, suffix_len, HEAD_DIM), randn(gen, rows, NUM_KV_HEADS, suffix_len, HEAD_DIM))
    assert pool.adopt(cache)
    return cache


def suffixes(cache: SharedPrefixCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys[:, :, :layer.num_suffix_tokens].clone(), layer.values[:, :, :layer.num_suffix_tokens].clone())
            for layer in cache.layers]


def assert_same_suffixes(got, want):
    assert len(got) == len(want)
    for (gk, gv), (wk, wv) in zip(got, want):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)


# -- attention ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_pooled_attention_equals_each_request_attending_to_its_own_suffix(seed):
    requests = requests_of_other_lengths(seed)
    want = batched_attention_step(requests, GROUP)
    got = batched_attention_step(requests, GROUP, pool=SuffixPool(128))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_a_pooled_request_is_bit_identical_alone_and_among_requests_of_other_lengths(seed, one_thread):
    """Alone, a request's keys are padded to its own length's multiple of SUFFIX_ALIGNMENT; among
    others, to the longest row's. The masked padding must not change a bit of its rows."""
    requests = requests_of_other_lengths(seed)
    together = batched_attention_step(requests, GROUP, pool=SuffixPool(128))
    alone = torch.cat([batched_attention_step([request], GROUP, pool=SuffixPool(128)) for request in requests])
    assert torch.equal(together, alone)


def test_a_step_of_pooled_requests_makes_one_suffix_call_and_one_write_a_layer(monkeypatch):
    """Four requests decoding together: one suffix attention call and one KV write per layer and step,
    where buffers of their own take one of each per request."""
    calls = {"pooled": 0, "own": 0}
    pooled_attention, own_update = batch_decode.pooled_suffix_attention, shared_prefix.SharedPrefixLayer.update

    def counted_pooled(*args, **kwargs):
        calls["pooled"] += 1
        return pooled_attention(*args, **kwargs)

    def counted_own(layer, *args, **kwargs):
        calls["own"] += 1
        return own_update(layer, *args, **kwargs)

    monkeypatch.setattr(batch_decode, "pooled_suffix_attention", counted_pooled)
    monkeypatch.setattr(shared_prefix.SharedPrefixLayer, "update", counted_own)
    engine = RKSCEngine(make_tiny_model(0), make_char_tokenizer(), EngineConfig(decode_attention="shared_prefix"))
    params = SamplingParams(max_new_tokens=6)
    with engine.exclusive():  # all four admitted in one step, then stepped here one by one
        handles = [engine.submit(prompt, 1, params) for prompt in MIXED_LENGTH_PROMPTS[:4]]
        engine.scheduler.step()  # the prefill and the first tokens
        steps = 0
        calls.update(pooled=0, own=0)
        while not all(h.done() for h in handles):
            engine.scheduler.step()
            steps += 1
    num_layers = engine.model.config.num_hidden_layers
    assert steps >= 4
    assert calls == {"pooled": steps * num_layers, "own": 0}


# -- the engine -----------------------------------------------------------------------------------
def test_pooled_requests_decode_the_tokens_of_requests_with_buffers_of_their_own():
    """Greedy and sampled requests of different lengths and branch counts, some past the pool's
    capacity (it grows) and one past its limit (it leaves for buffers of its own), admitted together
    and one by one: the same tokens as with every suffix apart, and greedy ones as transformers."""
    model, tokenizer = make_tiny_model(0), make_char_tokenizer()
    work = [(prompt, n, SamplingParams(temperature=0.0 if n == 1 else 0.9, seed=i, max_new_tokens=tokens))
            for i, (prompt, n, tokens) in enumerate(zip(MIXED_LENGTH_PROMPTS, (1, 3, 2, 1, 4), (20, 90, 140, 70, 8)))]

    def run(max_pooled: int) -> list:
        engine = RKSCEngine(model, tokenizer, EngineConfig(
            decode_attention="shared_prefix", scheduler=SchedulerConfig(max_pooled_suffix_tokens=max_pooled)))
        with engine.exclusive():
            together = [engine.submit(prompt, n, params) for prompt, n, params in work]
        got = [[c.token_ids for c in h.result(timeout=120)] for h in together]
        engine.clear_cache()
        staggered = [engine.submit(prompt, n, params) for prompt, n, params in work]  # the scheduler runs meanwhile
        got += [[c.token_ids for c in h.result(timeout=120)] for h in staggered]
        pool = engine.scheduler.kv.suffix_pool
        if pool is not None:
            with engine.exclusive():
                assert pool.num_members == 0 and pool.num_slots == 0, "the pool kept memory after the requests ended"
        return got, engine

    apart, _ = run(0)
    pooled, engine = run(128)  # the 140-token request outgrows it
    assert pooled == apart
    for (prompt, n, params), tokens in zip(work, pooled):
        if n == 1:
            assert tuple(tokens[0]) == engine_hf_greedy(engine, prompt, params.max_new_tokens)
    engine.prefix_cache.check_consistency()


def test_out_of_memory_while_the_pool_grows_in_a_step_moves_the_request_to_its_own_buffers(monkeypatch):
    """A pool of every slot at the longer length does not fit: the request that needs it takes
    buffers of its own (its rows only), and the step goes on without a retry or a preemption."""
    model, tokenizer = make_tiny_model(0), make_char_tokenizer()
    params = SamplingParams(max_new_tokens=80)  # past the pool's first capacity of 64
    prompts = MIXED_LENGTH_PROMPTS[:2]
    config = EngineConfig(decode_attention="shared_prefix", rsbcm=RSBCMConfig(oom_backoff_s=0.0))
    engine = RKSCEngine(model, tokenizer, config)
    want = [[c.token_ids for c in engine.generate_branches(p, 2, params)] for p in prompts]
    engine.clear_cache()
    rebuild = SuffixPool._rebuild
    fired = []

    def fails_once_when_growing(pool, members, slots, capacity, template=None):
        if pool.keys and capacity > pool.capacity and not fired:
            fired.append(capacity)
            raise torch.OutOfMemoryError("simulated: no memory for a longer pool")
        return rebuild(pool, members, slots, capacity, template)

    monkeypatch.setattr(SuffixPool, "_rebuild", fails_once_when_growing)
    with engine.exclusive():
        handles = [engine.submit(p, 2, params) for p in prompts]
    got = [[c.token_ids for c in h.result(timeout=120)] for h in handles]
    assert fired, "test setup: the pool never grew"
    assert got == want
    assert engine.stats().oom_retries == 0 and engine.stats().extra.get("preemptions", 0) == 0


def test_out_of_memory_when_leaving_the_pool_too_is_retried_to_the_same_tokens(monkeypatch):
    model, tokenizer = make_tiny_model(0), make_char_tokenizer()
    params = SamplingParams(max_new_tokens=80)
    prompts = MIXED_LENGTH_PROMPTS[:2]
    config = EngineConfig(decode_attention="shared_prefix", rsbcm=RSBCMConfig(oom_backoff_s=0.0))
    engine = RKSCEngine(model, tokenizer, config)
    want = [[c.token_ids for c in engine.generate_branches(p, 2, params)] for p in prompts]
    engine.clear_cache()
    rebuild, release = SuffixPool._rebuild, SuffixPool.release
    fired = []

    def grow_fails_once(pool, members, slots, capacity, template=None):
        if pool.keys and capacity > pool.capacity and len(fired) < 1:
            fired.append("grow")
            raise torch.OutOfMemoryError("simulated: no memory for a longer pool")
        return rebuild(pool, members, slots, capacity, template)

    def leave_fails_once(pool, cache, keep_capacity=None):
        if keep_capacity is not None and len(fired) == 1:
            fired.append("leave")
            raise torch.OutOfMemoryError("simulated: no memory for buffers of its own")
        return release(pool, cache, keep_capacity)

    monkeypatch.setattr(SuffixPool, "_rebuild", grow_fails_once)
    monkeypatch.setattr(SuffixPool, "release", leave_fails_once)
    with engine.exclusive():
        handles = [engine.submit(p, 2, params) for p in prompts]
    got = [[c.token_ids for c in h.result(timeout=120)] for h in handles]
    assert fired == ["grow", "leave"], "test setup: the faults did not fire"
    assert got == want
    assert engine.stats().oom_retries == 1, "the step must be retried once, in place, not preempted"
    assert engine.stats().extra.get("preemptions", 0) == 0


def test_reused_slots_are_cleared_so_an_ended_requests_values_cannot_reach_the_next():
    pool = SuffixPool(256)
    stays = pooled_cache(0, 1, 3, pool)
    ended = pooled_cache(1, 2, 5, pool)
    for layer in ended.layers:  # what an overflowing request (fp16) might leave past its tokens
        layer.keys[:, :, 5:].fill_(float("inf"))
        layer.values[:, :, 5:].fill_(float("nan"))
    pool.release(ended)
    newcomer = pooled_cache(2, 2, 4, pool)
    assert (stays.pool_slot, newcomer.pool_slot, pool.num_slots) == (0, 1, 4), "test setup: the slots were not reused"
    for keys, values in zip(pool.keys, pool.values):
        assert torch.isfinite(keys[1:3]).all() and torch.isfinite(values[1:3]).all()


# -- the pool's bookkeeping ---------------------------------------------------------------------
def test_adoption_moves_the_suffix_into_views_of_the_pool():
    pool = SuffixPool(256)
    gen = torch.Generator().manual_seed(0)
    prefix = [(randn(gen, 1, NUM_KV_HEADS, 4, HEAD_DIM),) * 2]
    cache = SharedPrefixCache(prefix, 2, suffix_capacity=1)
    cache.layers[0].update(randn(gen, 2, NUM_KV_HEADS, 5, HEAD_DIM), randn(gen, 2, NUM_KV_HEADS, 5, HEAD_DIM))
    before = suffixes(cache)
    assert pool.adopt(cache)
    assert cache.suffix_pool is pool and cache.pool_slot == 0
    layer = cache.layers[0]
    assert layer.keys.untyped_storage().data_ptr() == pool.keys[0].untyped_storage().data_ptr()
    assert_same_suffixes(suffixes(cache), before)
    layer.update(torch.ones(2, NUM_KV_HEADS, 1, HEAD_DIM), torch.ones(2, NUM_KV_HEADS, 1, HEAD_DIM))
    assert torch.equal(pool.keys[0][:2, :, 5], torch.ones(2, NUM_KV_HEADS, HEAD_DIM)), "a write missed the pool"


class _RoomRecorder:
    """Stands in for a pool: records each request for room and answers it by sending the cache to
    buffers of its own, as a pool past its limit does."""

    def __init__(self):
        self.asked = []

    def make_room(self, cache, needed):
        self.asked.append((cache, needed))
        cache.detach_pool(keep_capacity=needed)


def test_a_cache_binds_the_slot_views_it_is_given_and_detaches_into_buffers_of_its_own():
    gen = torch.Generator().manual_seed(3)
    prefix = [(randn(gen, 1, NUM_KV_HEADS, 4, HEAD_DIM),) * 2 for _ in range(2)]
    cache = SharedPrefixCache(prefix, 2, suffix_capacity=1)
    for layer in cache.layers:
        layer.update(randn(gen, 2, NUM_KV_HEADS, 3, HEAD_DIM), randn(gen, 2, NUM_KV_HEADS, 3, HEAD_DIM))
    before = suffixes(cache)
    slot_keys = [torch.zeros(4, NUM_KV_HEADS, 8, HEAD_DIM) for _ in cache.layers]  # 4 slots of 8 tokens
    slot_values = [torch.zeros(4, NUM_KV_HEADS, 8, HEAD_DIM) for _ in cache.layers]
    for layer, keys, values in zip(cache.layers, slot_keys, slot_values):
        layer.copy_suffix_into(keys[1:3], values[1:3])
    pool = _RoomRecorder()
    cache.attach_pool_slot(pool, 1, [keys[1:3] for keys in slot_keys], [values[1:3] for values in slot_values])
    assert cache.suffix_pool is pool and cache.pool_slot == 1
    assert_same_suffixes(suffixes(cache), before)
    new = torch.full((2, NUM_KV_HEADS, 1, HEAD_DIM), 5.0)
    cache.layers[0].update(new, new)
    assert torch.equal(slot_keys[0][1:3, :, 3:4], new), "a write into an attached cache missed its slots"
    more = torch.full((2, NUM_KV_HEADS, 6, HEAD_DIM), 7.0)
    cache.layers[1].update(more, more)  # 3 + 6 tokens: past the slots' 8, so the cache asks for room
    assert pool.asked == [(cache, 9)], "a write past the slots' room did not ask the pool"
    assert cache.suffix_pool is None and cache.pool_slot is None
    for layer, keys in zip(cache.layers, slot_keys):
        assert layer.keys.untyped_storage().data_ptr() != keys.untyped_storage().data_ptr(), "still in the slots"
        assert layer.keys.shape[2] >= 9 and layer.on_grow is None
    (keys0, values0), (keys1, values1) = suffixes(cache)
    assert torch.equal(keys0[:, :, :3], before[0][0]) and torch.equal(keys0[:, :, 3:], new)
    assert torch.equal(values1[:, :, :3], before[1][1]) and torch.equal(values1[:, :, 3:], more)
    cache.detach_pool()
    assert all(layer.keys.shape[2] == 0 and layer.values.shape[2] == 0 for layer in cache.layers)


def test_growing_past_the_capacity_rebinds_every_member_with_its_tokens():
    pool = SuffixPool(512)
    first, second = pooled_cache(0, 2, 10, pool), pooled_cache(1, 3, 60, pool)
    want = [suffixes(first), suffixes(second)]
    assert pool.capacity == SUFFIX_ALIGNMENT
    extra = torch.full((3, NUM_KV_HEADS, 10, HEAD_DIM), 2.0)
    for layer in second.layers:
        layer.update(extra, extra)  # 70 tokens: the pool doubles
    assert pool.capacity == 2 * SUFFIX_ALIGNMENT
    assert_same_suffixes(suffixes(first), want[0])
    for (keys, values), (old_keys, old_values) in zip(suffixes(second), want[1]):
        assert torch.equal(keys[:, :, :60], old_keys) and torch.equal(keys[:, :, 60:], extra)
        assert torch.equal(values[:, :, :60], old_values) and torch.equal(values[:, :, 60:], extra)
    assert (second.pool_slot, first.pool_slot) == (2, 0)


def test_a_request_past_the_limit_leaves_the_pool_with_its_tokens():
    pool = SuffixPool(SUFFIX_ALIGNMENT)
    stays, leaves = pooled_cache(0, 1, 5, pool), pooled_cache(1, 2, 60, pool)
    want = suffixes(leaves)
    extra = torch.zeros(2, NUM_KV_HEADS, 8, HEAD_DIM)
    for layer in leaves.layers:
        layer.update(extra, extra)
    assert leaves.suffix_pool is None and stays.suffix_pool is pool
    assert leaves.layers[0].keys.untyped_storage().data_ptr() != pool.keys[0].untyped_storage().data_ptr()
    for (keys, _), (old_keys, _) in zip(suffixes(leaves), want):
        assert torch.equal(keys[:, :, :60], old_keys) and keys.shape[2] == 68
    assert pool.capacity == SUFFIX_ALIGNMENT, "one long request must not lengthen every slot"


def test_freed_slots_are_reclaimed_in_order_when_the_pool_runs_out():
    pool = SuffixPool(256)
    caches = [pooled_cache(i, rows, 3 + i, pool) for i, rows in enumerate((2, 1, 1))]  # 4 slots, all used
    assert pool.num_slots == 4
    pool.release(caches[0])
    kept = [suffixes(c) for c in caches[1:]]
    newcomer = pooled_cache(7, 2, 4, pool)  # two slots free at the front: packed, not grown
    assert pool.num_slots == 4
    assert [c.pool_slot for c in (*caches[1:], newcomer)] == [0, 1, 2]
    for cache, want in zip(caches[1:], kept):
        assert_same_suffixes(suffixes(cache), want)


def test_dropped_branches_leave_a_hole_the_next_step_reads_around(one_thread):
    """A pooled request drops a finished branch (its slots shrink); the request after it in the
    pool is then not adjacent, so the step takes two pooled calls, and both match the unpooled step."""
    pool = SuffixPool(256)
    a, b = pooled_cache(0, 3, 6, pool, layers=1), pooled_cache(1, 2, 9, pool, layers=1)
    plain = []
    for cache in (a, b):
        copy = SharedPrefixCache([cache.layers[0].segments[0]], cache.layers[0].keys.shape[0], suffix_capacity=1)
        copy.layers[0].update(*suffixes(cache)[0])
        plain.append(copy)
    keep = torch.tensor([2, 0])
    a.batch_select_indices(keep)
    plain[0].batch_select_indices(keep)
    gen = torch.Generator().manual_seed(5)
    new = randn(gen, 4, NUM_KV_HEADS, 1, HEAD_DIM)
    query = randn(gen, 4, NUM_KV_HEADS * GROUP, 1, HEAD_DIM)
    outs = []
    for caches in ([a, b], plain):
        batch = BatchDecodeCache(caches)
        keys, values = batch.layers[0].update(new, -new)
        out, _ = shared_prefix.shared_prefix_attention(_Module(), query, keys, values, None, **batch.forward_kwargs())
        outs.append(out)
        if caches[0] is a:
            assert len(batch.layers[0].pooled_runs) == 2
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


class _Module(torch.nn.Module):
    layer_idx = 0
    num_key_value_groups = GROUP


def test_an_idle_pool_gives_its_memory_back():
    pool = SuffixPool(256)
    caches = [pooled_cache(i, 2, 3, pool) for i in range(2)]
    pool.release(caches[0])
    assert pool.num_slots == 4
    pool.release(caches[1])
    assert pool.num_slots == 0 and pool.keys == []


def test_a_cache_whose_layers_differ_from_the_pools_stays_out():
    pool = SuffixPool(256)
    pooled_cache(0, 1, 3, pool, layers=2)
    other = SharedPrefixCache([(torch.zeros(1, NUM_KV_HEADS, 2, HEAD_DIM),) * 2], 1, suffix_capacity=1)
    assert not pool.adopt(other) and other.suffix_pool is None


@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), (10, ValueError), (True, TypeError), (1.5, TypeError)])
def test_bad_pool_limits_are_refused(value, error):
    with pytest.raises(error, match="max_pooled_suffix_tokens"):
        SchedulerConfig(max_pooled_suffix_tokens=value)
    with pytest.raises(error, match="max_tokens"):
        SuffixPool(value)


def test_the_padding_is_a_multiple_of_the_alignment():
    mask = suffix_pool.suffix_mask([1, 64, 65], torch.device("cpu"))
    assert mask.shape == (3, 1, 1, 2 * SUFFIX_ALIGNMENT)
    assert [int(torch.isfinite(row).sum()) for row in mask[:, 0, 0]] == [1, 64, 65]


def test_the_unfused_pooled_call_equals_the_fused_one():
    """Off the CPU kernel (another device, or ``fused=False``) the pooled call masks the padding itself."""
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 30, 64, 65]
    mask = suffix_pool.suffix_mask(lengths, torch.device("cpu"))
    padded = mask.shape[-1]
    query = randn(gen, 4, NUM_KV_HEADS, GROUP, HEAD_DIM)
    keys, values = randn(gen, 4, NUM_KV_HEADS, padded, HEAD_DIM), randn(gen, 4, NUM_KV_HEADS, padded, HEAD_DIM)
    fused = suffix_pool.pooled_suffix_attention(query, keys, values, mask, HEAD_DIM ** -0.5, True)
    unfused = suffix_pool.pooled_suffix_attention(query, keys, values, mask, HEAD_DIM ** -0.5, False)
    torch.testing.assert_close(unfused, fused, rtol=1e-5, atol=1e-6)
    for row, length in enumerate(lengths):  # each row against its own keys only, unpadded
        out, lse = split_attention.partial_attention(query[row:row + 1], keys[row:row + 1, :, :length],
                                                     values[row:row + 1, :, :length], HEAD_DIM ** -0.5)
        torch.testing.assert_close(fused[0][row:row + 1], out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fused[1][row:row + 1], lse, rtol=1e-5, atol=1e-6)


def test_growing_sizes_the_pool_to_the_rows_that_live_and_a_released_cache_keeps_none_of_it():
    """After most requests ended, a longer pool holds only the living rows' slots: a preemption that
    freed rows must make the next try smaller, not ask for every slot of the high-water mark again."""
    pool = SuffixPool(512)
    caches = [pooled_cache(i, 2, 3, pool) for i in range(4)]
    assert pool.num_slots == 8
    for cache in caches[1:]:
        pool.release(cache)
    assert all(layer.keys.untyped_storage().data_ptr() != pool.keys[0].untyped_storage().data_ptr()
               for cache in caches[1:] for layer in cache.layers), "a released cache still views the pool"
    extra = torch.zeros(2, NUM_KV_HEADS, 70, HEAD_DIM)
    for layer in caches[0].layers:
        layer.update(extra, extra)
    assert (pool.num_slots, pool.capacity) == (2, 2 * SUFFIX_ALIGNMENT)
