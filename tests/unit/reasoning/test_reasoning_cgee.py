"""Verified self-consistency and both CGEE levels on a tiny seeded model."""

import pytest
import torch
from conftest import CountingHooks, make_char_tokenizer, make_tiny_model

from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.evaluation.calibration import wilson_interval
from rksc_engine.reasoning.cgee import CGEEConfig, should_skip, summarise_votes
from rksc_engine.reasoning.self_consistency import extract_choice_letter, regex_extractor
from rksc_engine.reasoning.verifier import LLMJudgeVerifier

PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0, seed=0)


def make_engine(num_layers=4):
    return RKSCEngine(make_tiny_model(0, num_layers=num_layers), make_char_tokenizer())


def full_depth_scores(engine, judge, question, candidates):
    """Plain scoring: one complete forward per candidate, no cache, no hooks."""
    out = []
    for c in candidates:
        ids = torch.tensor([judge.prompt_ids(question, c)])
        logits = engine.model(input_ids=ids).logits[0, -1, judge.label_ids]
        out.append(logits.softmax(-1)[0].item())
    return out


def digit_extractor(text):
    digits = [ch for ch in text if ch.isdigit()]
    return digits[0] if digits else text[:1] or None


@pytest.mark.slow
def test_with_cgee_off_verification_equals_full_depth_scoring_of_each_candidate():
    engine = make_engine()
    result = engine.reason("What is 1+1?", n=6, params=PARAMS, prompt="Q: 1+1\nA:",
                           answer_extractor=lambda t: t[:1] or None, cgee=CGEEConfig.off())
    report = result.verification
    assert not report.skipped
    candidates = [s.answer for s in report.scores]
    assert len(candidates) == len(result.votes)
    want = full_depth_scores(engine, LLMJudgeVerifier(engine), "What is 1+1?", candidates)
    assert [s.score for s in report.scores] == pytest.approx(want, abs=1e-5)
    assert all(layer == 3 for layer in report.exit_layers)


def test_a_confident_unanimous_vote_skips_verification_and_says_why():
    engine = make_engine()
    calls = []
    result = engine.reason("q?", n=4, params=PARAMS, prompt="Q:", answer_extractor=lambda t: "42",
                           verifier=lambda q, c: calls.append(c) or [1.0] * len(c), cgee=CGEEConfig())
    assert result.verification.skipped and not calls
    assert result.answer == "42"
    assert result.verification.p == 1.0 and result.verification.lead == 1.0
    assert "tau_conf" in result.verification.reason


def test_a_split_vote_is_verified_and_the_verifier_can_overturn_the_majority():
    engine = make_engine()
    answers = iter(["a", "a", "a", "b"])
    result = engine.reason("q?", n=4, params=PARAMS, prompt="Q:", answer_extractor=lambda t: next(answers),
                           verifier=lambda q, c: [0.01 if x == "a" else 0.99 for x in c],
                           cgee=CGEEConfig(tau_conf=0.9))
    assert not result.verification.skipped
    assert result.answer == "b"


def test_vote_shares_are_confidence_weighted():
    summary = summarise_votes(["x", "x", "y", None], [0.9, 0.3, 0.6, 1.0])
    assert summary.winner == "x"
    assert summary.p == pytest.approx(1.2 / 1.8)
    assert summary.lead == pytest.approx((1.2 - 0.6) / 1.8)
    assert should_skip(summary, CGEEConfig(tau_conf=0.6, margin=0.3))[0]
    assert not should_skip(summary, CGEEConfig(tau_conf=0.7, margin=0.3))[0]


def test_a_low_entropy_pass_exits_at_the_expected_layer_and_later_layers_do_not_run():
    engine = make_engine(num_layers=6)
    judge = LLMJudgeVerifier(engine)
    # Make the label rows of the head huge and far apart so label entropy is ~0 from the first
    # checked layer on; with min_layer=2 the exit needs a stable previous value, so it stops at 3.
    with torch.no_grad():
        head = engine.model.lm_head.weight
        head[judge.label_ids[0]] = head[judge.label_ids[0]].sign() * 50
        head[judge.label_ids[1]] = -head[judge.label_ids[0]]
    layers = engine.model.model.layers
    counter = CountingHooks(layers)
    try:
        scores = judge.score("q?", ["1"], CGEEConfig(exit_enabled=True, theta=0.5, epsilon=0.1, min_layer=2))
    finally:
        counter.remove()
    assert scores[0].exit_layer == 3
    assert counter.calls[4] == 0 and counter.calls[5] == 0, f"layers after the exit ran: {counter.calls}"
    assert counter.calls[3] >= 1


