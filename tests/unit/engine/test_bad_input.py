"""Rough edges of sampling settings, ``reason`` and ``tree_search`` arguments: every bad value is a
``TypeError``/``ValueError`` naming the parameter and its range, raised before any work; near-zero
temperature and top_p decode greedily instead of producing garbage."""

import math

import pytest
import torch
from conftest import make_char_tokenizer, make_tiny_model

from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.config import (
    MAX_BRANCH_SEED,
    MAX_SEED,
    MIN_SAMPLING_TEMPERATURE,
    MIN_TOP_P,
    SEED_HEADROOM,
    check_branch_seeds,
)
from rksc_engine.evaluation.workloads import synthetic_problems
from rksc_engine.runtime.sampling import _top_p_drop_mask, filter_logits, make_generators, sample_rows

PROMPT = "Q: what is 2+3?\nA:"


# -- seeds ------------------------------------------------------------------------------------------
def test_torch_generators_take_every_branch_seed_up_to_max_branch_seed():
    generator = torch.Generator()
    generator.manual_seed(MAX_BRANCH_SEED)  # the largest seed any branch gets
    assert generator.initial_seed() == MAX_BRANCH_SEED
    with pytest.raises((ValueError, RuntimeError, OverflowError)):
        generator.manual_seed(2**64)  # "Overflow when unpacking long long": why seeds are bounded
    assert MAX_SEED + SEED_HEADROOM == MAX_BRANCH_SEED


@pytest.mark.parametrize("seed", [MAX_SEED + 1, 2**63, 2**64, 2**200])
def test_a_seed_above_max_seed_is_refused_with_the_maximum_in_the_message(seed):
    with pytest.raises(ValueError, match=rf"seed must be in \[0, {MAX_SEED}\]"):
        SamplingParams(seed=seed)


def test_the_largest_seed_samples_every_branch_without_overflow(tiny_engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=MAX_SEED)
    branches = tiny_engine.generate_branches(PROMPT, 4, params)  # generators seeded up to MAX_SEED + 3
    assert [len(b.token_ids) for b in branches] == [3] * 4
    below = tiny_engine.generate_branches(PROMPT, 4, SamplingParams(temperature=1.0, max_new_tokens=3, seed=MAX_SEED - 3))
    alone = tiny_engine.generate(PROMPT, params)
    assert below[3].token_ids == alone.token_ids, "branch 3 must draw from seed + 3 as it would alone"
    assert make_generators(MAX_BRANCH_SEED, 1, torch.device("cpu"))[0].initial_seed() == MAX_BRANCH_SEED


def test_branch_seeds_past_the_generator_range_are_a_value_error_not_an_overflow():
    check_branch_seeds(MAX_SEED, SEED_HEADROOM + 1)  # seed + n - 1 == MAX_BRANCH_SEED: fine
    with pytest.raises(ValueError, match=rf"seed \+ n - 1 must be <= {MAX_BRANCH_SEED}"):
        check_branch_seeds(MAX_SEED, SEED_HEADROOM + 2)
    with pytest.raises(ValueError, match="seed \\+ n - 1"):
        make_generators(MAX_BRANCH_SEED, 2, torch.device("cpu"))


# -- temperature and top_p --------------------------------------------------------------------------
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_temperature_and_top_p_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
        SamplingParams(temperature=value)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=value)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-9, MIN_SAMPLING_TEMPERATURE / 2])
def test_a_temperature_too_small_to_sample_with_decodes_greedily(tiny_engine, temperature):
    params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=0)
    assert params.greedy
    greedy = tiny_engine.generate(PROMPT, SamplingParams(max_new_tokens=12))
    assert tiny_engine.generate(PROMPT, params).token_ids == greedy.token_ids


def test_at_the_smallest_sampling_temperature_sampling_stays_on():
    assert not SamplingParams(temperature=MIN_SAMPLING_TEMPERATURE).greedy
    assert not SamplingParams(temperature=0.7, top_p=MIN_TOP_P).greedy


def test_without_the_greedy_shortcut_a_tiny_temperature_would_emit_nan():
    # Why the threshold exists: float32 logits divided by 1e-45 overflow, and their softmax is NaN.
    logits = torch.tensor([[3.0, -1.0, 0.5]])
    assert torch.isnan((logits / 1e-45).softmax(-1)).any()


@pytest.mark.parametrize("top_p", [1e-300, 1e-50, MIN_TOP_P / 10])
def test_a_tiny_top_p_keeps_the_top_token_and_decodes_greedily(tiny_engine, top_p):
    params = SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=12, seed=0)
    assert params.greedy
    greedy = tiny_engine.generate(PROMPT, SamplingParams(max_new_tokens=12))
    assert tiny_engine.generate(PROMPT, params).token_ids == greedy.token_ids


def test_the_nucleus_always_keeps_the_top_token_even_for_a_top_p_below_float32():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 4  # (B, V)
    for top_p in (1e-300, 1e-46, 1e-8):
        dropped = _top_p_drop_mask(logits, top_p)
        kept = (~dropped).nonzero().tolist()
        assert kept == [[row, int(logits[row].argmax())] for row in range(3)], f"top_p={top_p} kept {kept}"
    # And the sampling path itself draws the argmax, never token 0 from a NaN row.
    params = SamplingParams(temperature=1.0, top_p=1e-300)
    probs = filter_logits(logits, params).softmax(-1)
    assert not torch.isnan(probs).any()
    generators = make_generators(0, 3, torch.device("cpu"))
    assert sample_rows(probs, generators).tolist() == logits.argmax(-1).tolist()


