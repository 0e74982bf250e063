"""The level-2 exit rules of ``benchmarks/cgee_lens_exit.py`` (``rksc_bench.lens_exit``), replayed on
recorded logit lenses."""

from __future__ import annotations

import json
import math

import pytest
from conftest import make_char_tokenizer, make_tiny_model

import rksc_bench.cgee_ladder
import rksc_bench.lens_exit
from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.evaluation.workloads import ladder_problems, ladder_shots
from rksc_engine.reasoning.cgee import CGEEConfig, lens_entropy, lens_exit_layer
from rksc_engine.reasoning.verifier import LLMJudgeVerifier


@pytest.fixture(scope="module")
def lens_exit():
    return rksc_bench.lens_exit


def yes_no(p_yes: float) -> list[float]:
    """Yes/No logits whose softmax gives ``p_yes``."""
    return [math.log(p_yes), math.log(1 - p_yes)]


def flipping_record(late_yes=(0.9, 0.9, 0.9, 0.9), **overrides) -> dict:
    """Ten layers, three candidates with shares 0.5/0.3/0.2. Layers 0-5 read P(Yes)=0.5 for all, so
    the pick is the vote winner "a"; layers 6-9 read candidate "b" at ``late_yes`` and "a" at 0.1,
    so from layer 6 on the pick is "b", which is full depth's answer."""
    lens = [[yes_no(0.5)] * 3 for _ in range(6)]
    lens += [[yes_no(0.1), yes_no(p), yes_no(0.5)] for p in late_yes]
    record = {"shares": [["a", 0.5], ["b", 0.3], ["c", 0.2]], "full_answer": "b", "gold": "b", "level": 1,
              "verify_s": 1.0, "full_pass_s": 1.0, "lens_logits": lens}
    record.update(overrides)
    return record


def test_the_pick_rule_exits_once_the_pick_is_stable_for_its_window_and_never_on_the_last_layer(lens_exit):
    record = lens_exit.LensRecord.from_dict(flipping_record())
    assert [record.pick_at(layer) for layer in (0, 5, 6, 9)] == ["a", "a", "b", "b"]
    rule = lens_exit.ExitRule
    assert lens_exit.exit_layer(record, rule("pick", 0, 3)) == 2, "layers 0-2 agree on 'a'"
    assert lens_exit.exit_layer(record, rule("pick", 6, 2)) == 7
    assert lens_exit.exit_layer(record, rule("pick", 6, 4)) == 9, "a window ending on the last layer is no exit"
    assert lens_exit.exit_layer(record, rule("pick", 4, 2)) == 5, "layers 4-5 agree before the flip"


def test_the_ranking_rule_needs_the_whole_order_stable_and_the_margin_rule_a_stable_gap(lens_exit):
    rising = lens_exit.LensRecord.from_dict(flipping_record(late_yes=(0.6, 0.7, 0.8, 0.9)))
    rule = lens_exit.ExitRule
    # Order from layer 6 on: b (0.3 x 0.6 = 0.18 ... 0.27) > c (0.1) > a (0.05), stable throughout.
    assert lens_exit.exit_layer(rising, rule("ranking", 6, 2)) == 7
    assert lens_exit.exit_layer(rising, rule("pick", 6, 2)) == 7
    # The top-two gap grows layer by layer, so a tight epsilon never exits and a loose one does.
    assert lens_exit.exit_layer(rising, rule("margin", 6, 2, epsilon=0.01)) == 9
    assert lens_exit.exit_layer(rising, rule("margin", 6, 2, epsilon=1.0)) == 7
    swapped = flipping_record()
    swapped["lens_logits"][7] = [yes_no(0.25), yes_no(0.9), yes_no(0.5)]  # a (0.125) passes c (0.1) at layer 7 only
    swapped = lens_exit.LensRecord.from_dict(swapped)
    assert lens_exit.exit_layer(swapped, rule("pick", 6, 2)) == 7, "the pick stays b"
    assert lens_exit.exit_layer(swapped, rule("ranking", 6, 2)) == 9, "the order changed at 7 and 8"


