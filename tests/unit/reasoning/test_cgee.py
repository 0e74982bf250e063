"""CGEE level 2 against an independent logit-lens reference, and the prefix cache after stopped passes.

``test_reasoning_cgee.py`` covers the forced cases (label rows blown up so every layer is certain);
here the exit layer is *predicted* from a plain, uncached forward pass with its own hooks, so the
online rule (entropy below theta and stable within epsilon) is checked against the definition.
"""

import pytest
import torch
from conftest import CountingHooks, make_char_tokenizer, make_tiny_model

from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.evaluation.calibration import wilson_interval
from rksc_engine.reasoning.cgee import CGEEConfig
from rksc_engine.reasoning.self_consistency import extract_choice_letter, regex_extractor
from rksc_engine.reasoning.verifier import LLMJudgeVerifier

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


# -- level 2 replayed offline, and calibrated ---------------------------------------------------
def test_replaying_the_recorded_lens_gives_the_exit_layer_and_scores_the_online_pass_gives():
    from rksc_engine.reasoning.cgee import lens_entropy, lens_exit_layer

    engine = make_engine(1)
    recorder = LLMJudgeVerifier(engine, record_lens=True)
    candidates = ["7", "8", "12"]
    _, trace = recorder.score_with_trace(QUESTION, candidates, CGEEConfig.off())
    assert trace.lens_logits.shape == (NUM_LAYERS, 3, 2)
    entropy = lens_entropy(trace.lens_logits)  # (L, B)
    online = LLMJudgeVerifier(engine)
    tried = set()
    for theta in sorted(float(x) for x in entropy[3:-1].max(-1).values) + [1.0]:
        for epsilon in (0.01, 0.1, 1.0):
            for min_layer in (1, 3):
                config = CGEEConfig(exit_enabled=True, theta=theta + 1e-6, epsilon=epsilon, min_layer=min_layer)
                want = lens_exit_layer(entropy, config)
                scores = online.score(QUESTION, candidates, config)
                assert {s.exit_layer for s in scores} == {want}, f"online and replayed exits differ for {config}"
                replayed = trace.lens_logits[want].softmax(-1)[:, 0]
                assert [s.score for s in scores] == pytest.approx(replayed.tolist(), abs=1e-5)
                tried.add(want)
    assert len(tried) >= 3, f"test setup: the configs reached too few distinct exit layers {tried}"


def lens_record(full_answer, early, late, switch_layer, num_layers=8):
    """A two-candidate record whose lens says ``early`` (logits per candidate) before
    ``switch_layer`` and ``late`` from it on; the full pass (last layer) says ``late``."""
    from rksc_engine.evaluation.calibration import CalibrationRecord
    from rksc_engine.reasoning.cgee import VoteSummary

    lens = torch.tensor([early if layer < switch_layer else late for layer in range(num_layers)], dtype=torch.float32)
    return CalibrationRecord(VoteSummary((("a", 0.6), ("b", 0.4))), full_answer, lens)


A_RIGHT = [[6.0, -6.0], [-6.0, 6.0]]  # judge: "a" yes, "b" no
B_RIGHT = [[-6.0, 6.0], [6.0, -6.0]]


def test_calibrate_turns_level_2_on_with_the_earliest_exit_when_the_lens_settles_early_and_right():
    from rksc_engine.evaluation.calibration import calibrate

    records = [lens_record("a", A_RIGHT, A_RIGHT, 0)] * 30
    result = calibrate(records, target_error=0.05, tau_grid=(), bound="empirical", min_layer_grid=range(0, 6))
    assert result.config.exit_enabled and not result.config.skip_enabled
    assert result.config.min_layer == 0 and result.mean_exit_layer == 1.0
    assert result.error_rate == 0.0
    assert result.work_saved == pytest.approx((8 - 1 - 1) / 8)


def test_calibrate_delays_the_exit_past_a_lens_that_is_confidently_wrong_in_early_layers():
    from rksc_engine.evaluation.calibration import calibrate

    # In a third of the questions the early lens backs "a" with certainty, but the full pass picks "b";
    # exiting before layer 5 would get those wrong. min_layer 4 exits at layer 5, after the flip.
    good = [lens_record("a", A_RIGHT, A_RIGHT, 0)] * 20
    traps = [lens_record("b", A_RIGHT, B_RIGHT, 5)] * 10
    result = calibrate(good + traps, target_error=0.01, tau_grid=(), bound="empirical", min_layer_grid=range(0, 6))
    assert result.config.exit_enabled and result.error_rate == 0.0
    assert result.config.min_layer == 4 and result.mean_exit_layer == 5.0
    looser = calibrate(good + traps, target_error=0.5, tau_grid=(), bound="empirical", min_layer_grid=range(0, 6))
    assert looser.config.min_layer == 0 and looser.error_rate == pytest.approx(10 / 30)


def test_calibrate_keeps_level_2_off_when_the_checks_cost_more_than_the_layers_they_save():
    from rksc_engine.evaluation.calibration import calibrate

    records = [lens_record("a", A_RIGHT, A_RIGHT, 0)] * 30
    result = calibrate(records, target_error=0.05, tau_grid=(), bound="empirical", check_cost=4.0)
    assert not result.config.exit_enabled and result.work_saved == 0.0


