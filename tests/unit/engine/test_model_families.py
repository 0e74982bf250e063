"""The family matrix: tiny seeded random models of every family in ``rksc_bench.families`` (full,
sliding-window, soft-capped and sink attention, and recurrent hybrids) decode exactly through
rksc: greedy equals ``model.generate`` cold and warm, a seeded branch is the same alone, among
its siblings and among other requests, a request served from the cache equals a cold one, and
the repeated prompt is reused (or, for recurrent layers, refused with a reason).

The prompts are longer than the families' 12-token sliding windows, so the window bites in the
prefill, in the prefix read from the radix cache and in the batched decode."""

import pytest
import torch
from conftest import CountingHooks, engine_hf_greedy, make_char_tokenizer

from rksc_bench.families import FAMILIES, SLIDING_WINDOW, family, make_family_model
from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.config import EngineConfig, RSBCMConfig
from rksc_engine.kvcache.cache_layers import layer_types

NAMES = [f.name for f in FAMILIES]
RECURRENT = [f.name for f in FAMILIES if f.recurrent]
WINDOWED = [f.name for f in FAMILIES if not f.recurrent and "sliding_attention" in layer_types(f.make_config())]
# The fast tier decodes three families: full attention, sliding windows with soft-capping, and a
# recurrent hybrid. The rest of the matrix (sinks, mixtures of experts, other layouts) is marked slow.
FAST_FAMILIES = ("llama3", "gemma2", "lfm2")
PROMPT = "System: answer in one line.\nContext: " + "north river stone " * 3 + "\nQ: where?\nA:"
OTHER_PROMPTS = ["A different and somewhat longer request, to batch with the first one.", "hi"]


def tiered(names: list[str]) -> list:
    """``names`` to parametrize over, those not in FAST_FAMILIES marked slow."""
    return [name if name in FAST_FAMILIES else pytest.param(name, marks=pytest.mark.slow) for name in names]


@pytest.fixture(scope="module")
def tokenizer():
    return make_char_tokenizer()


def test_the_matrix_has_twenty_families_with_windows_caps_sinks_and_two_recurrent_hybrids():
    assert len(NAMES) >= 20 and len(RECURRENT) >= 2
    for name in ("llama3", "qwen2.5", "mistral", "falcon3", "gemma2", "gemma3", "gpt-oss", "mistral-sliding"):
        family(name)
    assert family("gemma2").make_config().attn_logit_softcapping is not None
    assert family("gpt-oss").make_config().sliding_window == SLIDING_WINDOW
    assert len(PROMPT) > 3 * SLIDING_WINDOW


def test_the_fast_tier_keeps_a_full_a_windowed_and_a_recurrent_family():
    fast = set(FAST_FAMILIES)
    assert fast <= set(NAMES)
    assert fast & set(WINDOWED) and fast & set(RECURRENT) and fast - set(WINDOWED) - set(RECURRENT)


@pytest.mark.parametrize("name", tiered(NAMES))
def test_greedy_equals_generate_cold_and_warm_and_the_repeated_prompt_is_reused(name, tokenizer):
    engine = RKSCEngine(make_family_model(name), tokenizer)
    params = SamplingParams(max_new_tokens=16)
    want = engine_hf_greedy(engine, PROMPT, 16)
    cold = engine.generate(PROMPT, params)
    warm = engine.generate(PROMPT, params)
    assert cold.token_ids == want
    assert warm.token_ids == want
    stats = engine.stats()
    # Every prompt token but the last comes from the cache: the radix tree's KV, or for recurrent
    # layers the snapshot of the state the first call left.
    assert warm.num_cached_tokens == len(engine.encode(PROMPT)) - 1
    if family(name).recurrent:
        assert "recurrent state" in stats.prefix_cache_refusal
        assert stats.batched_decode_refusal
    else:
        assert stats.prefix_cache_refusal == "" and stats.batched_decode_refusal == ""


@pytest.mark.parametrize("name", tiered(NAMES))
def test_a_seeded_branch_is_the_same_alone_among_siblings_and_among_other_requests(name, tokenizer):
    model = make_family_model(name)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.9, seed=21)
    together = RKSCEngine(model, tokenizer)
    handles = [together.submit(PROMPT, 4, sampled)] + [together.submit(p, 2, sampled) for p in OTHER_PROMPTS]
    results = [handle.result() for handle in handles]
    assert len({b.token_ids for b in results[0]}) > 1, "sampled siblings should differ"
    for branch in (0, 3):
        alone = RKSCEngine(model, tokenizer).generate(
            PROMPT, SamplingParams(max_new_tokens=12, temperature=0.9, seed=21 + branch))
        assert results[0][branch].token_ids == alone.token_ids, f"branch {branch} changed among other requests"
    siblings_only = RKSCEngine(model, tokenizer).generate_branches(PROMPT, 4, sampled)
    assert [b.token_ids for b in siblings_only] == [b.token_ids for b in results[0]]
    alone_other = RKSCEngine(model, tokenizer).generate_branches(OTHER_PROMPTS[0], 2, sampled)
    assert [b.token_ids for b in alone_other] == [b.token_ids for b in results[1]]


