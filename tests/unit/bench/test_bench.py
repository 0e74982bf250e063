"""`rksc bench` on a tiny seeded model: the arms answer the same questions, the exact arms agree,
and the reuse arms compute fewer prompt tokens than the no-reuse arm."""

from __future__ import annotations

import json
from dataclasses import replace as dataclasses_replace

import pytest

from rksc_bench import BenchConfig, render_markdown, run_bench
from rksc_bench.paper import save_report
from tests.conftest import make_char_tokenizer, make_tiny_model


@pytest.fixture(scope="module")
def report():
    config = BenchConfig(questions=3, branches=4, shots=1, max_new_tokens=6, tree_depth=2, tree_budget_mb=0.05,
                         arms=("no_reuse", "cgee_only", "token_exact", "rksc"))
    return run_bench(config, model_and_tokenizer=(make_tiny_model(max_positions=2048), make_char_tokenizer()), progress=False)


def test_every_arm_answers_every_question(report):
    for arm in ("no_reuse", "cgee_only", "token_exact", "rksc"):
        assert [r.question_index for r in report.arm_records(arm)] == [0, 1, 2], arm


def test_the_exact_arms_pick_the_same_answers_with_and_without_kv_reuse(report):
    # Same seeds, exact cache: reuse changes the cost, never the answer.
    no_reuse = [r.answer for r in report.arm_records("no_reuse")]
    token_exact = [r.answer for r in report.arm_records("token_exact")]
    assert no_reuse == token_exact


def test_sharing_the_prefill_computes_far_fewer_prompt_tokens(report):
    summary = report.summary()
    assert summary["token_exact"]["prompt_tokens_computed"] * 2 < summary["no_reuse"]["prompt_tokens_computed"]
    assert summary["token_exact"]["speedup_vs_no_reuse"] is not None


def test_the_report_renders_as_markdown_and_json(report, tmp_path):
    table = render_markdown(report)
    assert "| token_exact |" in table and "| no_reuse |" in table
    paths = save_report(report, tmp_path, plots=True)
    data = json.loads(paths[0].read_text())
    assert set(data["summary"]) == {"no_reuse", "cgee_only", "token_exact", "rksc"}
    assert (tmp_path / "speedup.png").stat().st_size > 0
    assert (tmp_path / "tree_cache_bytes.png").stat().st_size > 0


def test_the_tree_search_trace_stays_inside_its_budget(report):
    assert report.tree_cache_bytes, "the tree search should have expanded nodes"
    assert max(report.tree_cache_bytes) <= report.tree_budget_bytes


@pytest.mark.parametrize("kwargs, field", [({"questions": 0}, "questions"), ({"ensemble": 3}, "ensemble"),
                                           ({"arms": ("nope",)}, "arms"), ({"workload": "x"}, "workload"),
                                           ({"tree_depth": -1}, "tree_depth"), ({"tree_budget_mb": 0}, "tree_budget_mb")])
def test_bad_bench_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BenchConfig(**kwargs)


def test_the_multiple_choice_workload_and_a_prompt_ensemble_run_and_the_exact_arms_still_agree():
    config = BenchConfig(workload="choice", questions=2, branches=4, shots=1, ensemble=2, max_new_tokens=6, tree_depth=0,
                         arms=("no_reuse", "token_exact"))
    report = run_bench(config, model_and_tokenizer=(make_tiny_model(max_positions=2048), make_char_tokenizer()),
                       progress=False)
    assert [r.gold for r in report.arm_records("token_exact")] == [r.gold for r in report.arm_records("no_reuse")]
    assert all(r.gold in "ABCD" for r in report.records)
    assert [r.answer for r in report.arm_records("no_reuse")] == [r.answer for r in report.arm_records("token_exact")]


