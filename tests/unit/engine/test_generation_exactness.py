"""The anchor invariant on tiny seeded models: rksc's output is token-identical to plain
transformers greedy generation, whatever the prefix cache holds, and a seeded branch is the same
alone or batched with siblings."""

import pytest
import torch
from conftest import make_char_tokenizer, make_tiny_model

from rksc_engine import EngineConfig, RKSCEngine, RSBCMConfig, SamplingParams

PROMPTS = [
    "The quick brown fox jumps over",
    "Q: what is 2+3?\nA:",
    "x",
    "A much longer prompt, repeated. " * 6,
]


def hf_greedy(model, tokenizer, prompt, max_new_tokens):
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return tuple(out[0, ids.shape[1]:].tolist())


@pytest.mark.parametrize("model_seed", [0, 1, 2])
@pytest.mark.parametrize("cache_enabled", [True, False])
def test_greedy_generate_matches_transformers_generate(model_seed, cache_enabled):
    model, tokenizer = make_tiny_model(model_seed), make_char_tokenizer()
    engine = RKSCEngine(model, tokenizer, EngineConfig(rsbcm=RSBCMConfig(enabled=cache_enabled)))
    for prompt in PROMPTS:
        got = engine.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
        want = hf_greedy(model, tokenizer, prompt, 24)
        assert got == want, f"greedy output differs from transformers for {prompt!r}"


def test_eos_ends_a_branch_and_is_reported(tiny_tokenizer):
    model = make_tiny_model(3)
    free = hf_greedy(model, tiny_tokenizer, "hello", 10)
    # Make EOS outscore the token greedy decoding emits at step 4, so generation must end there.
    with torch.no_grad():
        model.lm_head.weight[1] = model.lm_head.weight[free[3]] * 1.5
    want = hf_greedy(model, tiny_tokenizer, "hello", 50)
    assert want[-1] == 1 and len(want) <= 4, "test setup: transformers should stop at EOS"
    got = RKSCEngine(model, tiny_tokenizer).generate("hello", SamplingParams(max_new_tokens=50))
    assert got.token_ids == want
    assert got.finish_reason == "eos"
    assert "<eos>" not in got.text


def test_a_request_served_from_the_prefix_cache_equals_a_cold_request(tiny_model, tiny_tokenizer):
    warm = RKSCEngine(tiny_model, tiny_tokenizer)
    shared = "System: you are terse.\nContext: " + "abc def " * 10
    warm.generate(shared + "Question one?", SamplingParams(max_new_tokens=8))
    params = SamplingParams(max_new_tokens=20)
    served = warm.generate(shared + "Question two?", params)
    assert served.num_cached_tokens >= len(tiny_tokenizer(shared)["input_ids"]) - 1
    cold = RKSCEngine(tiny_model, tiny_tokenizer).generate(shared + "Question two?", params)
    assert served.num_cached_tokens > 0 and cold.num_cached_tokens == 0
    assert served.token_ids == cold.token_ids


def test_a_repeated_prompt_recomputes_only_its_last_token(tiny_engine):
    prompt = "identical prompt sent twice"
    n = len(tiny_engine.encode(prompt))
    tiny_engine.generate(prompt, SamplingParams(max_new_tokens=4))
    before = tiny_engine.stats()
    tiny_engine.generate(prompt, SamplingParams(max_new_tokens=4))
    after = tiny_engine.stats()
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == 1
    assert after.prompt_tokens_reused - before.prompt_tokens_reused == n - 1


def test_a_growing_prompt_pays_only_for_its_new_tokens(tiny_engine):
    history = "user: hi\nassistant: hello\n"
    tiny_engine.generate(history, SamplingParams(max_new_tokens=4))
    before = tiny_engine.stats()
    grown = history + "user: and now?\n"
    tiny_engine.generate(grown, SamplingParams(max_new_tokens=4))
    computed = tiny_engine.stats().prompt_tokens_computed - before.prompt_tokens_computed
    # The history's completion is cached too, so at most the new turn is computed.
    assert 0 < computed <= len(tiny_engine.encode(grown)) - len(tiny_engine.encode(history))


