"""Prompts admitted in one step are prefilled in one forward: same tokens, same reuse, faults contained."""

from __future__ import annotations

import pytest
from conftest import MIXED_LENGTH_PROMPTS, engine_hf_greedy, make_char_tokenizer, make_tiny_model

from rksc_engine import EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.config import SchedulerConfig
from rksc_engine.runtime.admission import MIN_SAVED_TOKENS_TO_SPLIT_PACK

PROMPTS = MIXED_LENGTH_PROMPTS


def engine_for(seed: int = 0, packed: bool = True) -> RKSCEngine:
    return RKSCEngine(make_tiny_model(seed), make_char_tokenizer(),
                      EngineConfig(scheduler=SchedulerConfig(packed_prefill=packed)))


hf_greedy = engine_hf_greedy


def run_together(engine: RKSCEngine, jobs) -> list[list[tuple[int, ...]]]:
    """Submit every job before any step runs, so one step admits them all."""
    with engine.exclusive():
        handles = [engine.submit(prompt, n, params) for prompt, n, params in jobs]
        return [[c.token_ids for c in h.result()] for h in handles]


def packed_prefills(engine: RKSCEngine) -> int:
    return int(engine.stats().extra.get("packed_prefills", 0))


@pytest.mark.parametrize("model_seed", [0, 1])
def test_prompts_prefilled_in_one_forward_decode_what_transformers_generate_decodes(model_seed):
    engine = engine_for(model_seed)
    got = run_together(engine, [(p, 1, SamplingParams(max_new_tokens=16)) for p in PROMPTS])
    assert packed_prefills(engine) == 1, "the five prompts were not prefilled together"
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens[0] == hf_greedy(engine, prompt, 16), prompt


def test_packed_and_one_by_one_prefill_give_the_same_tokens_and_account_for_every_prompt_token():
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=20, seed=5)
    jobs = [(p, 1 + i % 3, sampled if i % 2 else SamplingParams(max_new_tokens=20)) for i, p in enumerate(PROMPTS)]
    results, stats = [], []
    for packed in (True, False):
        engine = engine_for(3, packed=packed)
        results.append(run_together(engine, jobs))
        stats.append(engine.stats())
    assert results[0] == results[1]
    assert packed_prefills(engine) == 0, "packed_prefill=False still packed"
    packed, each = stats
    assert packed.prefills == each.prefills
    total = packed.prompt_tokens_computed + packed.prompt_tokens_reused
    assert total == each.prompt_tokens_computed + each.prompt_tokens_reused
    # One by one, "Another one" reuses the "A" that "A much longer..." cached; in the pack, a
    # shared opening that short is computed again rather than split off.
    assert packed.prompt_tokens_computed == each.prompt_tokens_computed + 1


def test_a_packed_prompt_reuses_its_cached_prefix_and_is_cached_for_the_next_call():
    engine = engine_for(0)
    base = "A shared preamble that several prompts start with. "
    engine.generate(base + "first", SamplingParams(max_new_tokens=1))  # caches the preamble
    prompts = [base + "second question", base + "third one here", "unrelated"]
    before = engine.stats()
    got = run_together(engine, [(p, 1, SamplingParams(max_new_tokens=12)) for p in prompts])
    after = engine.stats()
    assert packed_prefills(engine) == 1
    reused = after.prompt_tokens_reused - before.prompt_tokens_reused
    assert reused >= 2 * len(engine.encode(base)) - 2, "the packed prompts recomputed their cached preamble"
    for prompt, tokens in zip(prompts, got):
        assert tokens[0] == hf_greedy(engine, prompt, 12), prompt
    # Each packed prompt went into the radix cache whole: asking again computes one token.
    computed = engine.stats().prompt_tokens_computed
    engine.generate(prompts[1], SamplingParams(max_new_tokens=1))
    assert engine.stats().prompt_tokens_computed - computed == 1


def test_prompts_sharing_an_uncached_opening_with_a_queue_are_split_so_the_later_ones_reuse_it():
    engine = engine_for(0)
    shared = "Exactly the same long opening for all of these prompts. "
    prompts = [shared + "one", shared + "two", shared + "three"]
    assert 2 * (len(engine.encode(shared)) - 1) >= MIN_SAVED_TOKENS_TO_SPLIT_PACK
    got = run_together(engine, [(p, 1, SamplingParams(max_new_tokens=8)) for p in prompts])
    stats = engine.stats()
    assert packed_prefills(engine) == 1, "the first prompt alone, then the two that reuse its opening"
    assert stats.prompt_tokens_reused >= 2 * (len(engine.encode(shared)) - 1), "a later prompt recomputed the opening"
    for prompt, tokens in zip(prompts, got):
        assert tokens[0] == hf_greedy(engine, prompt, 8), prompt