# -- the difficulty ladder workload ---------------------------------------------------------------
def test_the_ladder_workload_asks_the_ladders_questions_spread_evenly_over_its_levels():
    from rksc_bench.paper import load_problems
    from rksc_engine.evaluation.workloads import LadderProblem, ladder_problems, ladder_shots

    shots, questions = load_problems(BenchConfig(workload="ladder", questions=7, shots=2, levels=(1, 2, 4), seed=3))
    assert all(isinstance(q, LadderProblem) for q in questions)
    # Interleaved by level, cut at 7: every level asked, no level more than once over another.
    assert [q.level for q in questions] == [1, 2, 4, 1, 2, 4, 1]
    assert questions == ladder_problems(3, (1, 2, 4), seed=3)[:7]
    assert shots == ladder_shots(2, seed=1) and all(s.level == 1 for s in shots)
    assert {s.question for s in shots}.isdisjoint(q.question for q in questions)
    # Same seed, same questions; another seed, other questions over the same levels.
    assert load_problems(BenchConfig(workload="ladder", questions=7, shots=2, levels=(1, 2, 4), seed=3))[1] == questions
    other = load_problems(BenchConfig(workload="ladder", questions=7, shots=2, levels=(1, 2, 4), seed=4))[1]
    assert [q.level for q in other] == [q.level for q in questions] and other != questions
    # The default asks all four levels.
    _, default = load_problems(BenchConfig(workload="ladder", questions=5, shots=0))
    assert [q.level for q in default] == [1, 2, 3, 4, 1]


@pytest.mark.parametrize("kwargs, error, field", [
    ({"workload": "ladder", "levels": (0, 1)}, ValueError, "levels"),
    ({"workload": "ladder", "levels": (5,)}, ValueError, "levels"),
    ({"workload": "ladder", "levels": (2, 2)}, ValueError, "levels"),
    ({"workload": "ladder", "levels": ()}, ValueError, "levels"),
    ({"workload": "ladder", "levels": (True,)}, ValueError, "levels"),
    ({"workload": "ladder", "levels": [[1]]}, ValueError, "levels"),
    ({"workload": "ladder", "levels": "1,2"}, TypeError, "levels"),
    ({"workload": "gsm8k", "levels": (1, 2)}, ValueError, "levels"),
    ({"workload": "ladder", "data": "questions.jsonl"}, ValueError, "data"),
])
def test_bad_ladder_settings_name_the_field(kwargs, error, field):
    with pytest.raises(error, match=field):
        BenchConfig(**kwargs)


def test_the_ladder_levels_may_be_given_as_a_list_and_come_back_a_tuple():
    assert BenchConfig(workload="ladder", levels=[3, 1]).levels == (3, 1)


@pytest.mark.parametrize("levels", ["1,x", "1,5"])
def test_the_cli_rejects_bad_levels_before_loading_a_model(levels):
    from rksc_bench.cli import main

    with pytest.raises(SystemExit, match="levels"):
        main(["--workload", "ladder", "--levels", levels])


def test_the_ladder_workload_runs_end_to_end_and_reports_each_level(tmp_path):
    config = BenchConfig(workload="ladder", questions=4, branches=2, shots=1, max_new_tokens=6, tree_depth=0,
                         arms=("no_reuse", "token_exact", "rksc"))
    report = run_bench(config, model_and_tokenizer=(make_tiny_model(max_positions=2048), make_char_tokenizer()),
                       progress=False)
    for arm in ("no_reuse", "token_exact", "rksc"):
        assert [r.level for r in report.arm_records(arm)] == [1, 2, 3, 4], arm
        # A ladder problem's difficulty is its level: one solution line per step.
        assert [r.difficulty for r in report.arm_records(arm)] == [1, 2, 3, 4], arm
    assert all(r.gold.isdigit() for r in report.records)  # GSM8K-style numeric answers
    assert [r.answer for r in report.arm_records("no_reuse")] == [r.answer for r in report.arm_records("token_exact")]
    table = render_markdown(report)
    assert "workload `ladder` (the difficulty ladder, levels 1, 2, 3, 4)" in table
    assert "| ladder level | questions | accuracy (no_reuse) | accuracy (token_exact) | accuracy (rksc) | CGEE skipped (rksc arm) |" in table
    for level in (1, 2, 3, 4):
        assert f"\n| {level} | 1 | " in table
    assert "| solution steps |" not in table  # the level table replaces it on the ladder
    data = json.loads(save_report(report, tmp_path, plots=False)[0].read_text())
    assert data["config"]["levels"] == [1, 2, 3, 4]
    assert [r["level"] for r in data["records"] if r["arm"] == "rksc"] == [1, 2, 3, 4]


