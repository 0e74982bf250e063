"""`rksc bench` on a tiny seeded model: the arms answer the same questions, the exact arms agree,
and the reuse arms compute fewer prompt tokens than the no-reuse arm."""

from __future__ import annotations

import json

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