@pytest.mark.parametrize("opening, count", [
    ("Request ", 4),  # a few tokens, shared by a few prompts
    ("Exactly the same long opening for both of these prompts. ", 2),  # more tokens, shared by one more prompt
])
def test_prompts_sharing_little_uncached_work_are_packed_together(opening, count):
    engine = engine_for(0)
    assert (count - 1) * len(engine.encode(opening)) < MIN_SAVED_TOKENS_TO_SPLIT_PACK
    prompts = [opening + f"{i}: " + "tell me about the mill. " * (1 + i) for i in range(count)]
    got = run_together(engine, [(p, 1, SamplingParams(max_new_tokens=8)) for p in prompts])
    stats = engine.stats()
    assert packed_prefills(engine) == 1 and stats.prefills == len(prompts)
    assert stats.prompt_tokens_reused == 0, "a prompt was split off the pack to cache a short opening"
    for prompt, tokens in zip(prompts, got):
        assert tokens[0] == hf_greedy(engine, prompt, 8), prompt


def test_a_failing_packed_forward_falls_back_to_one_prefill_each_and_leaves_no_lock(monkeypatch):
    engine = engine_for(0)
    want = [hf_greedy(engine, p, 10) for p in PROMPTS]

    def broken(*args, **kwargs):
        raise RuntimeError("packed forward failed")

    monkeypatch.setattr(engine.scheduler.prefiller.packing, "packed_pass", broken)
    got = run_together(engine, [(p, 1, SamplingParams(max_new_tokens=10)) for p in PROMPTS])
    assert [tokens[0] for tokens in got] == want
    stats = engine.stats()
    assert stats.extra.get("packed_prefill_fallbacks") == 1
    assert packed_prefills(engine) == 0
    assert stats.prefills == len(PROMPTS)
    engine.clear_cache()
    assert engine.stats().cache_tokens == 0, "a node stayed locked after the failed packed forward"
    # A model that cannot take a packed pass is not asked again.
    assert engine.scheduler.prefiller.packing.packs_prompts() is False
    assert stats.extra.get("packed_prefill_disabled") == 1
    run_together(engine, [(p, 1, SamplingParams(max_new_tokens=2)) for p in PROMPTS])
    assert engine.stats().extra.get("packed_prefill_fallbacks") == 1


def test_a_packed_forward_whose_logits_disagree_with_a_prompt_alone_turns_packing_off(monkeypatch):
    engine = engine_for(1)
    want = [hf_greedy(engine, p, 10) for p in PROMPTS]
    packing = engine.scheduler.prefiller.packing
    honest = packing.packed_pass

    def ignores_the_mask(prompts, matches):  # stands in for a model that mixes the packed prompts
        results = honest(prompts, matches)
        wrong = results[0].last_logits.clone()
        wrong[0, 5] += 100.0  # a token greedy decoding would now pick
        results[0].last_logits = wrong
        return results

    monkeypatch.setattr(packing, "packed_pass", ignores_the_mask)
    got = run_together(engine, [(p, 1, SamplingParams(max_new_tokens=10)) for p in PROMPTS])
    assert [tokens[0] for tokens in got] == want, "a mismatched packed prefill reached the tokens"
    stats = engine.stats()
    assert stats.extra.get("packed_prefill_disabled") == 1
    assert stats.extra.get("packed_prefill_fallbacks") == 1
    assert packing.packs_prompts() is False


def test_packed_prefill_must_be_a_bool():
    with pytest.raises(TypeError, match="scheduler.packed_prefill"):
        SchedulerConfig(packed_prefill=1)


def test_an_interrupt_in_the_packed_forward_fails_every_admitted_request_and_the_engine_goes_on(monkeypatch):
    engine = engine_for(0)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.scheduler.prefiller.packing, "packed_pass", interrupted)
    # "Another one" shares an uncached "A" with the prompt before it, so it arrives while the pack of
    # the first four is prefilled: it is in no list at that moment.
    with engine.exclusive():
        handles = [engine.submit(p, 1, SamplingParams(max_new_tokens=4)) for p in PROMPTS]
        with pytest.raises(KeyboardInterrupt):
            engine.scheduler.step()
    assert all(handle.done() for handle in handles), "a request admitted in the interrupted step was left waiting"
    for handle in handles:
        with pytest.raises(Exception) as failure:
            handle.result(timeout=30)
        assert not isinstance(failure.value, TimeoutError)
    monkeypatch.undo()
    assert engine.generate("x", SamplingParams(max_new_tokens=3)).token_ids == hf_greedy(engine, "x", 3)


