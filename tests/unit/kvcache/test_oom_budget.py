"""Out of memory: the prefix cache's budget shrinks relative to the budget (with a floor), never
below what running requests hold locked, grows back step by step, and CPU allocation failures
count as out of memory."""

import pytest
import torch
from conftest import RADIX_BYTES_PER_TOKEN as BYTES_PER_TOKEN
from conftest import radix_kv

from rksc_engine import EngineConfig, ForwardOutOfMemoryError, RKSCEngine, SamplingParams
from rksc_engine.config import RSBCMConfig
from rksc_engine.kvcache.memory import is_out_of_memory, run_with_oom_retry
from rksc_engine.kvcache.radix import RadixPrefixCache

GIB = 1 << 30
CPU_OOM = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
           "you tried to allocate 140737488355328 bytes. Error code 12 (Cannot allocate memory)")


def filled_cache(budget_bytes: int, *sequences: list[int], block_size: int = 4) -> RadixPrefixCache:
    cache = RadixPrefixCache(budget_bytes, policy="lru", block_size=block_size)
    for ids in sequences:
        cache.insert(ids, radix_kv(ids))
    return cache


# -- shrinking --------------------------------------------------------------------------------------
def test_one_oom_on_an_empty_cache_halves_the_budget_instead_of_leaving_one_byte():
    cache = RadixPrefixCache(GIB)
    cache.shrink_budget(0.5)
    assert cache.budget_bytes == GIB // 2


def test_repeated_shrinks_stop_at_the_floor_given():
    cache = RadixPrefixCache(GIB)
    for _ in range(40):
        cache.shrink_budget(0.5, min_budget_bytes=10_000)
    assert cache.budget_bytes == 10_000, "the budget must stop at min_budget_bytes, not shrink towards 0"


def test_the_default_floor_is_one_block_of_the_kv_the_cache_has_seen():
    cache = filled_cache(GIB, list(range(1, 9)), block_size=4)
    cache.clear()
    for _ in range(40):
        cache.shrink_budget(0.5)
    assert cache.budget_bytes == 4 * BYTES_PER_TOKEN


def test_a_floor_above_the_configured_budget_is_capped_and_never_raises_the_budget():
    cache = RadixPrefixCache(1000)
    cache.shrink_budget(0.5, min_budget_bytes=10**9)
    assert cache.budget_bytes == 1000, "a floor must not lift the budget above what it was"


def test_a_shrink_frees_unlocked_memory_now_even_when_the_budget_is_far_above_it():
    cache = filled_cache(GIB, list(range(1, 33)))  # 32 tokens, 8 blocks of 4
    held = cache.total_bytes
    freed = cache.shrink_budget(0.5)
    assert freed >= held // 2 and cache.total_bytes <= held // 2, "the retry needs memory freed, not a lower ceiling"
    cache.check_consistency()


def test_after_a_shrink_with_a_locked_prefix_the_cache_holds_no_more_than_its_budget():
    a = list(range(1, 33))
    b = list(range(100, 164))
    cache = filled_cache(100 * BYTES_PER_TOKEN, a, b)
    node = cache.match_prefix(a).last_node
    cache.lock(node)  # a running request uses a's KV
    locked = cache.locked_bytes
    assert locked == 32 * BYTES_PER_TOKEN
    for _ in range(6):
        cache.shrink_budget(0.5)
        assert cache.total_bytes <= cache.budget_bytes, (
            f"cache_bytes {cache.total_bytes} above the budget {cache.budget_bytes} after an OOM shrink")
    assert cache.budget_bytes == locked, "the budget must stop at the locked bytes, not below them"
    assert cache.match_prefix(a).num_tokens == len(a), "locked KV was evicted"
    cache.unlock(node)
    cache.check_consistency()


@pytest.mark.parametrize("factor", [0, 1, 1.5, -0.5, True, "0.5"])
def test_a_bad_shrink_factor_is_refused(factor):
    with pytest.raises(ValueError, match=r"factor must be a number in \(0, 1\)"):
        RadixPrefixCache(GIB).shrink_budget(factor)


@pytest.mark.parametrize("floor", [0, -1, 2.5, True])
def test_a_bad_floor_is_refused(floor):
    with pytest.raises(ValueError, match="min_budget_bytes must be an int >= 1"):
        RadixPrefixCache(GIB).shrink_budget(0.5, min_budget_bytes=floor)


# -- growing back -----------------------------------------------------------------------------------
def test_relax_budget_grows_step_by_step_up_to_the_configured_budget():
    cache = RadixPrefixCache(GIB)
    for _ in range(4):
        cache.shrink_budget(0.5)
    assert cache.budget_bytes == GIB // 16
    assert cache.relax_budget(2.0) == GIB // 8
    assert cache.relax_budget(2.0) == GIB // 4
    for _ in range(5):
        cache.relax_budget(2.0)
    assert cache.budget_bytes == GIB, "the budget must never grow past the configured one"


def test_relax_budget_moves_even_a_one_byte_budget():
    cache = RadixPrefixCache(100)
    cache.set_budget(1)
    assert cache.relax_budget(1.5) == 2


