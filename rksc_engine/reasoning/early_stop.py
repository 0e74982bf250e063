"""Early stopping for self-consistency: when to stop a request's branches, or launch no more.

This module owns the stop rules as pure logic (no model, no scheduler, no torch) and the
``BranchMonitor`` that applies them, ``EarlyStopMonitor``. The scheduler feeds it one
``BranchEvent`` per advancing branch and acts on the ``BranchControl`` it returns; whoever votes
asks it which completions vote (``voting``) and what it did (``report``).

The rules (``EarlyStopConfig`` composes them):
    * ``decided`` (exact): stop every running branch once no outcome of the branches still running
      or not yet launched can change the winner of the full vote. The vote is the one rksc applies,
      ``cgee.summarise_votes``: confidence-weighted shares, first-seen tie-break.
    * ``answered``: end a branch once its answer is settled (a line matching a pattern, closed by a
      newline); it still votes with its text so far.
    * ``adaptive``: launch waves of ``wave_size`` up to the budget, and launch no more once the
      posterior that the leader is the majority answer reaches ``threshold`` (Adaptive-Consistency's
      Beta or Dirichlet stopping criteria) or a whole wave agrees (Early-Stopping Self-Consistency).
    * ``confidence`` (DeepConf online): the warm-up branches set a threshold on the lowest
      sliding-window mean token logprob; any branch whose window mean falls below it is stopped and
      leaves the vote.
    * ``length`` (a tail cut): once a fraction of the launched branches has finished, a branch that
      runs past ``factor`` times the length at which that fraction was reached is stopped and leaves
      the vote. A small model's wrong branches are the ones that ramble on to ``max_new_tokens``
      without an answer, and they set a request's latency.

Promises:
    * With ``decided`` and without ``adaptive``, the winner of the vote over the completions that
      ``voting`` keeps equals the winner of the vote over all ``n`` branches run to their end, always
      (with ``answered``, ``confidence`` or ``length`` on, "to their end" means as those rules end or
      drop them; they read only the branches' own tokens and lengths, never the clock, so that vote
      does not depend on timing; with ``confidence``, nothing is decided before the warm-up branches
      have set the threshold).
    * The ``confidence`` filter is a property of a branch's tokens: a branch leaves the vote if and
      only if its lowest window mean is below the threshold, whether it was stopped or had finished.
    * ``observe`` costs O(running branches) per step at most; answers are extracted only when a branch
      finishes, and for ``answered`` only on steps whose text gained a newline.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..results import BranchControl, BranchEvent, Completion

__all__ = [
    "ADAPTIVE_METHODS", "EARLY_STOP_RULES", "GSM8K_SETTLED_PATTERN", "AdaptiveConfig", "AnsweredConfig",
    "ConfidenceConfig", "EarlyStopConfig", "LengthConfig", "EarlyStopMonitor", "EarlyStopReport", "beta_leader_posterior",
    "dirichlet_leader_posterior", "for_clustered_vote", "lowest_window_mean", "resolve_early_stop",
]

EARLY_STOP_RULES = ("decided", "answered", "adaptive", "confidence", "length")
ADAPTIVE_METHODS = ("beta", "dirichlet", "esc")
# A GSM8K answer line: "####" and then a digit on the same line (extract_gsm8k_answer reads the first
# number after the last "####"; the newline that closes the line means no more digits can join it).
GSM8K_SETTLED_PATTERN = r"####[^\n\d]*\d"
# Relative slack the decided rule keeps over float rounding: rksc sums the same weights in another
# order, which moves each sum by at most about n * 2**-53 of the total; 1e-9 covers n up to millions.
_DECIDED_REL_SLACK = 1e-9


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    interval = f"{'(' if low_open else '['}{low}, {high}]"
    if not (low < value <= high if low_open else low <= value <= high):  # also rejects NaN
        raise ValueError(f"{name} must be in {interval}, got {value}")


@dataclass(frozen=True)
class AnsweredConfig:
    """End a branch as soon as its answer is settled.

    Attributes:
        pattern: A regular expression searched in each completed line of a branch's text (the line
            without its newline); the first line that matches settles the answer and the branch ends
            there. The default suits ``extract_gsm8k_answer`` (``#### <number>``); give your own for
            other extractors. Must compile and be non-empty.
    """

    pattern: str = GSM8K_SETTLED_PATTERN

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise TypeError(f"answered.pattern must be a regular expression string, got {type(self.pattern).__name__}")
        if not self.pattern:
            raise ValueError("answered.pattern must be a non-empty regular expression")
        try:
            re.compile(self.pattern)
        except re.error as error:
            raise ValueError(f"answered.pattern must be a valid regular expression: {error}") from None


@dataclass(frozen=True)
class AdaptiveConfig:
    """Launch branches in waves and stop launching once the vote looks settled.

    Attributes:
        wave_size: Branches per wave (the first wave too), >= 1. Default 4: four agreeing answers give
            the Beta posterior 0.97, past the default threshold.
        threshold: The posterior the leader must reach, in (0, 1]; unused by ``"esc"``. Default 0.95
            (Adaptive-Consistency's).
        method: ``"beta"``: the posterior that the leader's share exceeds 1/2 with a uniform prior on
            the leader's count against all other answers' (exact binomial sum). ``"dirichlet"``: with
            three or more answers, a lower bound on the posterior that the leader's share is the largest
            under a uniform Dirichlet prior (see ``dirichlet_leader_posterior``); with fewer, ``"beta"``.
            ``"esc"``: stop when every branch of the last wave voted the same answer.
        min_branches: Branches to launch before the rule may stop, >= 1. Default 1.
    """

    wave_size: int = 4
    threshold: float = 0.95
    method: str = "beta"
    min_branches: int = 1

    def __post_init__(self) -> None:
        _check_int("adaptive.wave_size", self.wave_size, 1)
        _check_number("adaptive.threshold", self.threshold, 0.0, 1.0, low_open=True)
        if not isinstance(self.method, str):
            raise TypeError(f"adaptive.method must be one of {list(ADAPTIVE_METHODS)}, got {type(self.method).__name__}")
        if self.method not in ADAPTIVE_METHODS:
            raise ValueError(f"adaptive.method must be one of {list(ADAPTIVE_METHODS)}, got {self.method!r}")
        _check_int("adaptive.min_branches", self.min_branches, 1)


@dataclass(frozen=True)
class ConfidenceConfig:
    """DeepConf-online filtering on the sampled tokens' logprobs.

    Attributes:
        window_tokens: Tokens per sliding window, >= 1. Default 16: about a tenth of a 100-200-token
            trace, long enough to average out single unlikely tokens, short enough that one confused
            stretch shows. A branch shorter than a window is judged by the mean of all its tokens.
        warmup_branches: The first branches (by index), run to their end, whose lowest window means
            set the threshold, >= 1. Default 4. A request with fewer branches uses them all.
        percentile: The threshold is this percentile (linear interpolation) of the warm-up branches'
            lowest window means, in [0, 100]. Default 10, which keeps about 90% of branches (DeepConf's
            "high"); 90 keeps about 10% ("low").
    """

    window_tokens: int = 16
    warmup_branches: int = 4
    percentile: float = 10.0

    def __post_init__(self) -> None:
        _check_int("confidence.window_tokens", self.window_tokens, 1)
        _check_int("confidence.warmup_branches", self.warmup_branches, 1)
        _check_number("confidence.percentile", self.percentile, 0.0, 100.0)


@dataclass(frozen=True)
class LengthConfig:
    """The tail cut: stop branches that run far longer than the first ones to finish.

    Attributes:
        finished_fraction: The share of launched branches that must have finished before the cut
            applies, in (0, 1]. Default 0.25: the reference is the length of the quartile branch.
        factor: A running branch is stopped once it is longer than ``factor`` times that reference
            length, > 1. Default 2.0.
    """

    finished_fraction: float = 0.25
    factor: float = 2.0

    def __post_init__(self) -> None:
        _check_number("length.finished_fraction", self.finished_fraction, 0.0, 1.0, low_open=True)
        _check_number("length.factor", self.factor, 1.0, math.inf, low_open=True)


@dataclass(frozen=True)
class EarlyStopConfig:
    """Which stop rules a self-consistency request runs (see the module docstring).

    Attributes:
        decided: Stop all running branches once the vote's winner can no longer change. Default True:
            it never changes the answer, only the tokens spent.
        answered: End each branch once its answer is settled; None: off (the default).
        adaptive: Launch in waves and stop launching when the vote looks settled; None: off, all
            branches launch at once (the default).
        confidence: Drop branches whose sliding-window confidence falls below the warm-up threshold;
            None: off (the default).
        length: Drop branches that run past the tail cut; None: off (the default).
    """

    decided: bool = True
    answered: AnsweredConfig | None = None
    adaptive: AdaptiveConfig | None = None
    confidence: ConfidenceConfig | None = None
    length: LengthConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.decided, bool):
            raise TypeError(f"early_stop.decided must be a bool, got {type(self.decided).__name__}")
        for name, kind in (("answered", AnsweredConfig), ("adaptive", AdaptiveConfig), ("confidence", ConfidenceConfig),
                           ("length", LengthConfig)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"early_stop.{name} must be an {kind.__name__} or None, got {type(value).__name__}")


def resolve_early_stop(value: None | str | EarlyStopConfig) -> EarlyStopConfig | None:
    """The early-stop configuration a caller means.

    None is off; a rule name means ``decided`` plus that rule with its defaults (``"decided"`` alone:
    ``EarlyStopConfig()``); an ``EarlyStopConfig`` is used as is.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
        TypeError: anything else.
    """
    if value is None or isinstance(value, EarlyStopConfig):
        return value
    if isinstance(value, str):
        if value == "decided":
            return EarlyStopConfig()
        if value == "answered":
            return EarlyStopConfig(answered=AnsweredConfig())
        if value == "adaptive":
            return EarlyStopConfig(adaptive=AdaptiveConfig())
        if value == "confidence":
            return EarlyStopConfig(confidence=ConfidenceConfig())
        if value == "length":
            return EarlyStopConfig(length=LengthConfig())
        raise ValueError(f"early_stop must be None, an EarlyStopConfig or one of {list(EARLY_STOP_RULES)}, got {value!r}")
    raise TypeError(f"early_stop must be None, an EarlyStopConfig or one of {list(EARLY_STOP_RULES)}, "
                    f"got {type(value).__name__}")


def for_clustered_vote(config: EarlyStopConfig | None) -> EarlyStopConfig | None:
    """The rules of ``config`` that hold under a clustered vote (``VoteConfig(method="cluster")``).

    ``decided`` and ``adaptive`` count each branch's own answer as a vote, but a clustered vote
    counts clusters, and a branch still running can join or bridge any of them, so neither can say
    when the winner is settled. ``decided`` is dropped (it only ever saves tokens, so the answer is
    the one every branch run to its end gives); ``adaptive`` is refused, as it would change how many
    branches run. The rules that judge a branch by its own tokens (``answered``, ``confidence``,
    ``length``) stay.

    Returns:
        ``config`` without ``decided``, or None when no rule is left.

    Raises:
        ValueError: ``config.adaptive`` is set.
    """
    if config is None:
        return None
    if config.adaptive is not None:
        raise ValueError("early_stop.adaptive counts votes per answer and cannot run under a clustered vote; "
                         "use vote='exact' or an early stop without adaptive")
    if config.answered is None and config.confidence is None and config.length is None:
        return None
    return EarlyStopConfig(decided=False, answered=config.answered, confidence=config.confidence, length=config.length)


def beta_leader_posterior(leader_votes: int, other_votes: int) -> float:
    """``P(p > 1/2)`` for ``p ~ Beta(leader_votes + 1, other_votes + 1)``: the posterior, under a
    uniform prior, that the leader holds the majority. Exact: for integer shapes ``a, b`` the Beta tail
    is a binomial sum, ``P(X > 1/2) = sum_{j < a} C(a + b - 1, j) / 2**(a + b - 1)``."""
    _check_int("leader_votes", leader_votes, 0)
    _check_int("other_votes", other_votes, 0)
    trials = leader_votes + other_votes + 1
    below = sum(math.comb(trials, j) for j in range(leader_votes + 1))
    return below / 2**trials  # int / int rounds once, correctly


def dirichlet_leader_posterior(votes: Sequence[int], leader: int = 0) -> float:
    """A lower bound on the posterior that answer ``leader`` has the largest share, for shares
    ``~ Dirichlet(votes + 1)`` (a uniform prior over the answers seen).

    For any two answers ``i, j`` of a Dirichlet, ``p_i / (p_i + p_j) ~ Beta(votes_i + 1, votes_j + 1)``,
    so ``P(p_j >= p_leader)`` is an exact Beta tail (``beta_leader_posterior``); the union bound gives
    ``P(leader largest) >= 1 - sum_j P(p_j >= p_leader)``. The bound is deterministic, and conservative
    (stopping on it never stops where the exact posterior is below the threshold); it is tight where a
    stopping threshold sits, as the events "j beats the leader" then rarely happen together.
    """
    counts = list(votes)
    for count in counts:
        _check_int("votes", count, 0)
    if not 0 <= leader < len(counts):
        raise ValueError(f"leader must index votes (0 to {len(counts) - 1}), got {leader}")
    if len(counts) == 1:
        return 1.0
    beaten = sum(1.0 - beta_leader_posterior(counts[leader], count) for j, count in enumerate(counts) if j != leader)
    return max(0.0, 1.0 - beaten)


def lowest_window_mean(logprobs: Sequence[float], window_tokens: int) -> float:
    """The lowest mean logprob over ``window_tokens`` consecutive tokens; the mean of all tokens when
    there are fewer; ``-inf`` for none. ``EarlyStopMonitor`` tracks the same quantity online with the
    same arithmetic, so the two agree to the bit."""
    if not logprobs:
        return -math.inf
    if len(logprobs) < window_tokens:
        total = 0.0
        for logprob in logprobs:
            total += logprob
        return total / len(logprobs)
    lowest = math.inf
    for end in range(window_tokens, len(logprobs) + 1):
        mean = sum(logprobs[end - window_tokens:end]) / window_tokens
        if mean < lowest:
            lowest = mean
    return lowest


def _percentile(values: Sequence[float], percent: float) -> float:
    """Linear-interpolation percentile (NumPy's default), safe with ``-inf`` values."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * percent / 100.0
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    fraction = position - below
    low, high = ordered[below], ordered[above]
    if fraction == 0.0 or low == high or math.isinf(low):
        return low
    return low + (high - low) * fraction


@dataclass(frozen=True)
class EarlyStopReport:
    """What an ``EarlyStopMonitor`` did for its request.

    Attributes:
        branches_launched: Branches the request ran (``n`` without waves).
        branches_cancelled: Branches the monitor stopped (by any rule, ``answered`` included).
        decode_tokens: Tokens the monitor saw decoded, over all branches.
        stopped_by: ``(branch_index, rule)`` per stopped branch, by branch index.
        stopped_request_by: The rule that ended the request early (``"decided"``, ``"adaptive"``), or None.
        confidence_threshold: The ``confidence`` rule's threshold on window means; None until the warm-up
            branches have ended, and without the rule.
    """

    branches_launched: int
    branches_cancelled: int
    decode_tokens: int
    stopped_by: tuple[tuple[int, str], ...]
    stopped_request_by: str | None
    confidence_threshold: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The report in JSON types, for the adapters' events and answers: the fields by name, with
        ``stopped_by`` as a list of ``{"branch_index", "rule"}`` objects."""
        return {
            "branches_launched": self.branches_launched,
            "branches_cancelled": self.branches_cancelled,
            "decode_tokens": self.decode_tokens,
            "stopped_by": [{"branch_index": index, "rule": rule} for index, rule in self.stopped_by],
            "stopped_request_by": self.stopped_request_by,
            "confidence_threshold": self.confidence_threshold,
        }


_RUNNING, _FINAL, _DROPPED = 0, 1, 2  # a branch decoding; ended and voting (maybe); stopped out of the vote


class _Branch:
    """One branch's running state: sums, not text (the text arrives with each event)."""

    __slots__ = ("index", "state", "logprob_sum", "num_tokens", "window", "lowest_window", "scan_from",
                 "answer", "weight")

    def __init__(self, index: int, window_tokens: int | None) -> None:
        self.index = index
        self.state = _RUNNING
        self.logprob_sum = 0.0
        self.num_tokens = 0
        self.window: deque[float] | None = deque(maxlen=window_tokens) if window_tokens else None
        self.lowest_window = math.inf  # over full windows only
        self.scan_from = 0  # text before this offset is whole lines already searched by ``answered``
        self.answer: str | None = None
        self.weight = 0.0  # its vote weight once final, as summarise_votes counts it


class EarlyStopMonitor:
    """The ``BranchMonitor`` of one self-consistency request (see the module docstring).

    Args:
        config: The rules to run.
        n: The branch budget: the branches a plain request runs, the most waves may reach.
        extract: The answer extractor the vote uses (``reasoning.resolve_extractor``).
        max_new_tokens: At least the most tokens any branch can generate; the ``decided`` bound on a
            running branch's confidence rests on it.

    Example::

        monitor = EarlyStopMonitor(EarlyStopConfig(), n=8, extract=extract_gsm8k_answer, max_new_tokens=160)
        completions = engine.submit(prompt, monitor.initial_branches, params, monitor=monitor, max_branches=8).result()
        kept = [c for c, votes in zip(completions, monitor.voting(completions)) if votes]
    """

    def __init__(self, config: EarlyStopConfig, *, n: int, extract: Callable[[str], str | None],
                 max_new_tokens: int) -> None:
        if not isinstance(config, EarlyStopConfig):
            raise TypeError(f"config must be an EarlyStopConfig, got {type(config).__name__}")
        _check_int("n", n, 1)
        if not callable(extract):
            raise TypeError(f"extract must be a callable, got {type(extract).__name__}")
        _check_int("max_new_tokens", max_new_tokens, 1)
        self.config, self.n, self._extract, self._max_new_tokens = config, n, extract, max_new_tokens
        self._settled = re.compile(config.answered.pattern) if config.answered else None
        self._window_tokens = config.confidence.window_tokens if config.confidence else None
        self._warmup = min(config.confidence.warmup_branches, n) if config.confidence else 0
        self._threshold: float | None = None  # the confidence threshold, once the warm-up has ended
        self._launched = min(config.adaptive.wave_size, n) if config.adaptive else n
        self._wave_start = 0  # the first index of the latest wave
        self._branches: dict[int, _Branch] = {}
        self._silent = set(range(self._launched))  # launched, no event seen yet
        self._stopped: dict[int, str] = {}
        self._decode_tokens = 0
        self._request_rule: str | None = None
        self._unsure = False  # a NaN weight: the decided rule cannot reason about the vote
        self._gap = -math.inf  # the finished voters' leader weight minus the runner-up's
        self._reference_tokens: int | None = None  # the length rule's reference, once known
        self._scale = 0.0  # all finished voters' weight, for the float slack

    @property
    def initial_branches(self) -> int:
        """Branches to launch first: ``n``, or the first wave."""
        return min(self.config.adaptive.wave_size, self.n) if self.config.adaptive else self.n

    # -- the BranchMonitor protocol ---------------------------------------------------------------
    def observe(self, events: Sequence[BranchEvent]) -> BranchControl | None:
        """Take one step of the request's branches; return the branches to stop and to add."""
        stop: set[int] = set()
        changed = False
        for event in events:
            branch = self._branch(event.branch_index)
            self._decode_tokens += 1
            if branch.state != _RUNNING:  # stopped from another wave's step: one more token came first
                continue
            self._advance(branch, event.logprob)
            if event.completion is not None:
                self._finish(branch, event.completion.text, event.completion.confidence)
                changed = True
            elif self._below_threshold(branch):
                self._drop(branch, "confidence", stop)
            elif self._settled is not None and self._answer_settled(branch, event.text):
                self._finish(branch, event.text, self._confidence(branch))
                self._stopped[branch.index] = "answered"
                stop.add(branch.index)
                changed = True
        if self._threshold is None and self._warmup and self._warmup_done():
            self._threshold = _percentile([b.lowest_window for b in self._warmup_branches()],
                                          self.config.confidence.percentile)
            for branch in self._running():
                if self._below_threshold(branch):
                    self._drop(branch, "confidence", stop)
            changed = True
        if self.config.length is not None:
            self._cut_long(stop)
        if changed:
            self._tally()
        add = 0
        if self._request_rule is None and self.config.decided and self._decided():
            self._request_rule = "decided"
            for branch_index in [*self._silent, *(b.index for b in self._running())]:
                self._drop(self._branch(branch_index), "decided", stop)
        if self._request_rule is None and self.config.adaptive and not self._silent and not self._running():
            add = self._next_wave()
        return BranchControl(frozenset(stop), add) if stop or add else None

    # -- what the caller asks afterwards ----------------------------------------------------------
    def voting(self, completions: Sequence[Completion]) -> list[bool]:
        """Per completion, whether it votes: not for a branch stopped by ``decided`` or ``confidence``,
        nor one below the confidence threshold, nor one cancelled by anyone but ``answered``."""
        votes = []
        for completion in completions:
            branch = self._branches.get(completion.branch_index)
            if branch is not None and branch.state == _FINAL:
                votes.append(self._passes_filter(branch.lowest_window) is not False)
            elif branch is not None and branch.state == _DROPPED:
                votes.append(False)
            else:  # never seen to finish: judge the completion itself
                passes = self._passes_filter(lowest_window_mean(completion.logprobs, self._window_tokens or 1))
                votes.append(completion.finish_reason != "cancelled" and passes is not False)
        return votes

    def answers(self, completions: Sequence[Completion]) -> list[str | None]:
        """Per completion, the answer it votes with, or None when it does not vote. Each answer is
        extracted once: a branch the monitor saw finish keeps the answer it counted then."""
        answers: list[str | None] = []
        for completion, votes in zip(completions, self.voting(completions)):
            branch = self._branches.get(completion.branch_index)
            if not votes:
                answers.append(None)
            elif branch is not None and branch.state == _FINAL:
                answers.append(branch.answer)
            else:
                answers.append(self._extract(completion.text))
        return answers

    def report(self) -> EarlyStopReport:
        """What the monitor has done so far (complete once the request has finished)."""
        return EarlyStopReport(self._launched, len(self._stopped), self._decode_tokens,
                               tuple(sorted(self._stopped.items())), self._request_rule, self._threshold)

    # -- per-branch bookkeeping -------------------------------------------------------------------
    def _branch(self, index: int) -> _Branch:
        branch = self._branches.get(index)
        if branch is None:
            if not isinstance(index, int) or not 0 <= index < self._launched:
                raise ValueError(f"branch {index!r} was never launched (the monitor launched 0 to {self._launched - 1})")
            branch = self._branches[index] = _Branch(index, self._window_tokens)
            self._silent.discard(index)
        return branch

    def _running(self) -> list[_Branch]:
        return [b for b in self._branches.values() if b.state == _RUNNING]

    def _advance(self, branch: _Branch, logprob: float) -> None:
        branch.logprob_sum += logprob
        branch.num_tokens += 1
        window = branch.window
        if window is not None:
            window.append(logprob)
            if len(window) == window.maxlen:
                mean = sum(window) / window.maxlen  # the arithmetic of lowest_window_mean
                if mean < branch.lowest_window:
                    branch.lowest_window = mean

    def _confidence(self, branch: _Branch) -> float:
        """``Completion.confidence`` of the branch as it stands (exp of its mean token logprob)."""
        mean = branch.logprob_sum / branch.num_tokens
        return math.exp(mean) if mean < 700 else math.inf

    def _answer_settled(self, branch: _Branch, text: str) -> bool:
        """Whether a line completed since the last look matches the settled pattern. Only the current
        partial line is scanned for a newline, so a step without one costs one ``find``."""
        last_newline = text.rfind("\n", branch.scan_from)
        if last_newline < 0:
            return False
        lines = text[branch.scan_from:last_newline].split("\n")
        branch.scan_from = last_newline + 1
        return any(self._settled.search(line) for line in lines)

    def _finish(self, branch: _Branch, text: str, confidence: float) -> None:
        branch.state = _FINAL
        branch.answer = self._extract(text)
        branch.weight = max(confidence, 0.0)  # as summarise_votes weighs it
        if math.isnan(confidence):
            self._unsure = True
        if branch.window is not None and branch.num_tokens < branch.window.maxlen:
            branch.lowest_window = branch.logprob_sum / branch.num_tokens  # lowest_window_mean's short case

    def _drop(self, branch: _Branch, rule: str, stop: set[int]) -> None:
        branch.state = _DROPPED
        self._stopped[branch.index] = rule
        stop.add(branch.index)

    # -- confidence ---------------------------------------------------------------------------------
    def _warmup_branches(self) -> list[_Branch]:
        return [self._branches[i] for i in range(self._warmup) if i in self._branches]

    def _warmup_done(self) -> bool:
        warm = self._warmup_branches()
        return len(warm) == self._warmup and all(b.state == _FINAL for b in warm)

    def _threshold_known(self) -> bool:
        return not self._warmup or self._threshold is not None

    def _passes_filter(self, lowest_window: float) -> bool | None:
        """True or False once the threshold is known (always True without the rule); None before."""
        if not self._warmup:
            return True
        if self._threshold is None:
            return None
        return not lowest_window < self._threshold

    def _below_threshold(self, branch: _Branch) -> bool:
        return self._threshold is not None and branch.lowest_window < self._threshold

    # -- length -----------------------------------------------------------------------------------
    def _cut_long(self, stop: set[int]) -> None:
        """Once ``finished_fraction`` of the launched branches have finished, drop the running ones
        longer than ``factor`` times the length at which that share was reached."""
        config = self.config.length
        if self._reference_tokens is None:
            finished = sorted(b.num_tokens for b in self._branches.values() if b.state == _FINAL)
            needed = max(1, math.ceil(config.finished_fraction * self._launched))
            if len(finished) < needed:
                return
            self._reference_tokens = finished[needed - 1]
        limit = config.factor * self._reference_tokens
        for branch in self._running():
            if branch.num_tokens > limit:
                self._drop(branch, "length", stop)

    # -- decided ----------------------------------------------------------------------------------
    def _tally(self) -> None:
        """Recompute the finished voters' weight per answer, and from it the leader's lead over the
        runner-up (0 when alone: a new answer starts from nothing). Until the confidence threshold is
        known no finished branch is sure to vote, so nothing is decided."""
        weights: dict[str, float] = {}
        if self._threshold_known():
            for index in sorted(self._branches):  # branch order, as rksc sums the vote
                branch = self._branches[index]
                if branch.state == _FINAL and branch.answer is not None and self._passes_filter(branch.lowest_window):
                    weights[branch.answer] = weights.get(branch.answer, 0.0) + branch.weight
        self._scale = sum(weights.values())
        ranked = sorted(weights.values(), reverse=True)
        self._gap = ranked[0] - (ranked[1] if len(ranked) > 1 else 0.0) if ranked else -math.inf

    def _decided(self) -> bool:
        """Whether the leader wins however the remaining branches end. Each remaining branch adds at
        most its confidence bound to one answer (any answer, a new one included) or nothing, so the
        worst case sends all of it to the strongest challenger; the lead must beat that strictly."""
        if self._unsure or self._gap <= 0:
            return False
        running = self._running()
        unlaunched = self.n - self._launched + len(self._silent)
        if not running and not unlaunched:
            return False  # nothing left to save
        remaining = float(unlaunched)  # a branch not yet started may reach confidence 1
        if self._gap <= remaining:
            return False
        for branch in running:
            remaining += self._confidence_bound(branch)
            if remaining >= self._gap:
                return False
        return self._gap > remaining + _DECIDED_REL_SLACK * (self._scale + remaining)

    def _confidence_bound(self, branch: _Branch) -> float:
        """The most confidence a running branch can end with. Logprobs are <= 0, so its final sum
        ``S' <= S`` over ``k' <= max_new_tokens`` tokens gives ``S'/k' <= S/max_new_tokens``."""
        total = branch.logprob_sum
        if math.isnan(total) or total > 0:
            return math.inf
        return math.exp(total / self._max_new_tokens)

    # -- adaptive -----------------------------------------------------------------------------------
    def _next_wave(self) -> int:
        """At a wave's end: stop the request or return the size of the next wave (0 when spent)."""
        if self._launched >= self.n:
            return 0
        adaptive = self.config.adaptive
        # Votes are not known while the confidence threshold is not: keep launching until it is.
        if self._launched >= adaptive.min_branches and self._threshold_known() and self._vote_settled(adaptive):
            self._request_rule = "adaptive"
            return 0
        add = min(adaptive.wave_size, self.n - self._launched)
        self._wave_start = self._launched
        self._silent.update(range(self._launched, self._launched + add))
        self._launched += add
        return add

    def _vote_settled(self, adaptive: AdaptiveConfig) -> bool:
        voters = {index: b for index, b in sorted(self._branches.items())  # branch order: first seen leads ties
                  if b.state == _FINAL and self._passes_filter(b.lowest_window)}
        if adaptive.method == "esc":  # the whole last wave voted, and for one answer
            answers = {voters[i].answer if i in voters else None for i in range(self._wave_start, self._launched)}
            return len(answers) == 1 and None not in answers
        counts: dict[str, int] = {}
        for branch in voters.values():
            if branch.answer is not None:
                counts[branch.answer] = counts.get(branch.answer, 0) + 1
        if not counts:
            return False
        votes = list(counts.values())
        leader = votes.index(max(votes))
        if adaptive.method == "dirichlet" and len(votes) >= 3:
            posterior = dirichlet_leader_posterior(votes, leader)
        else:
            posterior = beta_leader_posterior(votes[leader], sum(votes) - votes[leader])
        return posterior >= adaptive.threshold
