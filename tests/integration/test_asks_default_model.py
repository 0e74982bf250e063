"""ASKS on the real default model (SmolLM2-135M-Instruct): a reworded system prompt before the same
few-shot context reuses the cached context, tau = 1 stays token-exact, and the exact cache stays exact."""

import pytest
import torch

from rksc_engine import ASKSConfig, EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.evaluation.workloads import synthetic_problems
from rksc_engine.reasoning.few_shot import few_shot_messages

pytestmark = pytest.mark.integration

FIRST = "You solve grade-school math word problems. Reason step by step, then answer as '#### <number>'."
SECOND = "Solve the math word problem step by step in short sentences and end with '#### <number>'."


@pytest.fixture(scope="module")
def loaded():
    base = RKSCEngine.from_pretrained(progress=False)
    return base.model, base.tokenizer


def prompt(engine, wording):
    question = synthetic_problems(1, seed=9)[0].question
    return engine.encode(few_shot_messages(question, synthetic_problems(3, seed=1), system_prompt=wording))


def hf_greedy(model, ids, max_new_tokens):
    x = torch.tensor([ids])
    return tuple(model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                do_sample=False)[0, len(ids):].tolist())


def test_a_reworded_instruction_reuses_the_cached_context_on_the_default_model(loaded):
    model, tokenizer = loaded
    engine = RKSCEngine(model, tokenizer, EngineConfig(asks=ASKSConfig(enabled=True, tau=0.0)))
    engine.generate(prompt(engine, FIRST), SamplingParams(max_new_tokens=2))
    ids = prompt(engine, SECOND)
    got = engine.generate(ids, SamplingParams(max_new_tokens=24))
    decision = got.asks
    assert decision is not None and decision.reused
    assert decision.reused_tokens >= len(ids) - 40, "the whole shared few-shot context should be reused"
    assert 0.5 < decision.sigma < 1.0
    assert engine.stats().asks_reused_tokens == decision.reused_tokens
    # Only exact KV was cached for the reworded prompt; a later token-exact request is exact.
    assert engine.prefix_cache.match_prefix(ids).num_tokens == decision.prefix_tokens + decision.request_span_tokens
    exact = RKSCEngine(model, tokenizer, EngineConfig(asks=ASKSConfig(enabled=False)))
    exact.prefix_cache = engine.prefix_cache  # the cache ASKS wrote to, read token-exactly
    assert exact.generate(ids, SamplingParams(max_new_tokens=24)).token_ids == hf_greedy(model, ids, 24)


def test_tau_one_on_the_default_model_is_token_exact(loaded):
    model, tokenizer = loaded
    engine = RKSCEngine(model, tokenizer, EngineConfig(asks=ASKSConfig(enabled=True, tau=1.0)))
    engine.generate(prompt(engine, FIRST), SamplingParams(max_new_tokens=2))
    ids = prompt(engine, SECOND)
    got = engine.generate(ids, SamplingParams(max_new_tokens=24))
    assert got.asks is None
    assert got.token_ids == hf_greedy(model, ids, 24)