def test_calibrate_combines_a_skip_for_unanimous_votes_with_an_exit_for_the_rest():
    from rksc_engine.evaluation.calibration import CalibrationRecord, calibrate
    from rksc_engine.reasoning.cgee import VoteSummary

    unanimous = [CalibrationRecord(VoteSummary((("a", 1.0),)), "a", torch.tensor([[[6.0, -6.0]]] * 8))] * 20
    split = [lens_record("b", A_RIGHT, B_RIGHT, 5)] * 20
    result = calibrate(unanimous + split, target_error=0.01, bound="empirical", min_layer_grid=range(0, 6))
    assert result.config.skip_enabled and result.skip_rate == 0.5
    assert result.config.exit_enabled and result.config.min_layer == 4 and result.mean_exit_layer == 5.0
    assert result.error_rate == 0.0


def test_calibrate_without_lens_data_turns_level_2_off_and_round_trips_records_through_json():
    import json

    from rksc_engine.evaluation.calibration import CalibrationRecord, calibrate
    from rksc_engine.reasoning.cgee import VoteSummary

    base = CGEEConfig(exit_enabled=True)
    plain = [(VoteSummary((("7", 1.0),)), "7")] * 40
    assert not calibrate(plain, target_error=0.1, base=base).config.exit_enabled
    record = lens_record("b", A_RIGHT, B_RIGHT, 5)
    again = CalibrationRecord.from_dict(json.loads(json.dumps(record.to_dict())))
    assert again.summary == record.summary and again.full_answer == "b"
    torch.testing.assert_close(again.lens_logits, record.lens_logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="lens_logits"):
        calibrate([record, CalibrationRecord(record.summary, "a", torch.zeros(8, 3, 2))])
    with pytest.raises(ValueError, match="check_cost"):
        calibrate([record], check_cost=-1.0)


# -- the per-call estimate of the time saved ------------------------------------------------------
def test_the_pass_estimate_of_time_saved_is_the_unrun_layers_at_the_measured_rate_minus_the_checks():
    from rksc_engine.reasoning.verifier import PassTrace

    stopped = PassTrace(num_layers=6, layers_run=4, pass_s=0.4, check_s=0.04, prefill_s=0.1)
    assert stopped.time_saved_s == pytest.approx(0.09 * 2 - 0.04)
    assert stopped.full_depth_s == pytest.approx(0.1 + 0.09 * 6)
    checked_to_the_end = PassTrace(num_layers=6, layers_run=6, pass_s=0.6, check_s=0.05)
    assert checked_to_the_end.time_saved_s == pytest.approx(-0.05), "checks without an exit only cost time"
    assert PassTrace(num_layers=6, layers_run=6, pass_s=0.6).time_saved_s == 0.0


def test_a_verified_call_reports_zero_saved_at_full_depth_a_loss_when_checks_never_exit_and_a_gain_when_they_do():
    from rksc_engine.reasoning.self_consistency import BranchAnswer, verify_and_pick

    engine = make_engine(0)
    judge = LLMJudgeVerifier(engine)
    branches = [BranchAnswer("", a, 0.5) for a in ("7", "8", "7")]
    _, full, _ = verify_and_pick(QUESTION, branches, judge, CGEEConfig.off())
    assert full.time_saved_s == 0.0
    never = CGEEConfig(skip_enabled=False, exit_enabled=True, theta=1e-9, epsilon=1e-9, min_layer=1)
    _, checked, _ = verify_and_pick(QUESTION, branches, judge, never)
    assert set(checked.exit_layers) == {NUM_LAYERS - 1} and checked.check_s > 0
    assert checked.time_saved_s == pytest.approx(-checked.check_s)
    forced = CGEEConfig(skip_enabled=False, exit_enabled=True, theta=1.0, epsilon=1.0, min_layer=1)
    _, stopped, _ = verify_and_pick(QUESTION, branches, judge, forced)
    assert set(stopped.exit_layers) == {2}
    # The layers that did not run cost something, so the saving before the checks is positive.
    assert stopped.time_saved_s + stopped.check_s > 0
    assert "estimated time saved" in stopped.summary()


def test_a_skip_estimates_the_saving_from_the_verifiers_earlier_passes_and_says_unknown_before_any():
    from rksc_engine.reasoning.self_consistency import BranchAnswer, verify_and_pick

    engine = make_engine(0)
    judge = LLMJudgeVerifier(engine)
    unanimous = [BranchAnswer("", "7", 0.9)] * 4
    _, first, _ = verify_and_pick(QUESTION, unanimous, judge, CGEEConfig())
    assert first.skipped and first.time_saved_s is None and "unknown" in first.summary()
    split = [BranchAnswer("", a, 0.5) for a in ("7", "8")]
    _, verified, _ = verify_and_pick(QUESTION, split, judge, CGEEConfig.off())
    _, later, _ = verify_and_pick(QUESTION, unanimous, judge, CGEEConfig())
    assert later.skipped and later.time_saved_s > 0
    # One candidate costs about half of the two-candidate pass it was estimated from.
    assert later.time_saved_s == pytest.approx(judge.estimate_full_s(1))
    assert judge.estimate_full_s(2) == pytest.approx(2 * later.time_saved_s)
