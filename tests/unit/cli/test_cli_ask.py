"""``rksc ask`` on the tiny seeded model: ``--early-stop`` reaches ``engine.reason`` (``off`` is None),
and the output says what early stopping did: branches launched and cancelled, tokens decoded, the
most it can have saved, and the rule that ended the request; and it prints the branches' prompt
apart from the verifier's prompts."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from rksc_cli.ask import main
from rksc_engine import RKSCEngine
from rksc_engine.reasoning.early_stop import EarlyStopReport
from tests.conftest import make_char_tokenizer, make_tiny_model

ASK = ["ask", "What is 2+3?", "--branches", "4", "--shots", "0", "--max-new-tokens", "8", "--temperature", "1.0"]


class Asked:
    """The tiny engine ``rksc ask`` loads, recording what each ``reason`` call got and returned."""

    def __init__(self, monkeypatch, edit_result=None):
        self.engine = RKSCEngine(make_tiny_model(max_positions=4096), make_char_tokenizer())
        self.early_stops: list = []
        self.results: list = []
        self.loads = 0
        reason = self.engine.reason

        def recorded(question, **kwargs):
            self.early_stops.append(kwargs.get("early_stop", "left out"))
            result = reason(question, **kwargs)
            result = edit_result(result) if edit_result else result
            self.results.append(result)
            return result

        def load(*args, **kwargs):
            self.loads += 1
            return self.engine

        monkeypatch.setattr(self.engine, "reason", recorded)
        monkeypatch.setattr(RKSCEngine, "from_pretrained", staticmethod(load))


def early_stop_line(out: str) -> str:
    [line] = [line for line in out.splitlines() if line.startswith("Early stop")]
    return line


def test_ask_stops_early_with_decided_by_default_and_prints_what_it_did(monkeypatch, capsys):
    asked = Asked(monkeypatch)
    assert main(ASK) == 0
    assert asked.early_stops == ["decided"], "rksc ask must pass early_stop='decided' by default"
    report = asked.results[0].early_stop
    line = early_stop_line(capsys.readouterr().out)
    saved = sum(8 - c.num_generated_tokens for c in asked.results[0].completions if c.finish_reason == "cancelled")
    assert line == (f"Early stop (decided): 4 branches launched, {report.branches_cancelled} cancelled, "
                    f"{report.decode_tokens} tokens decoded, at most {saved} tokens saved "
                    "(the budget the cancelled branches had left)"), line


def test_ask_with_early_stop_off_runs_every_branch_and_says_so(monkeypatch, capsys):
    asked = Asked(monkeypatch)
    assert main([*ASK, "--early-stop", "off"]) == 0
    assert asked.early_stops == [None], "--early-stop off must reach the engine as early_stop=None"
    result = asked.results[0]
    assert result.early_stop is None and all(c.finish_reason != "cancelled" for c in result.completions)
    decoded = sum(c.num_generated_tokens for c in result.completions)
    line = early_stop_line(capsys.readouterr().out)
    assert line == f"Early stop: off (every branch ran to its end; {decoded} tokens decoded)", line


def test_the_line_names_the_rule_that_stopped_the_request_and_the_branches_it_stopped(monkeypatch, capsys):
    report = EarlyStopReport(4, 2, 21, ((1, "decided"), (3, "decided")), "decided")
    Asked(monkeypatch, edit_result=lambda result: dataclasses.replace(result, early_stop=report))
    assert main(ASK) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"Early stop \(decided\): 4 branches launched, 2 cancelled, 21 tokens decoded, at most \d+ "
                        r"tokens saved \(the budget the cancelled branches had left\); request stopped by decided",
                        early_stop_line(out)), early_stop_line(out)
    marked = [int(m) for m in re.findall(r"branch (\d+): .*\[stopped: decided\]", out)]
    assert marked == [1, 3], f"the stopped branches should be marked: {out}"


def test_ask_json_carries_the_report_and_whether_each_branch_voted(monkeypatch, capsys):
    asked = Asked(monkeypatch)
    assert main([*ASK, "--early-stop", "answered", "--json"]) == 0
    assert asked.early_stops == ["answered"]
    printed = json.loads(capsys.readouterr().out)
    result = asked.results[0]
    assert printed["early_stop"] == result.early_stop.as_dict()
    assert [b["voted"] for b in printed["branches"]] == [b.voted for b in result.branches]


def test_an_unknown_early_stop_is_refused_before_the_model_loads(monkeypatch, capsys):
    asked = Asked(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        main([*ASK, "--early-stop", "sometimes"])
    assert exit_info.value.code == 2
    assert "--early-stop" in capsys.readouterr().err
    assert asked.loads == 0 and asked.early_stops == [], "a refused --early-stop still loaded the model or ran"


def saved_tokens(out: str) -> int:
    match = re.search(r"at most (\d+) tokens saved", early_stop_line(out))
    assert match, f"the early-stop line should say what was saved: {early_stop_line(out)}"
    return int(match[1])


LENGTH = ["ask", "What is 2+3?", "--branches", "8", "--shots", "0", "--max-new-tokens", "24", "--temperature", "1.0",
          "--early-stop", "length"]


def test_the_tokens_saved_are_the_budget_the_cancelled_branches_had_left_and_bound_the_real_saving(monkeypatch, capsys):
    asked = Asked(monkeypatch)
    assert main(LENGTH) == 0
    stopped = [c for c in asked.results[0].completions if c.finish_reason == "cancelled"]
    assert stopped, "the length rule should cancel some of the tiny model's branches (the test needs one)"
    saved = saved_tokens(capsys.readouterr().out)
    assert saved == sum(24 - c.num_generated_tokens for c in stopped) > 0
    # The same seeds without early stop decode each branch's same tokens to its end: what early stop
    # avoided is at most what was printed.
    decoded_with_stop = sum(c.num_generated_tokens for c in asked.results[0].completions)
    assert main([*LENGTH[:-1], "off"]) == 0
    decoded_without = sum(c.num_generated_tokens for c in asked.results[1].completions)
    assert decoded_with_stop < decoded_without <= decoded_with_stop + saved, (decoded_with_stop, decoded_without, saved)


def test_branches_never_launched_count_their_whole_budget_as_saved(monkeypatch, capsys):
    def launched_two(result):
        report = EarlyStopReport(2, 0, 9, (), "adaptive")
        return dataclasses.replace(result, completions=result.completions[:2], branches=result.branches[:2],
                                   early_stop=report)

    asked = Asked(monkeypatch, edit_result=launched_two)
    assert main([*ASK, "--early-stop", "adaptive"]) == 0
    out = capsys.readouterr().out
    cancelled = sum(8 - c.num_generated_tokens for c in asked.results[0].completions if c.finish_reason == "cancelled")
    assert saved_tokens(out) == cancelled + 2 * 8, early_stop_line(out)
    assert "the cancelled branches and the 2 never launched" in early_stop_line(out)


def test_the_branches_prompt_is_printed_apart_from_the_verifiers_prompts(monkeypatch, capsys):
    asked = Asked(monkeypatch)
    assert main(ASK) == 0
    out = capsys.readouterr().out
    result, stats = asked.results[0], asked.engine.stats()
    assert not result.verification.skipped, "the test needs the verifier to run"
    match = re.search(r"Branches' prompt: (\d+) tokens computed once for all 4 branches \(reused from cache: (\d+)\) "
                      r"\| verifier's prompts: (\d+) tokens computed \(reused from cache: (\d+)\)", out)
    assert match, out
    branches_computed, branches_reused, verifier_computed, verifier_reused = map(int, match.groups())
    first = result.completions[0]
    assert (branches_computed, branches_reused) == (first.num_prompt_tokens - first.num_cached_tokens,
                                                    first.num_cached_tokens)
    assert branches_computed + verifier_computed == stats.prompt_tokens_computed
    assert branches_reused + verifier_reused == stats.prompt_tokens_reused
    assert verifier_computed > 0 and verifier_reused >= first.num_prompt_tokens - 1, (
        "the verifier's prompts extend the branches' prompt, so they reuse it from the cache")


def test_ask_json_splits_the_prompt_tokens_and_says_what_was_saved(monkeypatch, capsys):
    asked = Asked(monkeypatch)
    assert main([*LENGTH, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    stats = asked.engine.stats()
    tokens = printed["prompt_tokens"]
    assert tokens["branches_computed"] + tokens["verifier_computed"] == stats.prompt_tokens_computed
    assert printed["early_stop_saved_tokens_at_most"] == sum(
        24 - c.num_generated_tokens for c in asked.results[0].completions if c.finish_reason == "cancelled") > 0