def test_hooks_are_removed_and_the_cache_is_consistent_after_an_exception_in_a_pass():
    engine = make_engine()
    judge = LLMJudgeVerifier(engine)
    layer = engine.model.model.layers[1]
    boom = layer.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    before_bytes = engine.prefix_cache.total_bytes
    with pytest.raises(RuntimeError, match="boom"):
        judge.score("q?", ["1", "2"], CGEEConfig(exit_enabled=True))
    boom.remove()
    assert all(not layer._forward_hooks for layer in engine.model.model.layers), "a CGEE hook was left behind"
    assert engine.prefix_cache.evictable_bytes == engine.prefix_cache.total_bytes, "a node stayed locked"
    assert engine.prefix_cache.total_bytes == before_bytes
    # Still usable and exact afterwards.
    again = judge.score("q?", ["1", "2"], CGEEConfig.off())
    assert [s.score for s in again] == pytest.approx(full_depth_scores(engine, judge, "q?", ["1", "2"]), abs=1e-5)


def test_extractors_and_bad_arguments():
    assert extract_choice_letter("I think the answer is (C).") == "C"
    assert extract_choice_letter("no letter here") is None
    assert extract_choice_letter("So the answer is B. A quick check confirms it.") == "B"
    assert regex_extractor(r"ans=(\d+)")("ans=3 then ans=5") == "5"
    engine = make_engine()
    with pytest.raises(ValueError, match="answer_extractor"):
        engine.reason("q?", n=2, params=PARAMS, prompt="Q:", answer_extractor="roman")
    with pytest.raises(ValueError, match="question"):
        engine.reason("", n=2, params=PARAMS)
    with pytest.raises(ValueError, match="cgee.tau_conf"):
        CGEEConfig(tau_conf=1.5)
    with pytest.raises(ValueError, match="cgee.theta"):
        CGEEConfig(theta=0)


def test_a_failing_verifier_surfaces_and_the_engine_stays_usable():
    engine = make_engine()

    def broken(q, c):
        raise ConnectionError("reward model down")

    with pytest.raises(ConnectionError):
        engine.reason("q?", n=3, params=PARAMS, prompt="Q:", answer_extractor=lambda t: t[:1] or None,
                      verifier=broken, cgee=CGEEConfig.off())
    assert engine.generate("Q:", SamplingParams(max_new_tokens=4)).token_ids


def test_wilson_interval_matches_the_papers_figure():
    low, high = wilson_interval(6, 1616)
    assert round(low * 100, 2) == 0.17 and round(high * 100, 2) == 0.81


def test_calibrate_picks_the_loosest_thresholds_that_meet_the_target():
    from rksc_engine.evaluation.calibration import calibrate
    from rksc_engine.reasoning.cgee import VoteSummary

    confident = [(VoteSummary((("7", 1.0),)), "7")] * 40           # unanimous and right
    shaky = [(VoteSummary((("3", 0.6), ("4", 0.4))), "4")] * 10     # a weak winner that full verification overturns
    result = calibrate(confident + shaky, target_error=0.05, bound="empirical")
    assert result.skip_rate == pytest.approx(40 / 50)
    assert result.error_rate == 0.0
    assert result.config.tau_conf > 0.6 or result.config.margin > 0.2, "the shaky winners must not be skipped"
    loose = calibrate(confident + shaky, target_error=0.25, bound="empirical")
    assert loose.skip_rate == 1.0 and loose.error_rate == pytest.approx(0.2)
    nothing = calibrate(shaky, target_error=0.01)
    assert not nothing.config.skip_enabled


def test_batched_judging_of_candidates_of_different_lengths_equals_scoring_each_alone():
    engine = make_engine()
    judge = LLMJudgeVerifier(engine)
    candidates = ["1", "12345", "a much longer candidate answer"]
    got = judge.score("How many?", candidates, CGEEConfig.off())
    want = full_depth_scores(engine, judge, "How many?", candidates)
    assert [s.score for s in got] == pytest.approx(want, abs=1e-5), "right padding changed a score"
    assert engine.stats().prompt_tokens_reused > 0, "the shared question prefix should come from the cache"


# -- CGEE as an engine setting ----------------------------------------------------------------------
def test_engine_reason_uses_the_engines_cgee_config_when_the_call_passes_none():
    from rksc_engine import EngineConfig

    model, tokenizer = make_tiny_model(0, num_layers=2), make_char_tokenizer()
    calls = []

    def judge(q, c):
        calls.append(list(c))
        return [1.0] * len(c)

    kwargs = dict(n=3, params=PARAMS, prompt="Q:", answer_extractor=lambda t: "42", verifier=judge)
    default = RKSCEngine(model, tokenizer)
    assert default.config.cgee == CGEEConfig()
    assert default.reason("q?", **kwargs).verification.skipped and not calls
    never_skip = RKSCEngine(model, tokenizer, EngineConfig(cgee=CGEEConfig(skip_enabled=False)))
    report = never_skip.reason("q?", **kwargs).verification
    assert not report.skipped and calls == [["42"]], "the engine's cgee setting was ignored"
    assert never_skip.reason("q?", cgee=CGEEConfig(), **kwargs).verification.skipped, "a per-call cgee must win"


