"""The difficulty ladder (``ladder_problems``, ``ladder_shots``), the accuracy calibration with its
seeded split (``calibrate_split``), and the ladder path of ``benchmarks/cgee.py``
(``rksc_bench.cgee_ladder``) on a tiny model."""

from __future__ import annotations

import math
import operator
import re

import pytest
from conftest import make_char_tokenizer, make_tiny_model

from rksc_bench import cgee_ladder
from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.evaluation.calibration import (
    CalibrationRecord,
    QuestionOutcome,
    calibrate_accuracy,
    calibrate_split,
    split_outcomes,
    summarise_outcomes,
    wilson_interval,
)
from rksc_engine.evaluation.workloads import (
    LADDER_NAMES,
    NAMES,
    LadderProblem,
    ladder_problems,
    ladder_shots,
    solution_steps,
    synthetic_problems,
)
from rksc_engine.reasoning.answers import extract_gsm8k_answer
from rksc_engine.reasoning.cgee import CGEEConfig, VoteSummary
from rksc_engine.reasoning.few_shot import Problem, check_problems
from rksc_engine.reasoning.verifier import LLMJudgeVerifier

EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


# -- the generator ----------------------------------------------------------------------------------
def test_the_same_seed_gives_the_same_problems_and_another_seed_others():
    assert ladder_problems(5, seed=3) == ladder_problems(5, seed=3)
    assert ladder_shots(4, seed=2) == ladder_shots(4, seed=2)
    assert [p.question for p in ladder_problems(5, seed=3)] != [p.question for p in ladder_problems(5, seed=4)]
    assert [p.question for p in ladder_shots(4, seed=2)] != [p.question for p in ladder_shots(4, seed=5)]


def test_problems_interleave_levels_and_a_level_does_not_depend_on_the_others_or_on_the_count():
    both = ladder_problems(6, levels=(2, 4), seed=1)
    assert [p.level for p in both] == [2, 4] * 6
    alone = ladder_problems(6, levels=(4,), seed=1)
    assert [p for p in both if p.level == 4] == alone, "level 4's problems changed when level 2 was asked for too"
    assert ladder_problems(3, levels=(4,), seed=1) == alone[:3], "asking for more problems must only append"


def recompute(problem: Problem) -> list[int]:
    """Every step of the solution recomputed from its operands; asserts each is exact and positive, and
    that each operand is a number of the question or an earlier result. Returns the results."""
    known = {int(x) for x in re.findall(r"\d+", problem.question)}
    results = []
    for a, op, b, c in EQUATION.findall(problem.solution):
        a, b, c = int(a), int(b), int(c)
        assert a in known and b in known, f"operand of '{a} {op} {b}' is neither in the question nor a result: {problem}"
        if op == "/":
            assert a % b == 0, f"{a} / {b} leaves a remainder: {problem}"
            value = a // b
        else:
            value = OPS[op](a, b)
        assert value == c, f"{a} {op} {b} is {value}, the solution says {c}: {problem}"
        assert value > 0, f"intermediate value {value} is not positive: {problem}"
        known.add(value)
        results.append(value)
    return results


def test_every_step_recomputes_exactly_the_level_counts_the_steps_and_the_last_is_the_gold_answer():
    for problem in ladder_problems(60, seed=11) + ladder_shots(12):
        results = recompute(problem)
        assert len(results) == problem.level, f"level {problem.level} but {len(results)} steps: {problem}"
        assert solution_steps(problem) == problem.level, f"expected one solution line per step: {problem.solution!r}"
        assert str(results[-1]) == problem.answer, f"last step gives {results[-1]}, gold is {problem.answer}"
        assert problem.solution.endswith(f"\n#### {problem.answer}")
        assert extract_gsm8k_answer(problem.solution) == problem.answer


def skeleton(text: str) -> str:
    """The wording with numbers and names masked, lower-cased, punctuation dropped."""
    text = re.sub(r"\d+", "#", text)
    for name in NAMES + LADDER_NAMES:
        text = re.sub(rf"\b{name}\b", "NAME", text)
    return " ".join(re.sub(r"[^\w#]+", " ", text.lower()).split())