@pytest.mark.parametrize("factor", [1, 0.5, float("inf"), float("nan"), True])
def test_a_bad_relax_factor_is_refused(factor):
    with pytest.raises(ValueError, match="factor must be a finite number > 1"):
        RadixPrefixCache(GIB).relax_budget(factor)


def test_clear_goes_back_to_the_configured_budget():
    cache = filled_cache(GIB, list(range(1, 17)))
    cache.shrink_budget(0.25)
    cache.clear()
    assert cache.budget_bytes == GIB and cache.total_bytes == 0


@pytest.mark.parametrize("value,error,message", [
    (1, ValueError, r"rsbcm.oom_budget_restore must be in \(1, 1024\], got 1"),
    (2000, ValueError, "rsbcm.oom_budget_restore must be in"),
    (float("nan"), ValueError, "rsbcm.oom_budget_restore"),
    ("2", TypeError, "rsbcm.oom_budget_restore must be int or float"),
])
def test_the_restore_factor_is_validated(value, error, message):
    with pytest.raises(error, match=message):
        RSBCMConfig(oom_budget_restore=value)
    assert RSBCMConfig().oom_budget_restore == 2.0


# -- what counts as out of memory -------------------------------------------------------------------
def test_a_cpu_allocation_failure_counts_as_out_of_memory():
    try:
        torch.empty(2**46)  # 256 TiB, past any address space: the CPU allocator refuses it
    except RuntimeError as real:
        assert is_out_of_memory(real), f"not recognised: {real}"
    assert is_out_of_memory(RuntimeError(CPU_OOM))
    assert is_out_of_memory(MemoryError()) and is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ForwardOutOfMemoryError(f"all 3 tries; last error: {CPU_OOM}"))
    assert not is_out_of_memory(ValueError("can't allocate memory"))


def test_the_retry_path_retries_a_cpu_allocation_failure_and_nothing_else():
    calls, frees = [], []

    def forward():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(CPU_OOM)
        return "done"

    assert run_with_oom_retry(forward, None, on_oom=lambda *a: frees.append(a), max_attempts=3, backoff_s=0) == "done"
    assert len(calls) == 2 and len(frees) == 1

    def broken():
        calls.append(1)
        raise RuntimeError("shape mismatch")

    calls.clear()
    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_with_oom_retry(broken, None, on_oom=lambda *a: None, max_attempts=3, backoff_s=0)
    assert len(calls) == 1, "a bug must not be retried as if memory had run out"


@pytest.mark.parametrize("failures, max_attempts", [(3, 4), (4, 4), (1, 1)])
def test_each_failed_try_is_told_by_number_and_followed_by_a_doubling_wait(monkeypatch, failures, max_attempts):
    sleeps, told, calls = [], [], []
    monkeypatch.setattr("time.sleep", sleeps.append)

    def forward():
        calls.append(1)
        if len(calls) <= failures:
            raise torch.OutOfMemoryError("out of memory")
        return "done"

    def run():
        return run_with_oom_retry(forward, None, on_oom=lambda error, number: told.append(number),
                                  max_attempts=max_attempts, backoff_s=0.5)

    if failures < max_attempts:
        assert run() == "done"
    else:
        with pytest.raises(ForwardOutOfMemoryError, match=f"all {max_attempts} tries"):
            run()
    assert len(calls) == min(failures + 1, max_attempts)
    waited = min(failures, max_attempts - 1)  # no wait, and no word, after the last try
    assert told == list(range(1, waited + 1))
    assert sleeps == [0.5, 1.0, 2.0][:waited]


# -- end to end -------------------------------------------------------------------------------------
class FailOnce:
    """Raises ``error`` once from decoder layer 1's forward (mid-pass)."""

    def __init__(self, model, error):
        self.error, self.fired = error, False
        self.handle = model.model.layers[1].register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        if not self.fired:
            self.fired = True
            raise self.error

    def remove(self):
        self.handle.remove()


def test_an_engine_survives_a_cpu_allocation_failure_during_a_cached_prefill(tiny_model, tiny_tokenizer):
    config = EngineConfig(rsbcm=RSBCMConfig(cache_budget_mb=64 * 256 * 2 / 2**20, block_size=4, oom_backoff_s=0))
    engine = RKSCEngine(tiny_model, tiny_tokenizer, config)
    reference = RKSCEngine(tiny_model, tiny_tokenizer)
    params = SamplingParams(max_new_tokens=6)
    first = "A shared opening line for both prompts, long enough to fill several blocks. "
    engine.generate(first + "First.", params)
    expected = reference.generate(first + "Second question?", params).token_ids
    failure = FailOnce(tiny_model, RuntimeError(CPU_OOM))
    try:
        out = engine.generate(first + "Second question?", params)  # reuses (locks) the shared prefix
    finally:
        failure.remove()
    assert failure.fired and engine.stats().oom_retries == 1
    assert out.token_ids == expected, "the retried pass must produce the same tokens"
    cache = engine.prefix_cache
    assert cache.total_bytes <= cache.budget_bytes, f"cache_bytes {cache.total_bytes} > budget {cache.budget_bytes}"
    assert cache.budget_bytes >= cache.configured_budget_bytes // 2, "one OOM must not collapse the budget"
    cache.check_consistency()