def test_context_groups_count_a_shared_cached_prefix_once_and_cut_at_the_bound():
    from rksc_engine.runtime.packed_prefill import context_groups

    node_a, node_b = object(), object()
    prompts = [[0] * 40, [0] * 40, [0] * 40, [0] * 20, [0] * 35]
    matches = [(None, 30, node_a), (None, 30, node_a), (None, 30, node_a), (None, 0, None), (None, 30, node_b)]
    # 30 shared + 3 x 10 new = 60; the fourth prompt's 20 would make 80.
    assert context_groups(prompts, matches, 70) == [[0, 1, 2], [3, 4]]
    assert context_groups(prompts, matches, None) == [[0, 1, 2, 3, 4]]
    assert context_groups(prompts, matches, 1) == [[0], [1], [2], [3], [4]]


def test_a_pack_over_the_step_budget_of_context_runs_as_several_forwards_with_the_same_tokens():
    engine = RKSCEngine(make_tiny_model(0), make_char_tokenizer(),
                        EngineConfig(scheduler=SchedulerConfig(max_prefill_tokens=80)))
    base = "A preamble of some length, cached first. "
    engine.generate(base + "first", SamplingParams(max_new_tokens=1))
    prompts = [base + "second q", base + "third q", base + "fourth q", base + "zz fifth"]
    got = run_together(engine, [(p, 1, SamplingParams(max_new_tokens=8)) for p in prompts])
    # Four prompts of about 8 new tokens fit the budget, but not their context in one forward of 80:
    # the preamble is 41 tokens, and "fourth" matches one more cached token ("f" of "first"), so
    # its preamble is a different prefix and is counted apart.
    assert packed_prefills(engine) >= 2
    for prompt, tokens in zip(prompts, got):
        assert tokens[0] == hf_greedy(engine, prompt, 8), prompt


def test_each_packed_prompt_attends_only_to_its_own_prefix_and_tokens(monkeypatch):
    """The pack's attention costs what its prompts cost apart: no query reads another prompt's
    keys (a dense block-diagonal mask over the packed row would read all of them)."""
    from rksc_engine.kvcache import packed_prompts

    engine = engine_for(0)
    want = [hf_greedy(engine, p, 6) for p in PROMPTS]
    seen: list[tuple[int, int]] = []
    real = packed_prompts.prompt_attention

    def recording(query, prefix, new_keys, *args, **kwargs):
        seen.append((query.shape[2], (0 if prefix is None else prefix[0].shape[2]) + new_keys.shape[2]))
        return real(query, prefix, new_keys, *args, **kwargs)

    monkeypatch.setattr(packed_prompts, "prompt_attention", recording)
    got = run_together(engine, [(p, 1, SamplingParams(max_new_tokens=6)) for p in PROMPTS])
    assert [tokens[0] for tokens in got] == want
    assert packed_prefills(engine) == 1
    layers = engine.model.config.num_hidden_layers
    lengths = {len(engine.encode(p)) for p in PROMPTS}
    assert len(seen) >= 2 * layers and len(seen) % layers == 0, "fewer than two prompts were packed"
    # Nothing was cached: each prompt's queries read exactly its own keys.
    assert all(queries == keys and keys in lengths for queries, keys in seen), seen


@pytest.mark.parametrize("family", ["mistral-sliding", "gemma2", "gpt-oss"])
def test_prompts_of_a_sliding_window_model_are_packed_and_decode_what_transformers_generates(family):
    from rksc_bench.families import char_tokenizer, make_family_model

    engine = RKSCEngine(make_family_model(family), char_tokenizer())
    prompts = [f"Request {i}: " + "tell me about the mill. " * (1 + i) for i in range(4)]  # past the 12-token window
    got = run_together(engine, [(p, 1, SamplingParams(max_new_tokens=8)) for p in prompts])
    assert packed_prefills(engine) == 1, "a sliding-window model's prompts were prefilled one by one"
    for prompt, tokens in zip(prompts, got):
        assert tokens[0] == hf_greedy(engine, prompt, 8), prompt
    # A second round reuses each prompt's cached KV as its prefix, inside the window's reach.
    again = run_together(engine, [(p + " and?", 1, SamplingParams(max_new_tokens=8)) for p in prompts])
    assert packed_prefills(engine) == 2
    for prompt, tokens in zip(prompts, again):
        assert tokens[0] == hf_greedy(engine, prompt + " and?", 8), prompt
