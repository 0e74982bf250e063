"""Early-stop rules (``rksc_engine.reasoning.early_stop``) replayed on scripted branches, with no model.

``replay`` stands in for the scheduler: every running branch advances one scripted token per step,
the monitor sees the step's events (split, at random, into several ``observe`` calls as the
scheduler's waves split them), stops take effect at once for branches of the same call and after one
more token for the others (as the scheduler's ``pending_stop`` does), and added branches start at the
next step. Each rule is checked where its right stop point is known by construction, and ``decided``
against the full vote over thousands of random branch sets.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

import numpy as np
import pytest

import rksc_engine.reasoning.early_stop as early_stop
from rksc_engine.reasoning.answers import extract_gsm8k_answer
from rksc_engine.reasoning.cgee import summarise_votes
from rksc_engine.reasoning.early_stop import (
    GSM8K_SETTLED_PATTERN,
    AdaptiveConfig,
    AnsweredConfig,
    ConfidenceConfig,
    EarlyStopConfig,
    EarlyStopMonitor,
    beta_leader_posterior,
    dirichlet_leader_posterior,
    lowest_window_mean,
    resolve_early_stop,
)
from rksc_engine.results import BranchEvent, Completion


@dataclass
class Script:
    """One branch as the model would generate it: per token, its logprob and the text so far."""

    logprobs: list[float]
    texts: list[str]


def completion_of(index: int, script: Script, num_tokens: int, reason: str) -> Completion:
    return Completion(text=script.texts[num_tokens - 1] if num_tokens else "", token_ids=tuple(range(num_tokens)),
                      logprobs=tuple(script.logprobs[:num_tokens]), finish_reason=reason, num_prompt_tokens=1,
                      branch_index=index)


def answer_script(answer: str | None, logprobs: list[float]) -> Script:
    """A branch whose text shows ``ans=<answer>`` only at its last token (no answer for None)."""
    final = "" if answer is None else f"ans={answer}"
    return Script(list(logprobs), ["." * k for k in range(1, len(logprobs))] + [final])


def extract_ans(text: str) -> str | None:
    return text.split("=", 1)[1] if "=" in text else None


@dataclass
class Replay:
    completions: dict[int, Completion]
    stopped_at: dict[int, int]  # branch -> its token count when it was cancelled
    adds: list[tuple[int, int]]  # (step, branches added)


def replay(monitor: EarlyStopMonitor, scripts: list[Script], rng: random.Random | None = None) -> Replay:
    launched = monitor.initial_branches
    progress = dict.fromkeys(range(launched), 0)
    active = list(range(launched))
    pending_stop: set[int] = set()
    out = Replay({}, {}, [])
    step = 0

    def cancel(index: int) -> None:
        out.completions[index] = completion_of(index, scripts[index], progress[index], "cancelled")
        out.stopped_at[index] = progress[index]
        active.remove(index)

    while active:
        step += 1
        members = [sorted(active)]
        if rng is not None and len(active) > 1 and rng.random() < 0.5:
            cut = rng.randrange(1, len(active))
            members = [sorted(active)[:cut], sorted(active)[cut:]]
        added = []
        for member in members:
            events = []
            for index in member:
                progress[index] += 1
                k, script = progress[index], scripts[index]
                completion = completion_of(index, script, k, "eos") if k == len(script.logprobs) else None
                events.append(BranchEvent(index, k, script.logprobs[k - 1], k, script.texts[k - 1], completion))
            control = monitor.observe(events)
            for event in events:
                if event.completion is not None:
                    out.completions[event.branch_index] = event.completion
                    active.remove(event.branch_index)
            if control is not None:
                assert control.stop <= set(active) | set(out.stopped_at), \
                    f"the monitor stopped {sorted(control.stop - set(active))}, which are not running"
                pending_stop |= control.stop & set(active)
                added += range(launched, launched + control.add)
                if control.add:
                    out.adds.append((step, control.add))
                launched += control.add
            for index in member:  # the scheduler ends this member's stopped rows after its observe
                if index in pending_stop and index in active:
                    cancel(index)
            pending_stop -= set(member)
        for index in added:
            progress[index] = 0
            active.append(index)
    return out


def winner_of(completions: list[Completion], extract) -> str | None:
    return summarise_votes([extract(c.text) for c in completions], [c.confidence for c in completions]).winner


def voted(monitor: EarlyStopMonitor, run: Replay) -> list[Completion]:
    ordered = [run.completions[i] for i in sorted(run.completions)]
    return [c for c, votes in zip(ordered, monitor.voting(ordered)) if votes]


# -- decided: the exact rule ------------------------------------------------------------------------
LOGPROBS = [0.0, -0.25, -0.5, -1.0, -2.0]  # few values, so equal confidences (exact ties) are common


def random_branches(rng: random.Random, n: int, max_new_tokens: int) -> list[Script]:
    answers = rng.choice([["7", "8"], ["7", "8", "9"], ["7", "7", "8", None], ["7", None]])
    scripts = []
    for _ in range(n):
        length = rng.randint(1, max_new_tokens)
        logprobs = [-math.inf if rng.random() < 0.01 else rng.choice(LOGPROBS) for _ in range(length)]
        scripts.append(answer_script(rng.choice(answers), logprobs))
    return scripts


def test_the_decided_winner_equals_the_full_vote_over_thousands_of_random_branch_sets():
    rng = random.Random(1234)
    decided = saved_tokens = 0
    for case in range(4000):
        n, max_new_tokens = rng.randint(1, 9), rng.randint(1, 8)
        scripts = random_branches(rng, n, max_new_tokens)
        monitor = EarlyStopMonitor(EarlyStopConfig(), n=n, extract=extract_ans, max_new_tokens=max_new_tokens)
        run = replay(monitor, scripts, rng)
        full = [completion_of(i, s, len(s.logprobs), "eos") for i, s in enumerate(scripts)]
        expected = winner_of(full, extract_ans)
        got = winner_of(voted(monitor, run), extract_ans)
        assert got == expected, f"case {case}: decided voted {got!r}, the full vote {expected!r}; scripts {scripts}"
        report = monitor.report()
        assert report.decode_tokens == sum(c.num_generated_tokens for c in run.completions.values()), \
            f"case {case}: the report counts {report.decode_tokens} tokens, the branches generated others"
        if report.stopped_request_by == "decided":
            decided += 1
            saved_tokens += sum(len(s.logprobs) for s in scripts) - report.decode_tokens
    assert decided > 800, f"decided stopped only {decided} of 4000 requests: the property was barely exercised"
    assert saved_tokens > 0, "decided never saved a token"


def test_decided_stops_the_running_branch_at_the_first_token_its_confidence_bound_falls_below_the_lead():
    # Branch 0 ends at once with confidence e^-0.5; branch 1 spends -1 per token of at most 8, so its
    # confidence is at most e^(-k/8) after k tokens: e^-0.5 at k=4 only ties, k=5 is the first strict lead.
    scripts = [answer_script("A", [-0.5]), answer_script("B", [-1.0] * 8)]
    monitor = EarlyStopMonitor(EarlyStopConfig(), n=2, extract=extract_ans, max_new_tokens=8)
    run = replay(monitor, scripts)
    assert run.stopped_at == {1: 5}, f"expected branch 1 stopped after 5 tokens, got {run.stopped_at}"
    assert monitor.report().stopped_by == ((1, "decided"),)
    assert monitor.report().stopped_request_by == "decided"
    assert winner_of(voted(monitor, run), extract_ans) == "A"


@pytest.mark.parametrize("finished_first", [0, 1])
def test_decided_never_stops_on_a_lead_a_running_branch_could_still_tie(finished_first):
    # Logprob-0 tokens keep the running branch's bound at 1.0, the finished branch's full weight: a tie
    # whose first-seen winner is the lower branch index, so only a strict lead is safe.
    short, long = answer_script("A", [0.0]), answer_script("B", [0.0] * 4)
    scripts = [short, long] if finished_first == 0 else [long, short]
    monitor = EarlyStopMonitor(EarlyStopConfig(), n=2, extract=extract_ans, max_new_tokens=4)
    run = replay(monitor, scripts)
    assert run.stopped_at == {}, f"decided stopped {run.stopped_at} though the running branch could tie"
    assert winner_of(voted(monitor, run), extract_ans) == ("A" if finished_first == 0 else "B")


def test_decided_keeps_a_branch_running_while_its_bound_could_lift_a_challenger_past_the_leader():
    # 0.9 for A against 0.5 for B: a running branch with bound >= 0.4 could still make B win.
    scripts = [answer_script("A", [math.log(0.9)]), answer_script("B", [math.log(0.5)]),
               answer_script(None, [-0.5] * 10)]
    monitor = EarlyStopMonitor(EarlyStopConfig(), n=3, extract=extract_ans, max_new_tokens=10)
    run = replay(monitor, scripts)
    # bound after k tokens: exp(-0.05 k) < 0.4 first at k = 19 > 10, so the branch runs to its end
    assert run.stopped_at == {}, f"decided stopped {run.stopped_at} while B could still overtake A"
    scripts[2] = answer_script("C", [-4.0] * 10)  # exp(-0.4 k) < 0.4 - slack from k = 3
    monitor = EarlyStopMonitor(EarlyStopConfig(), n=3, extract=extract_ans, max_new_tokens=10)
    assert replay(monitor, scripts).stopped_at == {2: 3}


def test_decided_waits_while_unlaunched_branches_of_the_budget_could_reach_the_leader():
    config = EarlyStopConfig(adaptive=AdaptiveConfig(wave_size=2, threshold=1.0))
    agree = [answer_script("A", [0.0]) for _ in range(4)]
    monitor = EarlyStopMonitor(config, n=3, extract=extract_ans, max_new_tokens=1)
    run = replay(monitor, agree[:3])
    assert run.adds == [] and monitor.report().stopped_request_by == "decided", \
        "a lead of 2 over one unlaunched branch is decided: no wave should be added"
    monitor = EarlyStopMonitor(config, n=4, extract=extract_ans, max_new_tokens=1)
    run = replay(monitor, agree)
    assert run.adds == [(1, 2)], f"a lead of 2 over two unlaunched branches is not decided; adds {run.adds}"


# -- decided with answered and confidence: exact against the per-branch rules ------------------------
PIECES = ["Step", " 3", "+4", "\n", "=", " 7", "\n", "ok"]


def gsm8k_script(rng: random.Random, max_new_tokens: int) -> Script:
    """Reasoning pieces, an answer line (not always closed), maybe a second answer line after it."""
    answer = rng.choice(["7", "8", "9", "12"])
    pieces = [rng.choice(PIECES) for _ in range(rng.randint(0, 3))] + ["#### ", answer]
    pieces += rng.choice([[], ["\n"], ["\nso", "\n"], ["\n#### ", rng.choice(["7", "8"]), "\n"]])
    pieces = pieces[:max_new_tokens]
    texts = ["".join(pieces[:k]) for k in range(1, len(pieces) + 1)]
    return Script([rng.choice(LOGPROBS) for _ in pieces], texts)


def settles_at(script: Script, pattern: str) -> int | None:
    """The first token whose text has a completed line matching ``pattern`` (written apart from the monitor)."""
    for k, text in enumerate(script.texts, start=1):
        lines = text.split("\n")[:-1]  # the part after the last newline is not a completed line
        if any(re.search(pattern, line) for line in lines):
            return k
    return None


@pytest.mark.parametrize("answered,confidence", [(True, False), (False, True), (True, True)])
def test_decided_with_per_branch_rules_keeps_the_winner_of_the_full_vote_under_those_rules(answered, confidence):
    rng = random.Random(99 + 2 * answered + confidence)
    decided = 0
    for case in range(1200):
        n, max_new_tokens = rng.randint(1, 8), rng.randint(2, 9)
        scripts = [gsm8k_script(rng, max_new_tokens) for _ in range(n)]
        window, warmup, percentile = rng.randint(1, 3), rng.randint(1, 3), rng.choice([0.0, 10.0, 50.0, 90.0])
        config = EarlyStopConfig(answered=AnsweredConfig() if answered else None,
                                 confidence=ConfidenceConfig(window, warmup, percentile) if confidence else None)
        monitor = EarlyStopMonitor(config, n=n, extract=extract_gsm8k_answer, max_new_tokens=max_new_tokens)
        run = replay(monitor, scripts, rng)
        # The reference: every branch run alone under the per-branch rules, then filtered, then voted.
        full = []
        for i, s in enumerate(scripts):
            end = settles_at(s, GSM8K_SETTLED_PATTERN) if answered else None
            cut = end is not None and end < len(s.logprobs)
            full.append(completion_of(i, s, end if cut else len(s.logprobs), "cancelled" if cut else "eos"))
        if confidence:
            warm = [lowest_window_mean(c.logprobs, window) for c in full[:min(warmup, n)]]
            threshold = monitor.report().confidence_threshold
            assert threshold == pytest.approx(float(np.percentile(warm, percentile)), abs=1e-12), \
                f"case {case}: threshold {threshold} is not the {percentile}th percentile of {warm}"
            full = [c for c in full if not lowest_window_mean(c.logprobs, window) < threshold]
        kept = voted(monitor, run)
        for c in kept:
            assert c in full, f"case {case}: the monitor kept branch {c.branch_index} as {c}, the reference did not"
        got, expected = winner_of(kept, extract_gsm8k_answer), winner_of(full, extract_gsm8k_answer)
        assert got == expected, f"case {case}: the monitor's vote picked {got!r}, the reference {expected!r}"
        decided += monitor.report().stopped_request_by == "decided"
    assert decided > 50, f"decided stopped only {decided} of 1200 requests: the property was barely exercised"


# -- answered ---------------------------------------------------------------------------------------
def stepwise(pieces: list[str], logprob: float = -0.1) -> Script:
    return Script([logprob] * len(pieces), ["".join(pieces[:k]) for k in range(1, len(pieces) + 1)])


@pytest.mark.parametrize("pieces,stop_at", [
    (["3+4=7", "\n", "#### ", "7", "\n", "Next", " question"], 5),  # the answer line closes at token 5
    (["#### 7", "\nThe", " end", "\n"], 2),  # a token that closes the line and starts the next
    (["#### ", "\n", "7", "\n", "more"], None),  # the number is not on the #### line: never settled
])
def test_answered_ends_a_branch_on_the_token_that_closes_its_answer_line_and_it_still_votes(pieces, stop_at):
    monitor = EarlyStopMonitor(EarlyStopConfig(decided=False, answered=AnsweredConfig()), n=1,
                               extract=extract_gsm8k_answer, max_new_tokens=16)
    run = replay(monitor, [stepwise(pieces)])
    expected = {} if stop_at is None else {0: stop_at}
    assert run.stopped_at == expected, f"{pieces}: stopped at {run.stopped_at}, expected {expected}"
    assert monitor.voting([run.completions[0]]) == [True], "a branch ended by answered must still vote"
    assert monitor.report().stopped_by == (() if stop_at is None else ((0, "answered"),))
    assert extract_gsm8k_answer(run.completions[0].text) == "7"


def test_answered_uses_the_configured_pattern_for_other_extractors():
    pattern = r"answer is \(?[A-E]\)?"
    monitor = EarlyStopMonitor(EarlyStopConfig(decided=False, answered=AnsweredConfig(pattern)), n=1,
                               extract=lambda t: t, max_new_tokens=16)
    run = replay(monitor, [stepwise(["So the", " answer is", " (B).", "\n", "Also (C)"])])
    assert run.stopped_at == {0: 4}, f"expected the stop on the newline after '(B).', got {run.stopped_at}"
    assert run.completions[0].text == "So the answer is (B).\n"


def test_the_extractor_runs_once_per_branch_when_it_ends():
    calls = []

    def counting(text):
        calls.append(text)
        return extract_ans(text)

    scripts = [answer_script(a, [-0.3] * length) for a, length in [("A", 3), ("B", 6), ("A", 2), (None, 5)]]
    monitor = EarlyStopMonitor(EarlyStopConfig(decided=False, answered=AnsweredConfig()), n=4,
                               extract=counting, max_new_tokens=6)
    replay(monitor, scripts)
    assert sorted(calls) == sorted(s.texts[-1] for s in scripts), f"extract ran on {calls}"


# -- adaptive ---------------------------------------------------------------------------------------
def test_waves_add_exactly_the_wave_size_up_to_the_budget_once_each_wave_has_finished():
    # Ten different answers never settle; branch lengths differ so a wave ends with its longest branch.
    scripts = [answer_script(str(i), [-0.1] * (1 + i % 3)) for i in range(10)]
    config = EarlyStopConfig(decided=False, adaptive=AdaptiveConfig(wave_size=4))
    monitor = EarlyStopMonitor(config, n=10, extract=extract_ans, max_new_tokens=3)
    assert monitor.initial_branches == 4
    run = replay(monitor, scripts)
    # wave 0-3 ends at step 3 (branch 2 has 3 tokens); wave 4-7 starts at step 4 and ends at step 6
    assert run.adds == [(3, 4), (6, 2)], f"expected adds of 4 then 2 at the waves' ends, got {run.adds}"
    assert monitor.report().branches_launched == 10 and sorted(run.completions) == list(range(10))
    assert monitor.report().stopped_request_by is None


@pytest.mark.parametrize("method", ["beta", "dirichlet"])
def test_adaptive_stops_launching_once_the_posterior_reaches_the_threshold(method):
    config = EarlyStopConfig(decided=False, adaptive=AdaptiveConfig(wave_size=4, method=method))
    monitor = EarlyStopMonitor(config, n=16, extract=extract_ans, max_new_tokens=2)
    run = replay(monitor, [answer_script("7", [-0.1, -0.1]) for _ in range(16)])
    assert run.adds == [] and monitor.report().stopped_request_by == "adaptive", \
        f"4 of 4 agreeing (posterior 31/32) must stop; adds {run.adds}"
    # 3 of 4 agree with one other answer: 13/16 < 0.95, so a second wave goes out; 6 of 8 gives 0.91
    # (Dirichlet's bound 0.93), a third; 10 of 12 gives 0.989 (0.994) and the budget of 16 is not spent.
    answers = ["7", "7", "8", "7", "7", "9", "7", "7"] + ["7"] * 8
    monitor = EarlyStopMonitor(config, n=16, extract=extract_ans, max_new_tokens=2)
    run = replay(monitor, [answer_script(a, [-0.1, -0.1]) for a in answers])
    assert [added for _, added in run.adds] == [4, 4], f"expected two more waves, got {run.adds}"
    assert monitor.report().stopped_request_by == "adaptive" and monitor.report().branches_launched == 12


def test_esc_stops_on_a_unanimous_wave_and_not_on_one_with_a_missing_answer():
    config = EarlyStopConfig(decided=False, adaptive=AdaptiveConfig(wave_size=3, method="esc"))
    answers = ["7", None, "7", "8", "8", "8", "5", "5", "5"]
    monitor = EarlyStopMonitor(config, n=9, extract=extract_ans, max_new_tokens=1)
    run = replay(monitor, [answer_script(a, [-0.1]) for a in answers])
    assert run.adds == [(1, 3)] and monitor.report().stopped_request_by == "adaptive", \
        f"wave 1 (7, None, 7) is not unanimous, wave 2 (8, 8, 8) is; adds {run.adds}"


def test_adaptive_does_not_stop_before_min_branches():
    config = EarlyStopConfig(decided=False, adaptive=AdaptiveConfig(wave_size=4, min_branches=8))
    monitor = EarlyStopMonitor(config, n=12, extract=extract_ans, max_new_tokens=1)
    run = replay(monitor, [answer_script("7", [-0.1]) for _ in range(12)])
    assert run.adds == [(1, 4)] and monitor.report().branches_launched == 8


@pytest.mark.parametrize("leader,other", [(0, 0), (1, 0), (4, 0), (3, 1), (6, 2), (10, 7), (25, 3)])
def test_the_beta_posterior_is_the_integral_of_the_beta_density_above_one_half(leader, other):
    x = np.linspace(0.0, 1.0, 200001)
    density = x**leader * (1 - x) ** other
    above = np.trapezoid(np.where(x >= 0.5, density, 0.0), x) / np.trapezoid(density, x)
    assert beta_leader_posterior(leader, other) == pytest.approx(above, abs=1e-4)


def test_the_beta_posterior_matches_known_values():
    assert beta_leader_posterior(0, 0) == 0.5
    assert beta_leader_posterior(1, 0) == 0.75
    assert beta_leader_posterior(4, 0) == 31 / 32
    assert beta_leader_posterior(3, 1) == 13 / 16


@pytest.mark.parametrize("votes", [[6, 1, 1], [8, 2, 1, 1], [5, 3, 1], [12, 1, 1, 1, 1], [3, 3, 2]])
def test_the_dirichlet_posterior_is_a_lower_bound_close_to_a_monte_carlo_estimate(votes):
    rng = np.random.default_rng(0)
    shares = rng.dirichlet(np.array(votes) + 1.0, size=400_000)
    estimate = float((shares.argmax(axis=1) == 0).mean())
    bound = dirichlet_leader_posterior(votes, 0)
    assert bound <= estimate + 0.003, f"{votes}: the bound {bound} exceeds the posterior {estimate}"
    if estimate > 0.9:
        assert bound >= estimate - 0.02, f"{votes}: the bound {bound} is loose against {estimate}"


def test_the_dirichlet_posterior_with_two_answers_is_the_beta_posterior():
    assert dirichlet_leader_posterior([5, 2], 0) == beta_leader_posterior(5, 2)
    assert dirichlet_leader_posterior([2, 5], 1) == beta_leader_posterior(5, 2)


# -- confidence -------------------------------------------------------------------------------------
def confidence_monitor(percentile: float, n: int = 4) -> EarlyStopMonitor:
    config = EarlyStopConfig(decided=False, confidence=ConfidenceConfig(window_tokens=2, warmup_branches=2,
                                                                        percentile=percentile))
    return EarlyStopMonitor(config, n=n, extract=extract_ans, max_new_tokens=8)


def test_confidence_stops_a_branch_at_the_token_its_window_mean_falls_below_the_warmup_threshold():
    scripts = [answer_script("7", [-0.1] * 3), answer_script("7", [-0.2] * 3),  # warm-up: lowest -0.1, -0.2
               answer_script("8", [-0.1, -0.1, -0.1, -0.5, -0.5, -0.5]),  # window mean -0.3 at token 4
               answer_script("8", [-0.1] * 6)]
    monitor = confidence_monitor(percentile=0.0)  # threshold: the lowest warm-up window, -0.2
    run = replay(monitor, scripts)
    assert monitor.report().confidence_threshold == pytest.approx(-0.2)
    assert run.stopped_at == {2: 4}, f"expected branch 2 stopped at its 4th token, got {run.stopped_at}"
    assert monitor.report().stopped_by == ((2, "confidence"),)
    ordered = [run.completions[i] for i in range(4)]
    assert monitor.voting(ordered) == [True, True, False, True], "a window mean equal to the threshold still votes"


def test_confidence_stops_a_branch_that_dipped_before_the_warmup_ended_as_soon_as_it_ends():
    scripts = [answer_script("7", [-0.1] * 4), answer_script("7", [-0.2] * 4),
               answer_script("8", [-1.0, -1.0, -0.1, -0.1, -0.1, -0.1, -0.1])]  # dips at token 2
    monitor = confidence_monitor(percentile=0.0, n=3)
    run = replay(monitor, scripts)
    assert run.stopped_at == {2: 4}, f"the warm-up ends at step 4: branch 2 must stop then, got {run.stopped_at}"


def test_confidence_drops_warmup_branches_below_the_threshold_from_the_vote():
    scripts = [answer_script("7", [-0.1] * 3), answer_script("8", [-0.2] * 3)]
    monitor = confidence_monitor(percentile=100.0, n=2)  # threshold: the highest warm-up window, -0.1
    run = replay(monitor, scripts)
    assert monitor.voting([run.completions[0], run.completions[1]]) == [True, False]


@pytest.mark.parametrize("window", [1, 2, 3, 5, 8])
def test_the_lowest_window_mean_is_the_smallest_mean_of_consecutive_tokens(window):
    rng = random.Random(window)
    logprobs = [rng.uniform(-3, 0) for _ in range(7)]
    if window > len(logprobs):
        expected = sum(logprobs) / len(logprobs)
    else:
        expected = min(np.mean(logprobs[i:i + window]) for i in range(len(logprobs) - window + 1))
    assert lowest_window_mean(logprobs, window) == pytest.approx(expected, abs=1e-12)
    assert lowest_window_mean([], window) == -math.inf


# -- the monitor's contract ---------------------------------------------------------------------------
def test_the_monitor_rejects_an_event_for_a_branch_it_never_launched():
    monitor = EarlyStopMonitor(EarlyStopConfig(adaptive=AdaptiveConfig(wave_size=2)), n=8, extract=extract_ans,
                               max_new_tokens=4)
    with pytest.raises(ValueError, match="never launched"):
        monitor.observe([BranchEvent(2, 0, -0.1, 1, "")])


def test_a_completion_cancelled_by_someone_else_does_not_vote():
    monitor = EarlyStopMonitor(EarlyStopConfig(), n=2, extract=extract_ans, max_new_tokens=4)
    script = answer_script("7", [-0.1])
    assert monitor.voting([completion_of(0, script, 1, "cancelled"), completion_of(1, script, 1, "eos")]) == [False, True]


def test_the_report_lists_each_stop_once_by_branch_index():
    scripts = [answer_script("A", [0.0]), answer_script("A", [0.0]), answer_script("B", [-3.0] * 5),
               answer_script("B", [-3.0] * 5)]
    monitor = EarlyStopMonitor(EarlyStopConfig(), n=4, extract=extract_ans, max_new_tokens=5)
    replay(monitor, scripts)
    report = monitor.report()
    assert report.stopped_by == ((2, "decided"), (3, "decided")) and report.branches_cancelled == 2
    assert report.decode_tokens == 4, f"each branch decoded one token before the stop, got {report.decode_tokens}"


# -- configuration ----------------------------------------------------------------------------------
@pytest.mark.parametrize("build,error,field", [
    (lambda: AdaptiveConfig(wave_size=0), ValueError, "adaptive.wave_size"),
    (lambda: AdaptiveConfig(wave_size=2.0), TypeError, "adaptive.wave_size"),
    (lambda: AdaptiveConfig(threshold=0.0), ValueError, "adaptive.threshold"),
    (lambda: AdaptiveConfig(threshold=1.5), ValueError, "adaptive.threshold"),
    (lambda: AdaptiveConfig(threshold=float("nan")), ValueError, "adaptive.threshold"),
    (lambda: AdaptiveConfig(method="vote"), ValueError, "adaptive.method"),
    (lambda: AdaptiveConfig(min_branches=True), TypeError, "adaptive.min_branches"),
    (lambda: AnsweredConfig(pattern="(unclosed"), ValueError, "answered.pattern"),
    (lambda: AnsweredConfig(pattern=""), ValueError, "answered.pattern"),
    (lambda: AnsweredConfig(pattern=3), TypeError, "answered.pattern"),
    (lambda: ConfidenceConfig(window_tokens=0), ValueError, "confidence.window_tokens"),
    (lambda: ConfidenceConfig(warmup_branches=-1), ValueError, "confidence.warmup_branches"),
    (lambda: ConfidenceConfig(percentile=101), ValueError, "confidence.percentile"),
    (lambda: ConfidenceConfig(percentile="10"), TypeError, "confidence.percentile"),
    (lambda: EarlyStopConfig(decided=1), TypeError, "early_stop.decided"),
    (lambda: EarlyStopConfig(adaptive=ConfidenceConfig()), TypeError, "early_stop.adaptive"),
    (lambda: EarlyStopMonitor(EarlyStopConfig(), n=0, extract=extract_ans, max_new_tokens=4), ValueError, "n"),
    (lambda: EarlyStopMonitor(EarlyStopConfig(), n=2, extract="gsm8k", max_new_tokens=4), TypeError, "extract"),
    (lambda: EarlyStopMonitor(EarlyStopConfig(), n=2, extract=extract_ans, max_new_tokens=0), ValueError,
     "max_new_tokens"),
    (lambda: EarlyStopMonitor("decided", n=2, extract=extract_ans, max_new_tokens=4), TypeError, "config"),
])
def test_a_bad_setting_raises_an_error_naming_its_field(build, error, field):
    with pytest.raises(error, match=rf"^{re.escape(field)} must"):
        build()


@pytest.mark.parametrize("name,expected", [
    ("decided", EarlyStopConfig()),
    ("answered", EarlyStopConfig(answered=AnsweredConfig())),
    ("adaptive", EarlyStopConfig(adaptive=AdaptiveConfig())),
    ("confidence", EarlyStopConfig(confidence=ConfidenceConfig())),
    ("length", EarlyStopConfig(length=early_stop.LengthConfig())),
])
def test_each_rule_name_resolves_to_decided_plus_that_rule(name, expected):
    assert resolve_early_stop(name) == expected


def test_resolve_early_stop_passes_none_and_configs_through_and_names_the_valid_rules_otherwise():
    config = EarlyStopConfig(decided=False)
    assert resolve_early_stop(None) is None
    assert resolve_early_stop(config) is config
    with pytest.raises(ValueError, match=r"early_stop must be .*\['decided', 'answered', 'adaptive', 'confidence', 'length'\]"):
        resolve_early_stop("fast")
    with pytest.raises(TypeError, match="early_stop must be"):
        resolve_early_stop(True)


def test_all_lists_exactly_the_public_names():
    public = {name for name, value in vars(early_stop).items()
              if not name.startswith("_") and getattr(value, "__module__", None) == early_stop.__name__}
    assert public <= set(early_stop.__all__), f"public but not exported: {public - set(early_stop.__all__)}"
    assert all(hasattr(early_stop, name) for name in early_stop.__all__)


def test_the_length_rule_cuts_branches_past_factor_times_the_quartile_finish_and_they_leave_the_vote():
    from rksc_engine.reasoning.early_stop import LengthConfig

    # Branch 0 finishes at 5 tokens: with 4 launched, the first quarter has finished, the reference is
    # 5 and factor 2 cuts any branch at its 11th token. Branch 1 ends at 9, branches 2 and 3 ramble.
    lengths = [5, 9, 30, 40]
    scripts = [answer_script(str(i % 2), [-0.1] * k) for i, k in enumerate(lengths)]
    config = EarlyStopConfig(decided=False, length=LengthConfig(finished_fraction=0.25, factor=2.0))
    monitor = EarlyStopMonitor(config, n=4, extract=extract_ans, max_new_tokens=64)
    run = replay(monitor, scripts)
    assert run.stopped_at == {2: 11, 3: 11}
    assert dict(monitor.report().stopped_by) == {2: "length", 3: "length"}
    completions = [run.completions[i] for i in range(4)]
    assert monitor.voting(completions) == [True, True, False, False]


def test_the_length_rule_waits_for_its_share_of_finished_branches():
    from rksc_engine.reasoning.early_stop import LengthConfig

    scripts = [answer_script("1", [-0.1] * k) for k in (6, 7, 30, 30)]
    config = EarlyStopConfig(decided=False, length=LengthConfig(finished_fraction=0.5, factor=2.0))
    monitor = EarlyStopMonitor(config, n=4, extract=extract_ans, max_new_tokens=64)
    run = replay(monitor, scripts)
    assert run.stopped_at == {2: 15, 3: 15}  # the second finish (7 tokens) sets the reference


@pytest.mark.parametrize("field, value", [("finished_fraction", 0.0), ("finished_fraction", 1.5), ("factor", 1.0)])
def test_length_config_errors_name_the_field(field, value):
    from rksc_engine.reasoning.early_stop import LengthConfig

    with pytest.raises(ValueError, match=f"length.{field}"):
        LengthConfig(**{field: value})