# -- reason -----------------------------------------------------------------------------------------
def _untouched(engine: RKSCEngine):
    stats = engine.stats()
    return (stats.requests, stats.prefills, stats.prompt_tokens_computed, engine.prefix_cache.total_bytes,
            engine.prefix_cache.num_nodes())


REASON_PARAMS = SamplingParams(temperature=0.7, max_new_tokens=4, seed=0)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"few_shot": "Q: 1+1? A: 2"}, TypeError, "few_shot must be a list of rksc_engine.reasoning.Problem"),
        ({"few_shot": [1, 2]}, TypeError, r"few_shot\[0\] is a int"),
        ({"few_shot": {"question": "q"}}, TypeError, "few_shot must be a list"),
        ({"n": 0}, ValueError, "n must be >= 1, got 0"),
        ({"n": 2.0}, TypeError, "n must be an int >= 1, got float"),
        ({"n": True}, TypeError, "n must be an int >= 1, got bool"),
        ({"params": {"temperature": 1.0}}, TypeError, "params must be a SamplingParams or None"),
        ({"answer_extractor": 5}, TypeError, "answer_extractor must be a callable or a name"),
        ({"answer_extractor": "roman"}, ValueError, "answer_extractor must be a callable or one of"),
        ({"verifier": 3}, TypeError, "verifier must be a Verifier, a callable or None"),
        ({"cgee": {"tau_conf": 0.5}}, TypeError, "cgee must be a CGEEConfig"),
        ({"few_shot": synthetic_problems(1, seed=1), "prompt": "Q: hi"}, ValueError, "pass few_shot or prompt, not both"),
    ],
)
def test_reason_checks_every_argument_before_generating(tiny_engine, kwargs, error, message):
    tiny_engine.generate(PROMPT, SamplingParams(max_new_tokens=4))
    before = _untouched(tiny_engine)
    call = {"n": 2, "params": REASON_PARAMS, "verifier": None, **kwargs}
    with pytest.raises(error, match=message):
        tiny_engine.reason("What is 2 + 3?", **call)
    assert _untouched(tiny_engine) == before, "a rejected call changed the engine's counters or cache"


def test_reason_refuses_a_question_that_is_not_a_string(tiny_engine):
    with pytest.raises(TypeError, match="question must be a non-empty string, got NoneType"):
        tiny_engine.reason(None, n=2, params=REASON_PARAMS)


def test_reason_still_runs_with_valid_few_shot_problems():
    engine = RKSCEngine(make_tiny_model(max_positions=4096), make_char_tokenizer())  # a few-shot prompt is long
    result = engine.reason("What is 2 + 3?", n=2, params=REASON_PARAMS, few_shot=synthetic_problems(1, seed=1),
                                verifier=lambda question, candidates: [0.5] * len(candidates))
    assert len(result.branches) == 2
    assert result.num_truncated == sum(b.answer is None and c.finish_reason == "length"
                                       for b, c in zip(result.branches, result.completions))


# -- tree_search ------------------------------------------------------------------------------------
SEARCH_PARAMS = SamplingParams(temperature=0.8, max_new_tokens=4, seed=0)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"few_shot": "worked examples"}, TypeError, "few_shot must be a list of rksc_engine.reasoning.Problem"),
        ({"few_shot": synthetic_problems(1, seed=1), "prompt": "Q: hi"}, ValueError, "pass few_shot or prompt"),
        ({"answer_extractor": 3.5}, TypeError, "answer_extractor"),
        ({"cgee": "off"}, TypeError, "cgee must be a CGEEConfig or None, got str"),
        ({"demote_pruned": "yes"}, TypeError, "demote_pruned must be a bool"),
        ({"params": SamplingParams(temperature=1e-9, max_new_tokens=4)}, ValueError,
         r"breadth > 1 needs sampling \(params.temperature > 0, at least 1e-05"),
        ({"params": SamplingParams(temperature=0.8, top_p=1e-9, max_new_tokens=4)}, ValueError, "top_p >= 1e-06"),
        ({"params": SamplingParams(temperature=0.8, max_new_tokens=4, seed=MAX_SEED)}, ValueError,
         rf"params.seed \+ depth \* beam \* breadth\*\*2 must be <= {MAX_SEED}"),
    ],
)
def test_tree_search_checks_its_arguments_before_touching_the_cache(tiny_engine, kwargs, error, message):
    tiny_engine.generate(PROMPT, SamplingParams(max_new_tokens=4))
    before = _untouched(tiny_engine)
    call = {"breadth": 2, "depth": 2, "params": SEARCH_PARAMS, **kwargs}
    with pytest.raises(error, match=message):
        tiny_engine.tree_search("What is 2 + 3?", **call)
    assert _untouched(tiny_engine) == before, "a rejected search changed the engine's counters or cache"
