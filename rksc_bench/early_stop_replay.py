"""Early-stop rules replayed on recorded branches, exactly as the scheduler would run them (the
replay of ``benchmarks/early_stop.py replay``).

A record holds every branch of one question run to its end (``early_stop=None``): tokens, log-probs,
finish reason and text, branch ``b`` seeded ``seed + b``. ``replay_question`` feeds those branches,
step by step, to an ``EarlyStopMonitor`` with the same events in the same order as the scheduler:
stops applied before the next forward, waves forked with the next branch indices (whose tokens are
the recorded ones, by the seeding). The monitor's decisions and the decoded tokens are therefore
exactly those of a live run, so every rule is measured without generating again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rksc_engine.reasoning.cgee import summarise_votes
from rksc_engine.reasoning.early_stop import EarlyStopConfig, EarlyStopMonitor
from rksc_engine.results import BranchEvent, Completion
from rksc_engine.runtime.branch_output import first_stop


@dataclass
class Replayed:
    """One question under one rule: what the vote and the decoding would have been."""

    winner: str | None
    decode_tokens: int
    steps: int  # scheduler steps the request spanned (its latency, in steps)
    row_steps: int  # sum over steps of live rows (what a batch pays)
    launched: int
    cancelled: int


class BranchTexts:
    """Each branch's text after its first k tokens, decoded on demand and kept for the question."""

    def __init__(self, tokenizer: Any, branches: list[dict], stop: Sequence[str] = ()) -> None:
        self._tokenizer, self._branches, self._stop = tokenizer, branches, tuple(stop)
        self._cache: dict[tuple[int, int], str] = {}

    def text(self, b: int, k: int) -> str:
        branch = self._branches[b]
        if k >= len(branch["tokens"]):
            return branch["text"]
        key = (b, k)
        if key not in self._cache:
            text = self._tokenizer.decode(branch["tokens"][:k], skip_special_tokens=True)
            cut = first_stop(text, self._stop) if self._stop else None  # as the scheduler cuts it
            self._cache[key] = text if cut is None else text[:cut]
        return self._cache[key]


def replay_question(rec: dict, n: int, config: EarlyStopConfig | None, texts: BranchTexts,
                    extract: Callable[[str], str | None]) -> Replayed:
    """Run the recorded branches 0..n-1 through ``config``'s monitor as the scheduler runs them."""
    branches = rec["branches"][:n]
    if config is None:
        completions = [_completion(branches[b], b, len(branches[b]["tokens"]), branches[b]["text"], False)
                       for b in range(n)]
        summary = summarise_votes([extract(c.text) for c in completions], [c.confidence for c in completions])
        lengths = [len(b["tokens"]) for b in branches]
        return Replayed(summary.winner, sum(lengths), max(lengths), sum(lengths), n, 0)
    monitor = EarlyStopMonitor(config, n=n, extract=extract, max_new_tokens=rec["max_new_tokens"])
    position: dict[int, int] = {}
    running: set[int] = set()
    cancelled: set[int] = set()
    pending: set[int] = set()
    members: list[list[int]] = []
    totals = {"tokens": 0}

    def launch(count: int) -> list[int]:
        first = len(position)
        wave = list(range(first, first + count))
        for b in wave:
            position[b] = 0
            running.add(b)
        members.append(wave)
        return wave

    def advance(wave: list[int]) -> None:
        # The scheduler's _advance for one member request: sample, observe, stop, fork.
        rows = [b for b in wave if b in running]
        events = []
        for b in rows:
            branch = branches[b]
            position[b] += 1
            k = position[b]
            finished = k >= len(branch["tokens"])
            text = texts.text(b, k) if (finished or config.answered) else ""
            completion = _completion(branch, b, k, text, False) if finished else None
            events.append(BranchEvent(b, branch["tokens"][k - 1], branch["logprobs"][k - 1], k, text, completion))
            if finished:
                running.discard(b)
        totals["tokens"] += len(rows)
        control = monitor.observe(events)
        if control is not None:
            pending.update(set(control.stop) & running)
            if control.add:
                add = min(control.add, n - len(position))
                if add > 0:
                    advance(launch(add))
        for b in rows:
            if b in running and b in pending:
                running.discard(b)
                cancelled.add(b)
                pending.discard(b)

    advance(launch(monitor.initial_branches))
    steps, row_steps = 1, len(position)
    while running:
        for b in list(pending & running):  # the reap at the start of a step
            running.discard(b)
            cancelled.add(b)
        pending.clear()
        if not running:
            break
        steps += 1
        row_steps += len(running)
        for wave in list(members):
            if any(b in running for b in wave):
                advance(wave)
    completions = [_completion(branches[b], b, position[b], texts.text(b, position[b]), b in cancelled)
                   for b in range(len(position))]
    answers = monitor.answers(completions)
    summary = summarise_votes(answers, [c.confidence for c in completions])
    return Replayed(summary.winner, totals["tokens"], steps, row_steps, len(position), len(cancelled))


def _completion(branch: dict, index: int, k: int, text: str, cancelled: bool) -> Completion:
    return Completion(text=text, token_ids=tuple(branch["tokens"][:k]), logprobs=tuple(branch["logprobs"][:k]),
                      finish_reason="cancelled" if cancelled else branch["finish"], num_prompt_tokens=0,
                      branch_index=index)