def word_runs(texts: list[str], length: int = 6) -> set[tuple[str, ...]]:
    runs = set()
    for text in texts:
        words = skeleton(text).split()
        runs.update(tuple(words[i: i + length]) for i in range(len(words) - length + 1))
    return runs


def test_each_level_is_worded_at_least_four_ways():
    problems = ladder_problems(40, seed=2)
    for level in (1, 2, 3, 4):
        questions = [p.question for p in problems if p.level == level]
        wordings = {skeleton(q) for q in questions}
        # Templates with a name put it in the same place, so masking leaves one wording per template.
        assert len(wordings) >= 4, f"level {level} has only {len(wordings)} wordings: {sorted(wordings)}"
        assert len({p.template for p in problems if p.level == level}) >= 4


def test_questions_share_no_six_word_run_with_synthetic_problems_or_with_the_worked_examples():
    questions = [p.question for p in ladder_problems(40, seed=5)]
    synthetic = [p.question for p in synthetic_problems(60, seed=5)]
    shots = [p.question for p in ladder_shots(20, seed=5)]
    assert not word_runs(questions) & word_runs(synthetic), word_runs(questions) & word_runs(synthetic)
    assert not word_runs(questions) & word_runs(shots), word_runs(questions) & word_runs(shots)
    assert not {p.template for p in ladder_shots(20)} & {p.template for p in ladder_problems(10)}


def test_shots_are_one_step_problems_the_reasoner_accepts_as_few_shot_examples():
    shots = ladder_shots(8, seed=1)
    assert all(isinstance(s, LadderProblem) and s.level == 1 for s in shots)
    assert len({s.template for s in shots}) == 4
    assert check_problems(shots) == shots
    assert ladder_shots(0) == []


@pytest.mark.parametrize("call, error, name", [
    (lambda: ladder_problems(0), ValueError, "num_per_level"),
    (lambda: ladder_problems(2.0), TypeError, "num_per_level"),
    (lambda: ladder_problems(True), TypeError, "num_per_level"),
    (lambda: ladder_problems(2, levels=()), TypeError, "levels"),
    (lambda: ladder_problems(2, levels="12"), TypeError, "levels"),
    (lambda: ladder_problems(2, levels=(1, 5)), ValueError, "levels"),
    (lambda: ladder_problems(2, levels=(2, 2)), ValueError, "levels"),
    (lambda: ladder_problems(2, levels=(1.0,)), ValueError, "levels"),
    (lambda: ladder_problems(2, seed="0"), TypeError, "seed"),
    (lambda: ladder_shots(-1), ValueError, "num"),
    (lambda: ladder_shots(1, seed=1.5), TypeError, "seed"),
])
def test_bad_arguments_raise_errors_that_name_the_parameter(call, error, name):
    with pytest.raises(error, match=name):
        call()


# -- the calibration split --------------------------------------------------------------------------
def outcome(p: float, *, vote_right: bool, full_right: bool, verify_s: float = 1.0,
            level: int | None = None) -> QuestionOutcome:
    """A question whose vote winner "A" has share ``p`` (runner-up "B" the rest, at most ``p``). The gold answer is
    "A" when the vote is right; always verifying picks the gold answer when right, else the other
    candidate ("B" when the vote is right, the vote's "A" when both are wrong, gold being "C")."""
    shares = (("A", p), ("B", min(p, 1 - p))) if p < 1 else (("A", 1.0),)
    gold = "A" if vote_right else ("B" if full_right else "C")
    full = gold if full_right else ("B" if vote_right else "A")
    return QuestionOutcome(VoteSummary(shares), full, gold, verify_s, level)


def test_outcomes_count_decisions_errors_and_accuracy_exactly():
    outcomes = [outcome(0.9, vote_right=True, full_right=True, verify_s=2.0),   # skipped, agrees
                outcome(0.9, vote_right=False, full_right=True, verify_s=3.0),  # skipped, lost
                outcome(0.9, vote_right=True, full_right=False, verify_s=4.0),  # skipped, gained
                outcome(0.5, vote_right=False, full_right=True, verify_s=5.0),  # verified
                QuestionOutcome(VoteSummary(()), None, "7")]                     # no candidate: no decision
    s = summarise_outcomes(outcomes, CGEEConfig(tau_conf=0.8, margin=0.5))
    assert (s.num_questions, s.num_decisions, s.num_skipped) == (5, 4, 3)
    assert (s.num_decision_errors, s.num_lost, s.num_gained) == (2, 1, 1)
    assert (s.num_vote_correct, s.num_full_correct, s.num_cgee_correct) == (2, 3, 3)
    assert s.num_cgee_correct == s.num_full_correct - s.num_lost + s.num_gained
    assert (s.verify_s, s.verify_s_saved) == (14.0, 9.0)
    assert s.decision_error_wilson == wilson_interval(2, 4)