def test_the_entropy_rule_is_the_librarys_rule(lens_exit):
    record = lens_exit.LensRecord.from_dict(flipping_record())
    for theta, eps, start in ((0.6, 0.05, 0), (0.4, 0.01, 3), (0.7, 0.05, 5)):
        config = CGEEConfig(exit_enabled=True, theta=theta, epsilon=eps, min_layer=start)
        expected = lens_exit_layer(lens_entropy(record.lens), config)
        assert lens_exit.exit_layer(record, lens_exit.ExitRule("entropy", start, epsilon=eps, theta=theta)) == expected


def test_evaluate_counts_errors_accuracy_and_work_saved_net_of_checks(lens_exit):
    record = lens_exit.LensRecord.from_dict(flipping_record())
    rule = lens_exit.ExitRule
    early = lens_exit.evaluate([record], rule("pick", 0, 3))
    assert (early.errors, early.correct, early.full_correct) == (1, 0, 1), "exiting at layer 2 answers 'a'"
    assert early.layers_saved_fraction == pytest.approx(7 / 10)
    late = lens_exit.evaluate([record, record], rule("pick", 6, 2), check_cost=0.5)
    assert (late.errors, late.correct, late.decisions) == (0, 2, 2)
    # Exit at layer 7 skips layers 8-9 (2 of 10) and paid checks at layers 6 and 7 (2 x 0.5 layer).
    assert late.layers_saved_fraction == pytest.approx((2 - 1.0) / 10)
    assert late.seconds_saved == pytest.approx(2 * 0.1) and late.mean_exit_layer == 7


def test_choose_keeps_to_the_error_target_and_says_when_nothing_qualifies(lens_exit):
    records = [lens_exit.LensRecord.from_dict(flipping_record()) for _ in range(200)]
    rules = [lens_exit.ExitRule("pick", start, 2) for start in range(0, 8)]
    rule, result = lens_exit.choose(records, rules, target_error=0.05, check_cost=0.0)
    assert rule.min_layer == 6 and result.errors == 0, "every earlier start exits on the stale pick"
    assert lens_exit.choose(records, rules[:5], target_error=0.05, check_cost=0.0) == (None, None)
    with pytest.raises(ValueError, match="kind"):
        lens_exit.ExitRule("vibes", 0)
    with pytest.raises(ValueError, match="window"):
        lens_exit.ExitRule("pick", 0, 1)


def test_the_report_reads_saved_records_skips_single_candidates_and_renders(lens_exit, tmp_path):
    raw = [flipping_record(level=1 + i % 2) for i in range(40)]
    raw.append(flipping_record(shares=[["a", 1.0]], lens_logits=[[yes_no(0.5)]] * 10))  # nothing to decide
    raw.append({**flipping_record(), "lens_logits": None})  # verified without a lens
    path = tmp_path / "records.json"
    path.write_text(json.dumps({"meta": {"source": "test", "model": "tiny"}, "records": raw}))
    meta, records = lens_exit.load_records(path)
    assert len(records) == 40
    result = lens_exit.report(meta, records, seed=0, target_error=0.2, check_cost=0.0)
    assert result["decisions"] == 40 and result["vote_overturned"] == 40
    assert result["chosen"]["pick"]["held_out"].decisions == 20
    assert result["agreement"]["full"][:6] == [0.0] * 6 and result["agreement"]["full"][6:] == [1.0] * 4
    text = lens_exit.render(result)
    assert "| rule |" in text and "| error cap |" in text and "Lens pick = vote winner" in text


def test_the_replayed_last_layer_pick_is_the_verifiers_own_pick_on_a_real_run(lens_exit):
    bench = rksc_bench.cgee_ladder
    engine = RKSCEngine(make_tiny_model(max_positions=2048), make_char_tokenizer())
    judge = LLMJudgeVerifier(engine, record_lens=True)
    batch = list(enumerate(ladder_problems(3, levels=(1, 2), seed=0)))
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6)
    raw = bench.run_ladder_batch(engine, judge, batch, ladder_shots(1), "gsm8k", params, branches=4)
    verified = [lens_exit.LensRecord.from_dict(r) for r in raw if r.get("lens_logits") and len(r["shares"]) >= 2]
    assert verified, "the tiny run should leave at least one vote with two candidates"
    for record in verified:
        assert record.pick_at(record.num_layers - 1) == record.full_answer
