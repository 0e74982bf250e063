"""CGEE level 2 against an independent logit-lens reference, and the prefix cache after stopped passes.

``test_reasoning_cgee.py`` covers the forced cases (label rows blown up so every layer is certain);
here the exit layer is *predicted* from a plain, uncached forward pass with its own hooks, so the
online rule (entropy below theta and stable within epsilon) is checked against the definition.
"""

import pytest
import torch
from conftest import CountingHooks, make_char_tokenizer, make_tiny_model

from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.cgee import CGEEConfig, wilson_interval
from rksc_engine.reasoning import extract_choice_letter, regex_extractor
from rksc_engine.verifier import LLMJudgeVerifier

NUM_LAYERS = 8
QUESTION = "Tom has 3 apples and buys 4 more. How many?"


def make_engine(seed=0, num_layers=NUM_LAYERS):
    return RKSCEngine(make_tiny_model(seed, num_layers=num_layers), make_char_tokenizer())


def label_entropy(label_logits):
    """Entropy in nats of the softmax over label logits, computed here independently of the engine."""
    logp = label_logits.double().log_softmax(-1)
    return float(-(logp.exp() * logp).sum())


def reference_lens(engine, judge, question, answer):
    """Per layer (0-based), the label logits of the logit lens at the last prompt position, from one
    uncached forward of the full verification prompt."""
    layers, norm, head = engine.model.model.layers, engine.model.model.norm, engine.model.lm_head
    rows = head.weight[judge.label_ids]  # (2, hidden)
    seen = []
    handles = [
        layer.register_forward_hook(lambda _m, _a, out: seen.append((out[0] if isinstance(out, tuple) else out)[0, -1]))
        for layer in layers
    ]
    try:
        with torch.inference_mode():
            engine.model(input_ids=torch.tensor([judge.prompt_ids(question, answer)]))
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        return [norm(h) @ rows.T for h in seen]  # each (2,)


@pytest.mark.parametrize("model_seed", [0, 1, 2])
def test_the_pass_exits_at_the_layer_the_lens_reference_predicts_and_scores_from_that_layer(model_seed):
    engine = make_engine(model_seed)
    judge = LLMJudgeVerifier(engine)
    lens = reference_lens(engine, judge, QUESTION, "7")
    entropy = [label_entropy(logits) for logits in lens]
    min_layer = 2
    # Exit may happen from min_layer + 1 (the first checked layer only sets the baseline) up to the
    # second-to-last layer (the last one is the real output). Put theta between the lowest and the
    # second-lowest entropy there, with epsilon wide open, so exactly one layer qualifies.
    checked = list(range(min_layer + 1, NUM_LAYERS - 1))
    ordered = sorted(checked, key=lambda layer: entropy[layer])
    expected, runner_up = ordered[0], ordered[1]
    assert entropy[runner_up] - entropy[expected] > 1e-4, "test setup: two layers tie on entropy"
    theta = (entropy[expected] + entropy[runner_up]) / 2
    config = CGEEConfig(exit_enabled=True, skip_enabled=False, theta=theta, epsilon=1.0, min_layer=min_layer)

    counter = CountingHooks(engine.model.model.layers)
    try:
        (score,) = judge.score(QUESTION, ["7"], config)
    finally:
        counter.remove()
    assert score.exit_layer == expected
    assert counter.calls[: expected + 1] == [1] * (expected + 1)
    assert counter.calls[expected + 1:] == [0] * (NUM_LAYERS - expected - 1), f"layers after the exit ran: {counter.calls}"
    assert score.score == pytest.approx(lens[expected].softmax(-1)[0].item(), abs=1e-5)


def test_an_unstable_lens_does_not_exit_even_below_theta():
    engine = make_engine(0)
    judge = LLMJudgeVerifier(engine)
    entropy = [label_entropy(x) for x in reference_lens(engine, judge, QUESTION, "7")]
    steps = [abs(entropy[i] - entropy[i - 1]) for i in range(3, NUM_LAYERS - 1)]
    # theta admits every layer, epsilon admits none of the real layer-to-layer moves: full depth.
    config = CGEEConfig(exit_enabled=True, theta=1.0, epsilon=min(steps) / 2, min_layer=2)
    assert min(steps) > 0
    (score,) = judge.score(QUESTION, ["7"], config)
    assert score.exit_layer == NUM_LAYERS - 1