def test_the_wilson_interval_matches_the_textbook_formula():
    low, high = wilson_interval(3, 40)
    z, n, phat = 1.96, 40, 3 / 40
    centre = (phat + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n))
    assert (low, high) == pytest.approx((centre - half, centre + half))
    assert 0 < low < 3 / 40 < high < 1


def lossy_ladder() -> list[QuestionOutcome]:
    """Confident votes (p = 0.9) that the verifier agrees with, and middling ones (p = 0.6) that are
    wrong and the verifier fixes: skipping the middling ones costs accuracy, the confident ones not."""
    safe = [outcome(0.9, vote_right=True, full_right=True, verify_s=1.0) for _ in range(40)]
    fixed = [outcome(0.6, vote_right=False, full_right=True, verify_s=1.0) for _ in range(20)]
    hard = [outcome(0.3, vote_right=False, full_right=False, verify_s=1.0) for _ in range(20)]
    return safe + fixed + hard


@pytest.mark.parametrize("rule", ["wilson", "observed"])
def test_a_threshold_that_loses_accuracy_is_not_chosen_even_though_it_saves_more(rule):
    outcomes = lossy_ladder()
    lossy = summarise_outcomes(outcomes, CGEEConfig(tau_conf=0.55, margin=0.0))
    assert lossy.verify_s_saved == 60 and not lossy.keeps_accuracy(rule), "test setup: skipping p=0.6 must lose"
    config, summary = calibrate_accuracy(outcomes, rule)
    assert config.skip_enabled and 0.6 < config.tau_conf <= 0.9, config
    assert summary.num_skipped == 40 and summary.num_lost == 0, summary
    assert summary.num_cgee_correct == summary.num_full_correct


def test_the_wilson_rule_tolerates_a_loss_inside_the_interval_and_the_observed_rule_does_not():
    outcomes = lossy_ladder()[:40] + [outcome(0.6, vote_right=False, full_right=True)] + lossy_ladder()[60:]
    wilson, _ = calibrate_accuracy(outcomes, "wilson")
    observed, _ = calibrate_accuracy(outcomes, "observed")
    assert wilson.tau_conf <= 0.6, f"one loss in 61 is inside the Wilson interval: skip it too ({wilson})"
    assert observed.tau_conf > 0.6, f"the observed rule must not lose that question ({observed})"


def test_a_judge_worse_than_the_vote_makes_skipping_everything_the_choice():
    outcomes = [outcome(0.4, vote_right=True, full_right=False) for _ in range(10)]
    outcomes += [outcome(0.9, vote_right=True, full_right=True) for _ in range(10)]
    config, summary = calibrate_accuracy(outcomes, "observed")
    assert summary.skip_rate == 1.0 and summary.cgee_accuracy == 1.0 > summary.full_accuracy, (config, summary)


def test_without_measured_verifier_time_skipping_stays_off():
    outcomes = [outcome(1.0, vote_right=True, full_right=True, verify_s=0.0) for _ in range(5)]
    config, _ = calibrate_accuracy(outcomes)
    assert not config.skip_enabled


def test_the_split_is_seeded_disjoint_complete_and_halves_every_level():
    outcomes = [outcome(0.9, vote_right=True, full_right=True, level=1 + i % 3) for i in range(61)]
    calibration, held_out = split_outcomes(outcomes, seed=7)
    assert (calibration, held_out) == split_outcomes(outcomes, seed=7)
    assert (calibration, held_out) != split_outcomes(outcomes, seed=8)
    assert not set(calibration) & set(held_out)
    assert sorted(calibration + held_out) == list(range(61))
    for level in (1, 2, 3):
        ours = [i for i in calibration if outcomes[i].level == level]
        theirs = [i for i in held_out if outcomes[i].level == level]
        assert len(ours) - len(theirs) in (0, 1), f"level {level}: {len(ours)} vs {len(theirs)}"