@pytest.mark.parametrize("name", tiered(NAMES))
def test_a_request_served_from_the_cache_equals_a_cold_one(name, tokenizer):
    model = make_family_model(name)
    warm = RKSCEngine(model, tokenizer)
    warm.generate(PROMPT + " first question", SamplingParams(max_new_tokens=6))
    params = SamplingParams(max_new_tokens=16)
    served = warm.generate(PROMPT + " second one", params)
    cold = RKSCEngine(model, tokenizer).generate(PROMPT + " second one", params)
    assert cold.num_cached_tokens == 0
    if not family(name).recurrent:
        assert served.num_cached_tokens >= len(warm.encode(PROMPT))
    assert served.token_ids == cold.token_ids


@pytest.mark.parametrize("name", tiered(NAMES))
def test_concurrent_requests_decode_in_one_forward_where_the_shared_prefix_path_runs(name, tokenizer):
    model = make_family_model(name)
    engine = RKSCEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=8)
    forwards = CountingHooks([model])
    try:
        handles = [engine.submit(p, 2, params) for p in [PROMPT, *OTHER_PROMPTS]]
        results = [handle.result() for handle in handles]
    finally:
        forwards.remove()
    # Decode forwards each request would need on its own (its first token comes from its prefill).
    alone = sum(max(len(b.token_ids) for b in result) - 1 for result in results)
    longest = max(len(b.token_ids) for result in results for b in result)
    decode_forwards = forwards.calls[0] - engine.stats().prefills
    if family(name).recurrent:
        assert engine.stats().batched_decode_refusal
        assert decode_forwards >= alone
    else:
        # One forward per step for every request's rows (requests are admitted up to a step apart).
        assert decode_forwards <= longest + len(handles) < alone
        assert engine.stats().batched_decode_refusal == ""


@pytest.mark.parametrize("name", tiered(WINDOWED))
def test_under_budget_pressure_out_of_window_kv_goes_first_and_the_prompt_is_still_served_whole(name, tokenizer):
    model = make_family_model(name)
    params = SamplingParams(max_new_tokens=8)
    other = "Another request, long enough to leave the window: " + "many more words " * 3

    def cached_bytes(prompt):
        engine = RKSCEngine(model, tokenizer)
        engine.generate(prompt, params)
        return engine.stats().cache_bytes

    # Room for both prompts' KV but a fifth of the first one's, which out-of-window KV covers.
    budget = cached_bytes(PROMPT) + cached_bytes(other) - cached_bytes(PROMPT) // 5
    engine = RKSCEngine(model, tokenizer, EngineConfig(rsbcm=RSBCMConfig(cache_budget_mb=budget / 2**20)))
    wants = [engine_hf_greedy(engine, prompt, 8) for prompt in (PROMPT, other)]
    assert engine.generate(PROMPT, params).token_ids == wants[0]
    engine.generate(other, params)
    # Both again, decoding together: the first reads its freed KV's segments in place.
    handles = [engine.submit(prompt, 1, params) for prompt in (PROMPT, other)]
    results = [handle.result()[0] for handle in handles]
    assert [r.token_ids for r in results] == wants
    assert results[0].num_cached_tokens == len(engine.encode(PROMPT)) - 1
    stats = engine.stats()
    assert stats.cache_window_freed_tokens > 0 and stats.cache_evicted_tokens == 0
    engine.prefix_cache.check_consistency()
    assert engine.stats().cache_bytes <= engine.stats().cache_budget_bytes


@pytest.mark.parametrize("name", tiered(RECURRENT))
def test_a_recurrent_hybrid_prefills_once_and_forks_every_branch_from_that_state(name, tokenizer):
    model = make_family_model(name)
    engine = RKSCEngine(model, tokenizer)
    branches = engine.generate_branches(PROMPT, 3, SamplingParams(max_new_tokens=10))
    assert engine.stats().prefills == 1
    want = engine_hf_greedy(engine, PROMPT, 10)
    assert all(b.token_ids == want for b in branches)


def test_a_layer_type_no_cache_can_hold_is_refused_at_load_by_name(tokenizer):
    model = make_family_model("llama3")
    model.config.layer_types = ["full_attention", "future_attention"]
    with pytest.raises(NotImplementedError, match="future_attention"):
        RKSCEngine(model, tokenizer)