def test_a_stopped_pass_caches_exactly_what_a_full_pass_caches_and_no_candidate_tail():
    model, tokenizer = make_tiny_model(0, num_layers=NUM_LAYERS), make_char_tokenizer()
    stopped_engine, full_engine = RKSCEngine(model, tokenizer), RKSCEngine(model, tokenizer)
    candidates = ["7", "8", "12"]
    forced = CGEEConfig(exit_enabled=True, theta=1.0, epsilon=1.0, min_layer=2)  # exits at layer 3 of 8
    stopped = LLMJudgeVerifier(stopped_engine).score(QUESTION, candidates, forced)
    assert {s.exit_layer for s in stopped} == {3}
    LLMJudgeVerifier(full_engine).score(QUESTION, candidates, CGEEConfig.off())

    assert stopped_engine.prefix_cache.total_tokens == full_engine.prefix_cache.total_tokens
    judge = LLMJudgeVerifier(stopped_engine)
    for answer in candidates:
        ids = judge.prompt_ids(QUESTION, answer)
        got = stopped_engine.prefix_cache.match_prefix(ids)
        want = full_engine.prefix_cache.match_prefix(ids)
        assert got.num_tokens == want.num_tokens < len(ids), "a candidate's own tokens entered the cache"
        torch.testing.assert_close(got.kv, want.kv, rtol=0, atol=0)
    assert all(not layer._forward_hooks for layer in model.model.layers), "an exit hook survived a stopped pass"
    # And generation that reuses the cached question prefix is still exact.
    prompt = judge.prompt_ids(QUESTION, "7")
    reused = stopped_engine.generate(prompt, SamplingParams(max_new_tokens=8))
    assert reused.num_cached_tokens > 0
    assert reused.token_ids == RKSCEngine(model, tokenizer).generate(prompt, SamplingParams(max_new_tokens=8)).token_ids


def first_exit(entropies_per_row, theta, min_layer=2):
    """The rule with epsilon wide open: the first checkable layer where every row is below theta."""
    return next((layer for layer in range(min_layer + 1, NUM_LAYERS - 1)
                 if all(row[layer] < theta for row in entropies_per_row)), NUM_LAYERS - 1)


def test_a_batch_stops_only_when_every_candidate_has_settled():
    engine = make_engine(0)
    judge = LLMJudgeVerifier(engine)
    rows = [[label_entropy(x) for x in reference_lens(engine, judge, QUESTION, a)] for a in ("7", "99")]
    # A theta at which one candidate alone would exit earlier than the pair: the batch must wait.
    thetas = sorted({(a[k] + b[k]) / 2 for k in range(3, NUM_LAYERS - 1) for a, b in [rows]})
    theta = next((t for t in thetas if min(first_exit([r], t) for r in rows) < first_exit(rows, t)), None)
    assert theta is not None, "test setup: no theta separates the two candidates"
    config = CGEEConfig(exit_enabled=True, theta=theta, epsilon=1.0, min_layer=2)
    scores = judge.score(QUESTION, ["7", "99"], config)
    assert scores[0].exit_layer == scores[1].exit_layer == first_exit(rows, theta)


def test_a_callable_verifier_sees_the_candidates_in_vote_order_and_must_score_each():
    engine = make_engine(0, num_layers=2)
    answers = iter(["b", "a", "b", "c"])
    seen = []

    def prm(question, candidates):
        seen.append((question, list(candidates)))
        return [0.5] * len(candidates)

    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)
    result = engine.reason("q?", n=4, params=params, prompt="Q:", answer_extractor=lambda t: next(answers),
                           verifier=prm, cgee=CGEEConfig.off())
    assert seen[0][0] == "q?" and seen[0][1] == [a for a, _ in result.vote_summary.shares]
    assert sorted(seen[0][1]) == ["a", "b", "c"]
    assert result.verification.exit_layers == [None, None, None], "a callable has no layers to exit from"
    answers = iter(["b", "a", "b", "c"])
    with pytest.raises(ValueError, match="3 candidates"):
        engine.reason("q?", n=4, params=params, prompt="Q:", answer_extractor=lambda t: next(answers),
                      verifier=lambda q, c: [1.0], cgee=CGEEConfig.off())


def test_the_report_summary_names_the_skip_and_the_scores():
    engine = make_engine(0, num_layers=2)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)
    skipped = engine.reason("q?", n=3, params=params, prompt="Q:", answer_extractor=lambda t: "5",
                            verifier=lambda q, c: [1.0] * len(c), cgee=CGEEConfig())
    assert "skipped" in str(skipped.verification) and "tau_conf" in skipped.verification.summary()
    answers = iter(["5", "6", "6"])
    verified = engine.reason("q?", n=3, params=params, prompt="Q:", answer_extractor=lambda t: next(answers),
                             verifier=lambda q, c: [0.25, 0.75][: len(c)], cgee=CGEEConfig.off())
    text = verified.verification.summary()
    assert "skipped" not in text and "score=0.250" in text and "score=0.750" in text


@pytest.mark.parametrize("text,want", [
    ("The answer is (B).", "B"),
    ("answer: d", "D"),
    ("(A) is wrong, so the answer is C.", "C"),
    ("no choice made", None),
])
def test_the_choice_extractor_takes_the_last_stated_letter(text, want):
    assert extract_choice_letter(text) == want


def test_the_regex_extractor_returns_none_without_a_match():
    assert regex_extractor(r"=\s*(\d+)")("no equals sign") is None
    assert regex_extractor(r"=\s*(\d+)")("a = 3, b = 41") == "41"


def test_wilson_interval_edges():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(0, 30)
    assert low == 0.0 and 0.10 < high < 0.12  # 0 of 30 still allows an 11% error rate
    low, high = wilson_interval(30, 30)
    assert high == 1.0 and 0.88 < low < 0.90
