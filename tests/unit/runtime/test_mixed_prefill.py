"""Prompts that arrive while rows decode are prefilled in the decode step's forward: same tokens,
same reuse and caching, and a failure of the mixed forward falls back without touching the rows."""

from __future__ import annotations

import pytest
import torch
from conftest import MIXED_LENGTH_PROMPTS, assert_same_work, engine_hf_greedy, make_char_tokenizer, make_tiny_model

from rksc_engine import EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.config import SchedulerConfig

PROMPTS = MIXED_LENGTH_PROMPTS
hf_greedy = engine_hf_greedy
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=14, seed=11)
GREEDY = SamplingParams(max_new_tokens=14)


def engine_for(seed: int = 0, mixed: bool = True, **scheduler) -> RKSCEngine:
    return RKSCEngine(make_tiny_model(seed), make_char_tokenizer(),
                      EngineConfig(scheduler=SchedulerConfig(mixed_prefill=mixed, **scheduler)))


def extra(engine: RKSCEngine, name: str) -> int:
    return int(engine.stats().extra.get(name, 0))


def run_staggered(engine: RKSCEngine) -> list[list[tuple[int, ...]]]:
    """A request of two sampled branches starts; two steps later two prompts arrive together, and
    a step after them one more: each arrival finds rows decoding."""
    with engine.exclusive():
        handles = [engine.submit(PROMPTS[0], 2, SAMPLED)]
        engine.scheduler.step()
        engine.scheduler.step()
        handles += [engine.submit(PROMPTS[1], 1, GREEDY), engine.submit(PROMPTS[2], 3, SAMPLED)]
        engine.scheduler.step()
        handles.append(engine.submit(PROMPTS[3], 1, GREEDY))
        return [[c.token_ids for c in handle.result()] for handle in handles]


@pytest.mark.parametrize("model_seed", [0, 1])
def test_prompts_arriving_while_rows_decode_are_prefilled_in_the_decode_forward_with_the_same_tokens(model_seed):
    engine = engine_for(model_seed)
    got = run_staggered(engine)
    assert extra(engine, "mixed_prefills") == 2, "the arrivals were not prefilled in the decode forward"
    assert extra(engine, "mixed_prefill_fallbacks") == 0
    assert got[1][0] == hf_greedy(engine, PROMPTS[1], 14)
    assert got[3][0] == hf_greedy(engine, PROMPTS[3], 14)
    # Sampled branches draw what they draw alone, on an engine that runs nothing else.
    for prompt, n, tokens in ((PROMPTS[0], 2, got[0]), (PROMPTS[2], 3, got[2])):
        alone = engine_for(model_seed, mixed=False).generate_branches(prompt, n=n, params=SAMPLED)
        assert tokens == [c.token_ids for c in alone], prompt


def test_mixed_and_apart_give_the_same_tokens_and_count_the_same_work():
    results, stats = [], []
    for mixed in (True, False):
        engine = engine_for(3, mixed=mixed)
        results.append(run_staggered(engine))
        stats.append(engine.stats())
    assert results[0] == results[1]
    assert extra(engine, "mixed_prefills") == 0, "mixed_prefill=False still mixed"
    assert_same_work(stats[0], stats[1])


def test_an_arrival_reuses_its_cached_prefix_and_is_cached_for_the_next_call():
    engine = engine_for(0)
    base = "A shared preamble that the arrival starts with. "
    engine.generate(base + "first", SamplingParams(max_new_tokens=1))  # caches the preamble
    prompt = base + "second question"
    with engine.exclusive():
        running = engine.submit("unrelated words", 1, GREEDY)
        engine.scheduler.step()
        before = engine.stats()
        arrival = engine.submit(prompt, 1, GREEDY)
        engine.scheduler.step()
        after = engine.stats()
        tokens = arrival.result()[0].token_ids
        running.result()
    assert after.extra.get("mixed_prefills") == 1
    assert after.prompt_tokens_reused - before.prompt_tokens_reused == len(base)
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == len(prompt) - len(base)
    assert tokens == hf_greedy(engine, prompt, 14)
    reused_before = engine.stats().prompt_tokens_reused
    engine.generate(prompt, SamplingParams(max_new_tokens=1))
    assert engine.stats().prompt_tokens_reused - reused_before == len(prompt) - 1, "the arrival was not cached"