def test_calibrate_split_chooses_on_one_half_and_reports_the_other_per_level():
    outcomes = [QuestionOutcome(o.summary, o.full_answer, o.gold, o.verify_s, level=1 + i % 2)
                for i, o in enumerate(lossy_ladder())]
    split = calibrate_split(outcomes, seed=3)
    held = [outcomes[i] for i in split.held_out_indices]
    assert split.held_out == summarise_outcomes(held, split.config)
    assert split.calibration == summarise_outcomes([outcomes[i] for i in split.calibration_indices], split.config)
    assert split.config == calibrate_accuracy([outcomes[i] for i in split.calibration_indices])[0]
    assert set(split.held_out_by_level) == {1, 2}
    assert sum(s.num_questions for s in split.held_out_by_level.values()) == split.held_out.num_questions
    low, high = split.held_out.decision_error_wilson
    assert (low, high) == wilson_interval(split.held_out.num_decision_errors, split.held_out.num_decisions)
    assert split.held_out.num_lost == 0 and split.keeps_accuracy_held_out


@pytest.mark.parametrize("call, error, name", [
    (lambda: calibrate_split([]), ValueError, "outcomes"),
    (lambda: calibrate_split([("A", 1.0)]), TypeError, "outcomes"),
    (lambda: calibrate_split([outcome(0.9, vote_right=True, full_right=True)]), ValueError, "two questions"),
    (lambda: calibrate_split(lossy_ladder(), rule="loose"), ValueError, "rule"),
    (lambda: calibrate_split(lossy_ladder(), seed=None), TypeError, "seed"),
])
def test_bad_calibration_arguments_raise_errors_that_name_them(call, error, name):
    with pytest.raises(error, match=name):
        call()


def test_an_outcome_round_trips_through_json_and_reads_as_a_calibration_record():
    o = outcome(0.7, vote_right=False, full_right=True, verify_s=0.25, level=3)
    assert QuestionOutcome.from_dict(o.to_dict()) == o
    record = CalibrationRecord.from_dict(o.to_dict())
    assert (record.summary, record.full_answer) == (o.summary, o.full_answer)


# -- the benchmark's ladder path --------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench():
    return cgee_ladder


def run_tiny_ladder(bench):
    engine = RKSCEngine(make_tiny_model(max_positions=2048), make_char_tokenizer())
    judge = LLMJudgeVerifier(engine, record_lens=True)
    batch = list(enumerate(ladder_problems(2, levels=(1, 2), seed=0)))
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6)
    engine.reset_stats()
    records = bench.run_ladder_batch(engine, judge, batch, ladder_shots(1), "gsm8k", params, branches=3)
    return engine, batch, records


def test_the_ladder_batch_records_every_question_with_what_calibration_needs(bench):
    engine, batch, records = run_tiny_ladder(bench)
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    assert [r["level"] for r in records] == [1, 2, 1, 2]
    assert [r["gold"] for r in records] == [p.answer for _, p in batch]
    assert engine.stats().peak_batch_rows > 3, "the questions' branches should decode in one batch"
    for r in records:
        o = QuestionOutcome.from_dict(r)
        assert len(r["branches"]) == 3 and r["generate_s"] > 0
        assert (o.summary.p, o.summary.lead) == (pytest.approx(r["p"]), pytest.approx(r["lead"]))
        if o.summary.winner is None:
            assert o.full_answer is None and o.verify_s == 0
        else:
            assert o.full_answer in dict(o.summary.shares) and o.verify_s > 0 and "full_pass_s" in r
            lens = CalibrationRecord.from_dict(r).lens_logits  # what level-2 calibration replays
            assert tuple(lens.shape) == (2, len(o.summary.shares), 2), "lens: (layers, candidates, Yes/No)"
    _, _, again = run_tiny_ladder(bench)
    assert [r["branches"] for r in again] == [r["branches"] for r in records], "branches must be seeded"


