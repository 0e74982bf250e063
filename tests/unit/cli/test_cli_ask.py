"""``rksc ask`` on the tiny seeded model: ``--early-stop`` reaches ``engine.reason`` (``off`` is None),
and the output says what early stopping did: branches launched and cancelled, tokens decoded, and
the rule that ended the request."""

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
    assert line == (f"Early stop (decided): 4 branches launched, {report.branches_cancelled} cancelled, "
                    f"{report.decode_tokens} tokens decoded"), line


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
    assert early_stop_line(out) == ("Early stop (decided): 4 branches launched, 2 cancelled, 21 tokens decoded; "
                                    "request stopped by decided")
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