def test_the_per_level_table_counts_each_arms_correct_and_skipped_answers():
    from rksc_bench.report import ArmRecord, BenchReport

    def record(arm, q, level, answer, skipped):
        return ArmRecord(arm, q, 1.0, 10, answer, "7", level, verified=not skipped, skipped=skipped, level=level)

    config = BenchConfig(workload="ladder", questions=4, levels=(1, 3), arms=("token_exact", "rksc"))
    records = [record("token_exact", 0, 1, "7", False), record("token_exact", 1, 3, "7", False),
               record("token_exact", 2, 1, "7", False), record("token_exact", 3, 3, "2", False),
               record("rksc", 0, 1, "7", True), record("rksc", 1, 3, "1", False),
               record("rksc", 2, 1, None, True), record("rksc", 3, 3, "2", False)]
    report = BenchReport(config, records, {}, {"cpus": 2, "dtype": "torch.float32"})
    assert report.by_level("rksc") == {1: (1, 2, 2), 3: (0, 0, 2)}
    table = render_markdown(report)
    assert "(the difficulty ladder, levels 1, 3)" in table
    assert "| 1 | 2 | 100% | 50% | 2/2 |" in table
    assert "| 3 | 2 | 50% | 0% | 0/2 |" in table
    # Outside the ladder there are no levels and the difficulty table stays.
    gsm8k = BenchReport(BenchConfig(arms=("rksc",)), [dataclasses_replace(r, level=None) for r in records if r.arm == "rksc"],
                        {}, {"cpus": 2, "dtype": "torch.float32"})
    assert gsm8k.by_level("rksc") == {} and "| ladder level |" not in render_markdown(gsm8k)
    assert "| solution steps | CGEE skipped (rksc arm) |" in render_markdown(gsm8k)


# -- the ablation table names what each arm ran ---------------------------------------------------
@pytest.fixture(scope="module")
def ablation_report():
    config = BenchConfig(questions=2, branches=2, shots=1, max_new_tokens=4, tree_depth=0,
                         arms=("no_reuse", "cgee_only", "token_exact", "asks", "rksc"))
    return run_bench(config, model_and_tokenizer=(make_tiny_model(max_positions=2048), make_char_tokenizer()),
                     progress=False)


def ablation_rows(table: str) -> dict[str, str]:
    """The ablation table's rows as arm -> label."""
    start = table.index("| ablation: what ran |")
    rows = [line.split(" | ") for line in table[start:].split("\n\n")[0].splitlines()[2:]]
    return {row[1]: row[0].removeprefix("| ") for row in rows}


def test_each_ablation_row_is_labelled_by_the_mechanisms_its_arm_ran(ablation_report):
    asks_reused = sum(r.asks_reused_tokens for r in ablation_report.arm_records("asks"))
    assert ablation_rows(render_markdown(ablation_report)) == {
        "no_reuse": "nothing (every prompt computed, every candidate verified)",
        "cgee_only": "CGEE",
        "token_exact": "token-exact KV sharing",
        # The asks arm shares token-exact KV too; the label says what ASKS itself reused.
        "asks": f"token-exact KV sharing + ASKS (reused {asks_reused:,} prompt tokens)",
        # The shipped defaults: ASKS is off, early stop "decided" is on.
        "rksc": "token-exact KV sharing + CGEE + early stop (decided)",
    }
    assert "alone" not in render_markdown(ablation_report)


def test_the_asks_label_counts_the_tokens_asks_reused_from_the_records(ablation_report):
    records = [dataclasses_replace(r, asks_reused_tokens=1500 if r.arm == "asks" else 0)
               for r in ablation_report.records]
    report = dataclasses_replace(ablation_report, records=records)
    assert ablation_rows(render_markdown(report))["asks"] == "token-exact KV sharing + ASKS (reused 3,000 prompt tokens)"
    assert report.summary()["asks"]["asks_reused_tokens"] == 3000
    assert report.to_json()["setups"]["asks"]["label"] == ablation_rows(render_markdown(report))["asks"]