def test_an_agent_turn_that_repeats_the_last_completion_reuses_its_kv(tiny_model, tiny_tokenizer):
    engine = RKSCEngine(tiny_model, tiny_tokenizer)
    first_prompt = engine.encode("user: plan the step\nassistant:")
    first = engine.generate(first_prompt, SamplingParams(max_new_tokens=12))
    next_prompt = first_prompt + list(first.token_ids) + engine.encode("\nuser: go on\nassistant:")
    served = engine.generate(next_prompt, SamplingParams(max_new_tokens=12))
    # Everything but the completion's last token (whose KV was never computed) comes from the cache.
    assert served.num_cached_tokens == len(first_prompt) + len(first.token_ids) - 1
    cold = RKSCEngine(tiny_model, tiny_tokenizer).generate(next_prompt, SamplingParams(max_new_tokens=12))
    assert served.token_ids == cold.token_ids


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.9, 0), (1.0, 20)])
def test_a_seeded_branch_is_identical_alone_and_batched(tiny_model, tiny_tokenizer, top_p, top_k):
    engine = RKSCEngine(tiny_model, tiny_tokenizer)
    params = SamplingParams(max_new_tokens=30, temperature=0.9, top_p=top_p, top_k=top_k, seed=11)
    batched = engine.generate_branches("Once upon a time", 6, params)
    assert len({b.token_ids for b in batched}) > 1, "sampled siblings should differ"
    for i, branch in enumerate(batched):
        alone_params = SamplingParams(max_new_tokens=30, temperature=0.9, top_p=top_p, top_k=top_k, seed=11 + i)
        alone = RKSCEngine(tiny_model, tiny_tokenizer).generate("Once upon a time", alone_params)
        assert alone.token_ids == branch.token_ids, f"branch {i} changed when batched"
        assert branch.branch_index == i


def test_branches_prefill_the_prompt_once(tiny_engine):
    prompt = "one prompt, many branches"
    tiny_engine.generate_branches(prompt, 8, SamplingParams(max_new_tokens=5, temperature=1.0, seed=0))
    stats = tiny_engine.stats()
    assert stats.prefills == 1
    assert stats.prompt_tokens_computed == len(tiny_engine.encode(prompt))


def test_finished_branches_stop_costing_decode_steps(tiny_tokenizer):
    # With a stop string that most branches hit early, decode tokens counted must be the sum of the
    # branches' own lengths, not n * longest.
    model = make_tiny_model(0)
    engine = RKSCEngine(model, tiny_tokenizer)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, stop=("e", "a", "o"))
    branches = engine.generate_branches("hello", 8, params)
    lengths = [len(b.token_ids) for b in branches]
    assert engine.stats().decode_tokens == sum(lengths)
    assert min(lengths) < max(lengths)


def test_greedy_branches_are_all_the_greedy_completion(tiny_engine, tiny_model, tiny_tokenizer):
    branches = tiny_engine.generate_branches("abc", 3, SamplingParams(max_new_tokens=12))
    want = hf_greedy(tiny_model, tiny_tokenizer, "abc", 12)
    assert all(b.token_ids == want for b in branches)


def test_generate_many_shares_a_common_prefix_and_matches_individual_runs(tiny_model, tiny_tokenizer):
    shared = "Few-shot examples: " + "q a " * 12
    prompts = [shared + "first?", shared + "second?", shared + "third?"]
    engine = RKSCEngine(tiny_model, tiny_tokenizer)
    params = SamplingParams(max_new_tokens=10)
    many = engine.generate_many(prompts, params)
    shared_len = len(tiny_tokenizer(shared)["input_ids"])
    assert engine.stats().prompt_tokens_reused >= 2 * shared_len
    for prompt, got in zip(prompts, many):
        assert got.token_ids == hf_greedy(tiny_model, tiny_tokenizer, prompt, 10)


def test_stop_strings_cut_the_text_before_the_stop(tiny_engine):
    free = tiny_engine.generate("stop test", SamplingParams(max_new_tokens=30))
    stop = free.text[5:7]
    assert len(stop) == 2
    cut = tiny_engine.generate("stop test", SamplingParams(max_new_tokens=30, stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    assert stop not in cut.text


def test_streamed_text_equals_the_generated_text_and_never_leaks_a_stop(tiny_engine):
    free = tiny_engine.generate("stream me", SamplingParams(max_new_tokens=30))
    stop = free.text[10:13]
    for params in (SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=30, stop=(stop,))):
        chunks = list(tiny_engine.stream("stream me", params))
        assert chunks[-1].is_last and all(not c.is_last for c in chunks[:-1])
        streamed = "".join(c.text for c in chunks)
        assert streamed == chunks[-1].completion.text
        assert streamed == tiny_engine.generate("stream me", params).text
        assert sum(len(c.token_ids) for c in chunks) == len(chunks[-1].completion.token_ids)
    assert len(chunks) > 2, "stream should yield several chunks, not one blob"


def test_chat_messages_render_with_the_chat_template(tiny_engine, tiny_tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tiny_engine.encode(messages)
    assert tiny_tokenizer.decode(ids) == "<system>be brief\n<user>hi\n<assistant>"


def test_confidence_is_exp_mean_logprob(tiny_engine):
    c = tiny_engine.generate("conf", SamplingParams(max_new_tokens=8))
    import math

    assert math.isclose(c.confidence, math.exp(sum(c.logprobs) / len(c.logprobs)))
    assert all(lp <= 0 for lp in c.logprobs)