def test_a_bad_cgee_setting_names_the_field_and_a_bad_call_leaves_the_engine_and_cache_intact():
    from rksc_engine import EngineConfig
    from rksc_engine import config as config_module
    from rksc_engine.reasoning import cgee as cgee_module

    assert cgee_module.CGEEConfig is config_module.CGEEConfig, "rksc_engine.reasoning.cgee must re-export the one CGEEConfig"
    with pytest.raises(TypeError, match="cgee must be CGEEConfig"):
        EngineConfig(cgee={"tau_conf": 0.9})
    with pytest.raises(ValueError, match=r"cgee.min_layer must be >= 0"):
        EngineConfig(cgee=CGEEConfig(min_layer=-1))
    engine = make_engine()
    engine.generate("Q: 1+1\nA:", SamplingParams(max_new_tokens=4))
    before = (engine.prefix_cache.total_bytes, engine.stats().requests)
    with pytest.raises(TypeError, match="cgee must be a CGEEConfig"):
        engine.reason("q?", n=2, params=PARAMS, prompt="Q:", cgee={"tau_conf": 0.9})
    assert (engine.prefix_cache.total_bytes, engine.stats().requests) == before, "a rejected call touched the engine"
    assert engine.generate("Q: 1+1\nA:", SamplingParams(max_new_tokens=4)).num_cached_tokens > 0


def test_the_default_judge_is_kept_per_engine_so_a_later_skip_can_estimate_its_saving():
    engine = make_engine()
    answers = iter(["1", "2", "1", "1", "1", "1"])
    extract = lambda t: next(answers)  # noqa: E731
    verified = engine.reason("q?", n=3, params=PARAMS, prompt="Q:", answer_extractor=extract, cgee=CGEEConfig.off())
    assert not verified.verification.skipped and verified.verification.time_saved_s == 0.0
    skipped = engine.reason("q?", n=3, params=PARAMS, prompt="Q:", answer_extractor=extract)
    assert skipped.verification.skipped and skipped.verification.time_saved_s > 0
    fresh = make_engine()
    first = fresh.reason("q?", n=3, params=PARAMS, prompt="Q:", answer_extractor=lambda t: "1")
    assert first.verification.skipped and first.verification.time_saved_s is None


# -- multiple-choice questions ----------------------------------------------------------------------
def test_synthetic_choice_problems_are_seeded_balanced_and_readable_by_the_choice_extractor():
    from rksc_engine.evaluation.workloads import synthetic_choice_problems

    problems = synthetic_choice_problems(60, seed=3)
    assert problems == synthetic_choice_problems(60, seed=3) and problems != synthetic_choice_problems(60, seed=4)
    assert all(extract_choice_letter(p.solution) == p.answer for p in problems)
    assert all(f"\n{p.answer}) " in p.question for p in problems), "the key must be one of the rendered choices"
    counts = {letter: sum(p.answer == letter for p in problems) for letter in "ABCD"}
    assert min(counts.values()) >= 6, f"the right choice's position is not spread: {counts}"
    assert {p.answer for p in synthetic_choice_problems(20, num_choices=2)} <= {"A", "B"}
    with pytest.raises(ValueError, match="num_choices"):
        synthetic_choice_problems(1, num_choices=5)


def test_choice_jsonl_reads_lists_arc_style_dicts_and_numeric_labels(tmp_path):
    import json

    from rksc_engine.evaluation.workloads import jsonl_format, load_choice_jsonl, load_problems_jsonl

    rows = [
        {"question": "2+2?", "choices": ["3", "4", "5"], "answerKey": "B"},
        {"question": "Sky colour?", "choices": {"text": ["red", "blue"], "label": ["A", "B"]}, "answerKey": "B"},
        {"question": "Odd one?", "choices": {"text": ["2", "4", "7", "8"], "label": ["1", "2", "3", "4"]},
         "answerKey": "3"},
    ]
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    problems = load_choice_jsonl(path)
    assert [p.answer for p in problems] == ["B", "B", "C"], "numeric labels must map onto letters"
    assert problems[0].question == "2+2?\nA) 3\nB) 4\nC) 5"
    assert problems[2].question.endswith("C) 7\nD) 8")
    assert jsonl_format(path) == "choice" and load_problems_jsonl(path, limit=2)[1] == problems[:2]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answerKey": "E"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: answerKey 'E'"):
        load_choice_jsonl(bad)
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    assert load_problems_jsonl(gsm) == ("gsm8k", load_problems_jsonl(gsm)[1]) and load_problems_jsonl(gsm)[1][0].answer == "2"