def test_the_ladder_report_tabulates_every_level_and_prints(bench, capsys):
    _, _, records = run_tiny_ladder(bench)
    report = bench.ladder_report(records, seed=0, candidate=CGEEConfig(tau_conf=0.5, margin=0.0))
    assert len(report["tables"]) == 4
    assert report["chosen_by_decision_error"]["target_error"] == 0.01
    for rows in report["tables"].values():
        assert rows[-1]["group"] == "all" and all(0 < r["end_to_end_ratio"] <= 1 for r in rows), rows
    everything = report["tables"]["library default CGEEConfig(), all questions"]
    assert [r["group"] for r in everything] == ["1", "2", "all"] and everything[-1]["num_questions"] == 4
    meta = {"source": "test", "branches": 3, "shots": 1, "model": "tiny"}
    bench.print_ladder(report, meta)
    out = capsys.readouterr().out
    assert "| level | questions |" in out and "Chosen on the calibration half" in out
    assert "for decision error <= 1%" in out and "The vote's confidence p against right answers" in out


def test_a_ladder_run_resumes_where_its_records_end_and_refuses_other_settings(bench, tmp_path):
    import argparse
    import json

    model_dir = tmp_path / "tiny"
    make_tiny_model(max_positions=2048).save_pretrained(model_dir)
    make_char_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "records.json"
    args = argparse.Namespace(model=str(model_dir), data=None, levels="1,2", per_level=2, shots=1, seed=0,
                              record_lens=False, max_new_tokens=6, batch=2, branches=2, time_budget_min=None,
                              resume=False)
    _, full = bench.run_ladder(args, out)
    assert [r["index"] for r in full] == [0, 1, 2, 3]
    saved = json.loads(out.read_text())
    out.write_text(json.dumps({"meta": saved["meta"], "records": saved["records"][:2]}))  # as if interrupted
    args.resume = True
    _, resumed = bench.run_ladder(args, out)
    assert [r["index"] for r in resumed] == [0, 1, 2, 3]
    # Seeded by index: the missing questions draw the branches they drew before (texts; the confidences
    # may differ in the last float bits, as the first run had the shots cached and this one computes them).
    texts = [[b["text"] for b in r["branches"]] for r in resumed]
    assert texts == [[b["text"] for b in r["branches"]] for r in full], "the missing questions ran as before"
    args.branches = 3
    with pytest.raises(SystemExit, match="branches"):
        bench.run_ladder(args, out)


def test_untimed_questions_count_in_decisions_but_not_in_seconds(bench):
    _, _, records = run_tiny_ladder(bench)
    skip_all = CGEEConfig(tau_conf=0.0, margin=0.0)
    timed = bench.ladder_report(records, seed=0, candidate=skip_all)
    level_two = frozenset(r["index"] for r in records if r["level"] == 2)
    partly = bench.ladder_report(records, seed=0, candidate=skip_all, untimed=level_two)
    title = next(t for t in timed["tables"] if t.startswith("candidate"))
    for before, after in zip(timed["tables"][title], partly["tables"][title]):
        assert (after["num_decisions"], after["num_decision_errors"]) == (before["num_decisions"], before["num_decision_errors"])
    by_group = {r["group"]: r for r in partly["tables"][title]}
    assert by_group["2"]["generate_s"] == 0 and by_group["2"]["verify_s_saved"] == 0
    assert by_group["1"]["generate_s"] == pytest.approx(sum(r["generate_s"] for r in records if r["level"] == 1))
    assert partly["timed_questions"] == len(records) - len(level_two)
    assert bench.parse_index_ranges("3-5, 9") == {3, 4, 5, 9} and bench.parse_index_ranges(None) == frozenset()
    for bad in ("5-3", "x", "-1"):
        with pytest.raises(ValueError, match="untimed"):
            bench.parse_index_ranges(bad)


def test_the_ladder_plot_is_written(bench, tmp_path):
    pytest.importorskip("matplotlib")
    _, _, records = run_tiny_ladder(bench)
    report = bench.ladder_report(records, seed=0, candidate=CGEEConfig(tau_conf=0.0, margin=0.0))
    bench.plot_ladder(report, tmp_path / "ladder.png")
    assert (tmp_path / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