def test_an_out_of_memory_error_in_a_recurrent_model_is_not_retried_over_an_advanced_state(tokenizer):
    from rksc_engine.kvcache.memory import ForwardOutOfMemoryError, roll_back

    engine = RKSCEngine(make_family_model("lfm2"), tokenizer)
    cache = engine.runner.new_cache()
    engine.runner.forward(torch.tensor([engine.encode("abc")]), cache)
    with pytest.raises(ForwardOutOfMemoryError, match="recurrent"):
        roll_back(cache, None)


@pytest.mark.parametrize("name", tiered(NAMES))
def test_the_judge_scores_several_candidates_as_it_scores_them_one_by_one(name, tokenizer):
    from rksc_engine import CGEEConfig
    from rksc_engine.reasoning.verifier import LLMJudgeVerifier

    engine = RKSCEngine(make_family_model(name), tokenizer)
    judge = LLMJudgeVerifier(engine)
    config = CGEEConfig(exit_enabled=False, skip_enabled=False)
    together = judge.score("What is 2 + 3?", ["5", "six", "4"], config)
    alone = [judge.score("What is 2 + 3?", [candidate], config)[0] for candidate in ["5", "six", "4"]]
    assert [s.score for s in together] == pytest.approx([s.score for s in alone], abs=1e-5)


def test_forking_a_recurrent_cache_copies_its_state_to_every_row(tokenizer):
    from rksc_engine.kvcache.cache_layers import repeat_rows, select_rows

    engine = RKSCEngine(make_family_model("qwen3-next"), tokenizer)
    empty = engine.runner.new_cache()
    repeat_rows(empty, 3)  # nothing cached yet: nothing to copy, and no error
    cache = engine.runner.new_cache()
    engine.runner.forward(torch.tensor([engine.encode("state to fork")]), cache)
    repeat_rows(cache, 3)
    states = [state for layer in cache.layers for state in getattr(layer, "recurrent_states", {}).values()
              if state is not None]
    assert states and all(s.shape[0] == 3 and torch.equal(s[0], s[2]) for s in states)
    select_rows(cache, torch.tensor([1]))
    assert all(state.shape[0] == 1 for layer in cache.layers
               for state in getattr(layer, "recurrent_states", {}).values() if state is not None)


@pytest.mark.parametrize("name", tiered(RECURRENT))
def test_an_agent_turn_on_a_recurrent_hybrid_resumes_from_the_last_prompts_state(name, tokenizer):
    model = make_family_model(name)
    engine = RKSCEngine(model, tokenizer)
    first_prompt = engine.encode(PROMPT)
    first = engine.generate(first_prompt, SamplingParams(max_new_tokens=6))
    next_prompt = first_prompt + list(first.token_ids) + engine.encode("\nQ: and then?\nA:")
    served = engine.generate(next_prompt, SamplingParams(max_new_tokens=12))
    assert served.num_cached_tokens == len(first_prompt) - 1
    cold = RKSCEngine(model, tokenizer).generate(next_prompt, SamplingParams(max_new_tokens=12))
    assert cold.num_cached_tokens == 0
    assert served.token_ids == cold.token_ids
    assert engine.stats().cache_bytes > 0
    engine.clear_cache()
    assert engine.stats().cache_bytes == 0


def test_state_snapshots_match_the_longest_stored_prefix_and_stay_within_budget():
    from transformers import DynamicCache

    from rksc_engine.kvcache.state_snapshots import StateSnapshots, cache_bytes

    def cache_of(tokens):
        kv = torch.full((1, 1, tokens, 4), float(tokens))
        return DynamicCache(ddp_cache_data=[(kv, kv.clone())])

    size = cache_bytes(cache_of(3))
    store = StateSnapshots(budget_bytes=2 * size + size // 2)
    assert store.insert([1, 2, 3], cache_of(3))
    assert store.match([1, 2, 3, 4, 5], max_tokens=4)[1] == 3
    assert store.match([1, 2, 3, 4, 5], max_tokens=2) == (None, 0)
    assert store.insert([1, 2, 7], cache_of(3))
    copy, matched = store.match([1, 2, 3, 9], max_tokens=3)  # touches [1, 2, 3]: now the newest
    copy.layers[0].keys.zero_()  # a copy: the snapshot itself is unchanged
    assert float(store.match([1, 2, 3], max_tokens=3)[0].layers[0].keys.max()) == 3.0
    assert store.insert([5, 6, 7], cache_of(3))  # over budget: the least recently used ([1, 2, 7]) goes
    assert len(store) == 2 and store.total_bytes <= store.budget_bytes
    assert store.match([1, 2, 7], max_tokens=3) == (None, 0)
    assert not store.insert([9] * 40, cache_of(40))  # larger than the whole budget: not kept
    with pytest.raises(ValueError, match="budget_bytes"):
        StateSnapshots(0)