def test_a_failed_first_check_turns_mixing_off_and_every_request_keeps_its_tokens(monkeypatch):
    engine = engine_for(0)
    monkeypatch.setattr(engine.scheduler.prefiller.packing, "difference_from_alone", lambda prefilled: (1.0, 1e-6))
    got = run_staggered(engine)
    assert extra(engine, "mixed_prefill_disabled") == 1
    assert extra(engine, "mixed_prefill_fallbacks") == 1
    assert extra(engine, "mixed_prefills") == 0
    assert got == run_staggered(engine_for(0, mixed=False))


def test_a_failure_after_the_mixed_forward_rolls_the_rows_back_before_they_decode_again(monkeypatch):
    engine = engine_for(0)
    packing = engine.scheduler.prefiller.packing
    real_finish = packing.finish_prompts
    failures = []

    def finish_then_fail(*args, **kwargs):
        real_finish(*args, **kwargs)  # the forward ran and wrote the rows' next positions
        if not failures:
            failures.append(1)
            raise RuntimeError("injected after the mixed forward")
        raise AssertionError("mixing was not turned off after a failure")

    monkeypatch.setattr(packing, "finish_prompts", finish_then_fail)
    got = run_staggered(engine)
    assert extra(engine, "mixed_prefill_disabled") == 1
    # Without the roll-back the rows would decode their next token at a position already written.
    assert got == run_staggered(engine_for(0, mixed=False))


def test_running_out_of_memory_in_the_mixed_forward_falls_back_once_and_keeps_mixing(monkeypatch):
    engine = engine_for(0)
    packing = engine.scheduler.prefiller.packing
    real_finish = packing.finish_prompts
    calls = []

    def out_of_memory_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected")
        return real_finish(*args, **kwargs)

    monkeypatch.setattr(packing, "finish_prompts", out_of_memory_once)
    got = run_staggered(engine)
    assert extra(engine, "mixed_prefill_fallbacks") == 1
    assert extra(engine, "mixed_prefill_disabled") == 0
    assert extra(engine, "mixed_prefills") == 1, "the second arrival was not mixed after the OOM"
    assert got == run_staggered(engine_for(0, mixed=False))


def test_an_interrupt_in_the_mixed_forward_fails_the_step_and_the_engine_goes_on(monkeypatch):
    import rksc_engine.runtime.admission as admission_module

    engine = engine_for(0)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with engine.exclusive():
        running = engine.submit(PROMPTS[0], 2, SAMPLED)
        engine.scheduler.step()
        arrival = engine.submit(PROMPTS[1], 1, GREEDY)
        monkeypatch.setattr(admission_module, "forward_rows_and_prompts", interrupted)
        with pytest.raises(KeyboardInterrupt):
            engine.scheduler.step()
    monkeypatch.undo()
    for handle in (running, arrival):
        assert handle.done(), "a request of the interrupted step was left waiting"
        with pytest.raises(Exception) as failure:
            handle.result(timeout=30)
        assert not isinstance(failure.value, TimeoutError)
    assert engine.generate("x", SamplingParams(max_new_tokens=3)).token_ids == hf_greedy(engine, "x", 3)
    assert all(node.lock_ref == 0 for node in engine.prefix_cache._iter_nodes()), "a radix node stayed locked"
    engine.prefix_cache.check_consistency()


def test_a_step_that_admits_a_prompt_while_rows_decode_runs_one_forward():
    from conftest import CountingHooks

    engine = engine_for(0)
    run_staggered(engine)  # the one-time check of the first mixed step is behind us
    hooks = CountingHooks(engine.model.model.layers)
    with engine.exclusive():
        running = engine.submit(PROMPTS[0], 2, SAMPLED)
        engine.scheduler.step()
        hooks.calls[0] = 0
        arrival = engine.submit(PROMPTS[4], 1, GREEDY)
        engine.scheduler.step()
        assert hooks.calls[0] == 1, "the arrival's prefill took a forward of its own"
        tokens = arrival.result()[0].token_ids
        running.result()
    hooks.remove()
    assert tokens == hf_greedy(engine, PROMPTS[4], 14)


def test_mixed_prefill_must_be_a_bool():
    with pytest.raises(TypeError, match="scheduler.mixed_prefill"):
        SchedulerConfig(mixed_prefill=1)
