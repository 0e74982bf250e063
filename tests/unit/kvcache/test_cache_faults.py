"""Out of memory in the middle of a cache operation: the shared-prefix caches and the radix cache are
left consistent and usable, so the engine's roll-back and retry (or the scheduler's preemption)
goes on with the same tokens as if nothing had failed."""

import functools

import pytest
import torch
from conftest import RADIX_BYTES_PER_TOKEN as BYTES_PER_TOKEN
from conftest import make_char_tokenizer, make_tiny_model, radix_kv

import rksc_engine.kvcache.radix as prefix_cache
import rksc_engine.kvcache.shared_prefix as shared_prefix
from rksc_engine import EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.config import RSBCMConfig, SchedulerConfig
from rksc_engine.kvcache.batch_decode import BatchDecodeCache
from rksc_engine.kvcache.memory import run_with_oom_retry
from rksc_engine.kvcache.radix import RadixPrefixCache
from rksc_engine.kvcache.shared_prefix import SharedPrefixCache, SharedPrefixLayer

NUM_KV_HEADS, HEAD_DIM = 2, 4


class FailingGrowAllocation:
    """Makes the ``nth`` buffer allocation inside ``SharedPrefixLayer._grow`` (counted from 1 over all
    layers and requests: keys, then values, of each layer that grows) raise ``torch.OutOfMemoryError``,
    once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, nth: int) -> None:
        self.nth, self.count, self.fired, self._inside = nth, 0, False, False
        grow, empty = SharedPrefixLayer._grow, torch.empty

        def guarded_grow(layer, needed):
            self._inside = True
            try:
                return grow(layer, needed)
            finally:
                self._inside = False

        def empty_or_fail(*args, **kwargs):
            if self._inside:
                self.count += 1
                if self.count == self.nth:
                    self.fired = True
                    raise torch.OutOfMemoryError("simulated: no memory for a larger suffix buffer")
            return empty(*args, **kwargs)

        monkeypatch.setattr(SharedPrefixLayer, "_grow", guarded_grow)
        monkeypatch.setattr(torch, "empty", empty_or_fail)


def request_cache(seed: int, num_branches: int, capacity: int, prefix_len: int = 3) -> SharedPrefixCache:
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randn(1, NUM_KV_HEADS, prefix_len, HEAD_DIM, generator=generator)
    return SharedPrefixCache([(prefix, prefix + 1)], num_branches, suffix_capacity=capacity)


def decode_step(cache: BatchDecodeCache, step_kv: torch.Tensor) -> None:
    """What a model forward does to the cache: one update of every layer (here one), with the rows'
    new KV (B, H_kv, 1, D)."""
    cache.layers[0].update(step_kv, step_kv * 2)


def run_steps(caches: list[SharedPrefixCache], steps: list[torch.Tensor]) -> None:
    for step_kv in steps:
        batch = BatchDecodeCache(caches)  # built afresh each step, as the scheduler does
        run_with_oom_retry(functools.partial(decode_step, batch, step_kv), batch, on_oom=lambda *_: None,
                           max_attempts=2, backoff_s=0)


def suffixes(caches: list[SharedPrefixCache]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = [cache.layers[0] for cache in caches]
    return [(layer.keys[:, :, :layer.num_suffix_tokens], layer.values[:, :, :layer.num_suffix_tokens])
            for layer in layers]


# -- the shared-prefix caches -----------------------------------------------------------------------
@pytest.mark.parametrize("nth", [1, 2, 3, 4], ids=["first-keys", "first-values", "second-keys", "second-values"])
def test_a_batch_step_that_runs_out_of_memory_growing_a_buffer_is_rolled_back_request_by_request(monkeypatch, nth):
    steps = [torch.randn(4, NUM_KV_HEADS, 1, HEAD_DIM, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    want = [request_cache(0, 2, capacity=2), request_cache(1, 2, capacity=2)]
    run_steps(want, steps)
    got = [request_cache(0, 2, capacity=2), request_cache(1, 2, capacity=2)]
    failure = FailingGrowAllocation(monkeypatch, nth)
    run_steps(got, steps)  # the third step grows both requests' buffers; one allocation fails
    assert failure.fired, "test setup: the allocation never failed"
    for g, w in zip(suffixes(got), suffixes(want)):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg="the retried step left different suffixes")
    for cache in got:
        layer = cache.layers[0]
        assert layer.keys.shape == layer.values.shape, "keys and values grew to different capacities"
        assert layer.num_suffix_tokens == len(steps)


def test_crop_returns_each_request_to_its_own_length_when_the_update_stopped_part_way(monkeypatch):
    first, second = request_cache(0, 1, capacity=4), request_cache(1, 3, capacity=1)
    batch = BatchDecodeCache([first, second])
    decode_step(batch, torch.randn(4, NUM_KV_HEADS, 1, HEAD_DIM))  # the second request's buffer is full now
    layer = batch.layers[0]
    before = layer.get_seq_length()
    FailingGrowAllocation(monkeypatch, 1)
    with pytest.raises(torch.OutOfMemoryError):
        decode_step(batch, torch.randn(4, NUM_KV_HEADS, 1, HEAD_DIM))
    assert layer.get_seq_length() == before + 1, "test setup: only the first request took the new position"
    layer.crop(-1)
    assert [first.layers[0].num_suffix_tokens, second.layers[0].num_suffix_tokens] == [1, 1]


def test_crop_of_whole_steps_takes_an_equal_share_from_every_request():
    caches = [request_cache(0, 2, capacity=4), request_cache(1, 2, capacity=4)]
    batch = BatchDecodeCache(caches)
    for _ in range(3):
        decode_step(batch, torch.randn(4, NUM_KV_HEADS, 1, HEAD_DIM))
    batch.layers[0].crop(-4)
    assert [c.layers[0].num_suffix_tokens for c in caches] == [1, 1]
    with pytest.raises(ValueError, match="evenly"):
        batch.layers[0].crop(-1)


def test_out_of_memory_while_dropping_finished_branches_leaves_both_buffers_as_they_were(monkeypatch):
    cache = request_cache(0, 4, capacity=4)
    layer = cache.layers[0]
    suffix = torch.randn(4, NUM_KV_HEADS, 2, HEAD_DIM)
    layer.update(suffix, suffix * 2)
    keep = torch.tensor([3, 1])
    original = torch.Tensor.__getitem__
    calls = []

    def values_gather_fails(tensor, index):
        if isinstance(index, tuple) and index and index[0] is keep:
            calls.append(tensor)
            if len(calls) == 2:  # the values' gather: the keys' has been taken
                raise torch.OutOfMemoryError("simulated: no memory to gather the kept rows")
        return original(tensor, index)

    monkeypatch.setattr(torch.Tensor, "__getitem__", values_gather_fails)
    with pytest.raises(torch.OutOfMemoryError):
        cache.batch_select_indices(keep)
    monkeypatch.undo()
    assert len(calls) == 2, "test setup: the values' gather was not reached"
    torch.testing.assert_close(layer.keys[:, :, :2], suffix, rtol=0, atol=0, msg="the keys' rows moved")
    torch.testing.assert_close(layer.values[:, :, :2], suffix * 2, rtol=0, atol=0, msg="the values' rows moved")
    cache.batch_select_indices(keep)
    torch.testing.assert_close(layer.keys[:, :, :2], suffix[keep], rtol=0, atol=0)
    torch.testing.assert_close(layer.values[:, :, :2], suffix[keep] * 2, rtol=0, atol=0)


@pytest.mark.parametrize("nth", [2, 3, 4], ids=["first-values", "second-keys", "second-values"])
def test_concurrent_requests_whose_suffix_cannot_grow_are_retried_to_the_tokens_they_get_without_the_fault(
        monkeypatch, nth):
    monkeypatch.setattr(shared_prefix, "MAX_INITIAL_SUFFIX_CAPACITY", 2)  # the third decode step grows
    # Each request's suffix in buffers of its own (the pool's growth is tested below).
    engine = RKSCEngine(make_tiny_model(0), make_char_tokenizer(),
                        EngineConfig(decode_attention="shared_prefix", rsbcm=RSBCMConfig(oom_backoff_s=0.0),
                                     scheduler=SchedulerConfig(max_pooled_suffix_tokens=0)))
    params = SamplingParams(max_new_tokens=8)
    prompts = ["The quick brown fox jumps over", "Q: what is 2+3?\nA:"]
    want = [[c.token_ids for c in engine.generate_branches(p, 2, params)] for p in prompts]
    engine.clear_cache()
    failure = FailingGrowAllocation(monkeypatch, nth)
    with engine.exclusive():  # both admitted in the same step, so they decode in one batch
        handles = [engine.submit(p, 2, params) for p in prompts]
    got = [[c.token_ids for c in h.result(timeout=60)] for h in handles]
    assert failure.fired, "test setup: the allocation never failed"
    assert engine.stats().peak_batch_rows == 4, "test setup: the requests did not decode together"
    assert got == want, "a decode step retried after running out of memory changed the tokens"
    assert engine.stats().oom_retries == 1, "the step must be retried once, in place, not preempted"
    engine.prefix_cache.check_consistency()


# -- the radix cache --------------------------------------------------------------------------------
def test_out_of_memory_while_compacting_keeps_the_old_memory_counted_and_the_next_eviction_frees_it(monkeypatch):
    cache = RadixPrefixCache(1000 * BYTES_PER_TOKEN, policy="lru", block_size=4)
    ids = list(range(1, 9))
    cache.insert(ids, radix_kv(ids))
    cache.match_prefix(ids[:4] + [99])  # splits the node: both parts view one memory
    cache.match_prefix(ids[:4])  # the upper part is now the more recently used

    def no_memory(tensor):
        raise torch.OutOfMemoryError("simulated: no memory for the compacted copy")

    monkeypatch.setattr(prefix_cache, "_own", no_memory)
    freed = cache.evict(4 * BYTES_PER_TOKEN)  # the lower part goes; its bytes stay in the upper's memory
    assert freed == 0, "nothing was freed while the upper part still views the whole memory"
    assert cache.total_bytes == 8 * BYTES_PER_TOKEN, "total_bytes must count the memory still held"
    assert torch.equal(cache.match_prefix(ids).kv, radix_kv(ids)[:, :, :, :4])
    cache.check_consistency()
    monkeypatch.undo()
    cache.evict(0)  # drops nothing, but tries the compaction again
    assert cache.total_bytes == 4 * BYTES_PER_TOKEN
    assert cache.root.children[1].storage.untyped_storage().nbytes() == 4 * BYTES_PER_TOKEN
    cache.check_consistency()
