"""Offline CGEE calibration: both levels' thresholds chosen on recorded questions, by replaying
``rksc_engine.reasoning.cgee``'s rules without running a model.

Calibration (``calibrate``): on held-out questions, each recorded with its vote, the decision of
full-depth verification and the logit lens of every layer (``CalibrationRecord``), both levels'
thresholds are chosen so that the decision error against full verification stays within a target
(by default its Wilson 95% upper bound), saving the most verifier work among those that do, as CALM
calibrates its exits. The rules are replayed offline (``cgee.exits_after_layer``, the exit rule the
verifier applies online, and ``cgee.pick_answer``), so calibration runs no model and can be repeated
on saved records.

Calibration for accuracy (``calibrate_split``): the rule a user cares about is not agreement with
the verifier but right answers. From per-question outcomes (``QuestionOutcome``: the vote, the answer
always verifying picked, the right answer, the verifier's measured seconds), level 1's ``tau_conf``
and ``margin`` are chosen so that CGEE loses no accuracy against always verifying (by default:
always verifying's accuracy lies within, or below, the Wilson 95% interval of CGEE's) while saving
the most verifier time, on a seeded half of the questions, and reported on the other half.

The arrow points one way: this module imports ``rksc_engine.reasoning.cgee``, never the other way round.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..config import CGEEConfig
from ..reasoning.cgee import VoteSummary, exits_after_layer, lens_entropy, pick_answer, should_skip

__all__ = [
    "ACCURACY_RULES", "EPSILON_GRID", "MARGIN_GRID", "TAU_GRID", "THETA_GRID", "Calibration", "CalibrationRecord",
    "OutcomeSummary", "QuestionOutcome", "SplitCalibration", "calibrate", "calibrate_accuracy", "calibrate_split",
    "split_outcomes", "summarise_outcomes", "wilson_interval",
]


def wilson_interval(errors: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial rate (95% by default)."""
    if trials == 0:
        return 0.0, 1.0
    phat = errors / trials
    denom = 1 + z * z / trials
    centre = (phat + z * z / (2 * trials)) / denom
    half = z * math.sqrt(phat * (1 - phat) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class CalibrationRecord:
    """One held-out question, as ``calibrate`` needs it.

    Attributes:
        summary: The vote's confidence-weighted shares.
        full_answer: The answer that full-depth verification picked (the reference decision).
        lens_logits: Optional ``(num_layers, num_candidates, 2)`` label logits of the logit lens at
            each decoder layer for the candidates in ``summary.shares`` order, from one full-depth
            pass of ``LLMJudgeVerifier(record_lens=True)``. Needed to calibrate level 2.
    """

    summary: VoteSummary
    full_answer: str | None
    lens_logits: torch.Tensor | None = None

    def to_dict(self) -> dict:
        return {"shares": [list(s) for s in self.summary.shares], "full_answer": self.full_answer,
                "lens_logits": None if self.lens_logits is None else self.lens_logits.tolist()}

    @classmethod
    def from_dict(cls, data: dict) -> CalibrationRecord:
        lens = data.get("lens_logits")
        return cls(VoteSummary(tuple((str(a), float(p)) for a, p in data["shares"])), data["full_answer"],
                   None if lens is None else torch.tensor(lens, dtype=torch.float32))


@dataclass(frozen=True)
class Calibration:
    """The thresholds ``calibrate`` picked and what they did on the held-out questions.

    Attributes:
        config: The chosen thresholds.
        skip_rate: Fraction of questions level 1 skipped.
        error_rate: Fraction of questions whose decision differs from full verification.
        error_upper: The bound that was held to ``target_error`` (Wilson 95% upper, or the observed rate).
        num_questions: Questions with at least one candidate (the verifier calls of full verification).
        work_saved: Mean fraction of a full verifier pass avoided per question, net of the exit checks
            (1 for a skip; ``(num_layers - 1 - exit_layer) / num_layers`` for an exit).
        mean_exit_layer: Mean 0-based exit layer over the verified questions, or None without level 2.
    """

    config: CGEEConfig
    skip_rate: float
    error_rate: float
    error_upper: float
    num_questions: int
    work_saved: float = 0.0
    mean_exit_layer: float | None = None


THETA_GRID = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
EPSILON_GRID = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)


def calibrate(
    records: Sequence[CalibrationRecord | tuple[VoteSummary, str | None]],
    target_error: float = 0.01,
    *,
    base: CGEEConfig | None = None,
    tau_grid: Sequence[float] = tuple(i / 20 for i in range(8, 21)),
    margin_grid: Sequence[float] = tuple(i / 10 for i in range(0, 11)),
    theta_grid: Sequence[float] = THETA_GRID,
    epsilon_grid: Sequence[float] = EPSILON_GRID,
    min_layer_grid: Sequence[int] | None = None,
    check_cost: float = 0.0,
    bound: str = "wilson",
) -> Calibration:
    """Pick thresholds on held-out questions to meet a target decision error, the way CALM does.

    A decision errs when it differs from the one full-depth verification made for that question.
    Level 1 (``tau_conf``, ``margin``, or skipping off) is searched on its grid; when every record
    carries ``lens_logits``, level 2 (``theta``, ``epsilon``, ``min_layer``, or exit off) is searched
    jointly with it by replaying the exit rule (``cgee.exits_after_layer``) and the picking rule
    (``pick_answer``) on the recorded logit lens, so no model runs here. Without lens data level 2
    is turned off in the result, since its error could not be bounded.

    Among the combinations whose error bound (the Wilson 95% upper bound of errors over questions by
    default, as CALM bounds its exit risk; ``bound="empirical"`` uses the observed rate) is at most
    ``target_error``, the one that saves the most verifier work wins; ties go to the stricter
    thresholds, and to level 2 off. Choosing the best of many combinations on the same questions is
    optimistic: check the result on questions it was not calibrated on (``benchmarks/cgee.py`` does).

    Args:
        records: ``CalibrationRecord``s, or ``(vote summary, full answer)`` pairs for level 1 only.
            Questions without any candidate are never verified and are left out.
        target_error: Largest acceptable decision error, in (0, 1).
        base: Settings not searched are taken from here. Default ``CGEEConfig()``.
        tau_grid / margin_grid: Level-1 candidates.
        theta_grid / epsilon_grid / min_layer_grid: Level-2 candidates; ``min_layer_grid`` defaults to
            every other layer.
        check_cost: Cost of one exit check in units of one decoder layer of the pass, >= 0; it is
            charged against the layers an exit saves.
        bound: ``"wilson"`` or ``"empirical"``.

    Example:
        >>> result = calibrate(records, target_error=0.05)
        >>> engine_config = EngineConfig(cgee=result.config)
    """
    if not 0 < target_error < 1:
        raise ValueError(f"target_error must be in (0, 1), got {target_error}")
    if bound not in ("wilson", "empirical"):
        raise ValueError(f"bound must be 'wilson' or 'empirical', got {bound!r}")
    if not check_cost >= 0:
        raise ValueError(f"check_cost must be >= 0, got {check_cost}")
    recs = [r if isinstance(r, CalibrationRecord) else CalibrationRecord(*r) for r in records]
    recs = [r for r in recs if r.summary.winner is not None]
    if not recs:
        raise ValueError("calibrate needs at least one record with a candidate answer")
    base = base or CGEEConfig()
    n = len(recs)

    # Level 1: which questions each grid point skips, and whether the winner then differs from full.
    skip_configs = [replace(base, skip_enabled=False)] + [
        replace(base, skip_enabled=True, tau_conf=t, margin=m) for t in tau_grid for m in margin_grid]
    skips = torch.tensor([[should_skip(r.summary, c)[0] for r in recs] for c in skip_configs])  # (S, N)
    winner_wrong = torch.tensor([float(r.summary.winner != r.full_answer) for r in recs])  # (N,)

    # Level 2: per exit option, each question's decision error and work saved when verified.
    exit_options = _exit_options(recs, base, theta_grid, epsilon_grid, min_layer_grid, check_cost)
    exit_configs = [c for c, _, _, _ in exit_options]
    exit_wrong = torch.stack([w for _, w, _, _ in exit_options])  # (E, N)
    exit_saved = torch.stack([s for _, _, s, _ in exit_options])  # (E, N)

    not_skipped = (~skips).float()
    errors = (skips.float() @ winner_wrong)[:, None] + not_skipped @ exit_wrong.T  # (S, E)
    saved = skips.float().sum(1)[:, None] + not_skipped @ exit_saved.T  # (S, E)
    best: tuple | None = None
    for si, skip_config in enumerate(skip_configs):
        for ei, exit_config in enumerate(exit_configs):
            num_errors = int(errors[si, ei].round())
            upper = wilson_interval(num_errors, n)[1] if bound == "wilson" else num_errors / n
            if upper > target_error:
                continue
            key = (round(float(saved[si, ei]) / n, 9), skip_config.tau_conf if skip_config.skip_enabled else 2.0,
                   skip_config.margin, not exit_config.exit_enabled, exit_config.min_layer,
                   -exit_config.theta, -exit_config.epsilon)
            if best is None or key > best[0]:
                best = (key, si, ei, num_errors, upper)
    if best is None:
        return Calibration(replace(base, skip_enabled=False, exit_enabled=False), 0.0, 0.0, 0.0, n)
    _, si, ei, num_errors, upper = best
    exit_config = exit_configs[ei]
    config = replace(skip_configs[si], exit_enabled=exit_config.exit_enabled, theta=exit_config.theta,
                     epsilon=exit_config.epsilon, min_layer=exit_config.min_layer)
    verified = ~skips[si]
    mean_exit = None
    if config.exit_enabled and bool(verified.any()):
        mean_exit = float(exit_options[ei][3][verified].float().mean())
    return Calibration(config, float(skips[si].float().mean()), num_errors / n, upper, n,
                       float(saved[si, ei]) / n, mean_exit)


def _exit_options(recs: list[CalibrationRecord], base: CGEEConfig, theta_grid: Sequence[float],
                  epsilon_grid: Sequence[float], min_layer_grid: Sequence[int] | None, check_cost: float
                  ) -> list[tuple[CGEEConfig, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(config, wrong (N,), saved (N,), exit_layer (N,))`` for level 2 off and each grid point."""
    n = len(recs)
    off = replace(base, exit_enabled=False)
    lens = [r.lens_logits for r in recs]
    if any(x is None for x in lens):
        return [(off, torch.zeros(n), torch.zeros(n), torch.full((n,), -1))]
    num_layers = lens[0].shape[0]
    for r, x in zip(recs, lens):
        if x.shape != (num_layers, len(r.summary.shares), 2):
            raise ValueError(f"lens_logits must be (num_layers={num_layers}, num_candidates="
                             f"{len(r.summary.shares)}, 2), got {tuple(x.shape)}")
    options = [(off, torch.zeros(n), torch.zeros(n), torch.full((n,), num_layers - 1))]
    if num_layers < 3:
        return options
    entropy = [lens_entropy(x) for x in lens]  # each (L, B)
    # The worst row decides for the batch: max entropy and max move over candidates, per layer.
    top = torch.stack([e.max(-1).values for e in entropy])  # (N, L)
    moved = torch.stack([torch.cat([torch.full((1,), math.inf), (e[1:] - e[:-1]).abs().max(-1).values])
                         for e in entropy])  # (N, L)
    # Decision error if the pass exits at each layer; the last layer is the full pass itself.
    wrong_at = torch.tensor([[float(pick_answer(r.summary, x[layer].float().softmax(-1)[:, 0].tolist())
                                    != r.full_answer) if layer < num_layers - 1 else 0.0
                              for layer in range(num_layers)] for r, x in zip(recs, lens)])  # (N, L)
    layer_index = torch.arange(num_layers)
    rows = torch.arange(n)
    grid = range(0, num_layers - 2, 2) if min_layer_grid is None else min_layer_grid
    for theta in theta_grid:
        for epsilon in epsilon_grid:
            for min_layer in grid:
                config = replace(base, exit_enabled=True, theta=theta, epsilon=epsilon, min_layer=min_layer)
                # One row per question (its worst candidate, above), so the rule's every-row test is the worst row's.
                hit = exits_after_layer(layer_index, num_layers, top[..., None], moved[..., None], config)  # (N, L)
                exit_layer = torch.where(hit.any(1), hit.int().argmax(1), torch.tensor(num_layers - 1))  # (N,)
                checks = (torch.minimum(exit_layer, torch.tensor(num_layers - 2)) - min_layer + 1).clamp(min=0)
                saved = (num_layers - 1 - exit_layer - check_cost * checks) / num_layers
                options.append((config, wrong_at[rows, exit_layer], saved.float(), exit_layer))
    return options


# -- calibration for accuracy: no loss against always verifying, most verifier time saved ----------
ACCURACY_RULES = ("wilson", "observed")
TAU_GRID = tuple(i / 20 for i in range(21))
MARGIN_GRID = tuple(i / 20 for i in range(21))


@dataclass(frozen=True)
class QuestionOutcome:
    """One question's vote, the answer verifying every candidate picked, and the right answer.

    Answers compare as strings (the extractors normalise them). Serialises to the same ``shares`` and
    ``full_answer`` keys as ``CalibrationRecord``, so one saved record can feed both calibrations.

    Attributes:
        summary: The vote's confidence-weighted shares (``summarise_votes``).
        full_answer: The answer full-depth verification of every candidate picked; None without a candidate.
        gold: The right answer.
        verify_s: Measured seconds of that verification (0 when there was nothing to verify); a level-1
            skip saves all of it.
        level: Optional group, e.g. the difficulty level; ``split_outcomes`` stratifies by it.
    """

    summary: VoteSummary
    full_answer: str | None
    gold: str
    verify_s: float = 0.0
    level: int | None = None

    def answer(self, config: CGEEConfig) -> tuple[str | None, bool]:
        """``(answer, skipped)`` under ``config``'s level 1, verifying at full depth when not skipped."""
        if should_skip(self.summary, config)[0]:
            return self.summary.winner, True
        return self.full_answer, False

    def to_dict(self) -> dict:
        return {"shares": [list(s) for s in self.summary.shares], "full_answer": self.full_answer, "gold": self.gold,
                "verify_s": self.verify_s, "level": self.level}

    @classmethod
    def from_dict(cls, data: dict) -> QuestionOutcome:
        return cls(VoteSummary(tuple((str(a), float(p)) for a, p in data["shares"])), data["full_answer"],
                   str(data["gold"]), float(data.get("verify_s", 0.0)), data.get("level"))


@dataclass(frozen=True)
class OutcomeSummary:
    """What one CGEE config did on a set of questions, against the vote alone and always verifying.

    A *decision* is a question with at least one candidate (one verifier call when always verifying);
    a decision *error* is a skip whose vote winner is not the answer always verifying picked. Of those,
    ``num_lost`` turned a right answer wrong and ``num_gained`` a wrong one right, so
    ``num_cgee_correct = num_full_correct - num_lost + num_gained``.

    Attributes:
        num_questions / num_decisions / num_skipped: Questions, those with a candidate, those skipped.
        num_decision_errors / num_lost / num_gained: As above.
        num_vote_correct / num_full_correct / num_cgee_correct: Right answers of the vote winner, of
            always verifying and of CGEE.
        verify_s: Seconds always verifying took; verify_s_saved: the part the skips avoided.
    """

    num_questions: int
    num_decisions: int
    num_skipped: int
    num_decision_errors: int
    num_lost: int
    num_gained: int
    num_vote_correct: int
    num_full_correct: int
    num_cgee_correct: int
    verify_s: float
    verify_s_saved: float

    @property
    def skip_rate(self) -> float:
        return self.num_skipped / self.num_decisions if self.num_decisions else 0.0

    @property
    def decision_error_rate(self) -> float:
        return self.num_decision_errors / self.num_decisions if self.num_decisions else 0.0

    @property
    def decision_error_wilson(self) -> tuple[float, float]:
        return wilson_interval(self.num_decision_errors, self.num_decisions)

    @property
    def vote_accuracy(self) -> float:
        return self.num_vote_correct / self.num_questions if self.num_questions else 0.0

    @property
    def full_accuracy(self) -> float:
        return self.num_full_correct / self.num_questions if self.num_questions else 0.0

    @property
    def cgee_accuracy(self) -> float:
        return self.num_cgee_correct / self.num_questions if self.num_questions else 0.0

    @property
    def cgee_accuracy_wilson(self) -> tuple[float, float]:
        return wilson_interval(self.num_cgee_correct, self.num_questions)

    @property
    def verify_saved_fraction(self) -> float:
        return self.verify_s_saved / self.verify_s if self.verify_s > 0 else 0.0

    def keeps_accuracy(self, rule: str = "wilson") -> bool:
        """Whether CGEE lost no accuracy against always verifying, by ``rule``:

        * ``"wilson"``: always verifying's accuracy is not above the upper end of the Wilson 95%
          interval of CGEE's accuracy (it lies inside that interval, or CGEE is more accurate);
        * ``"observed"``: CGEE answered at least as many questions right.
        """
        if rule == "wilson":
            return self.full_accuracy <= self.cgee_accuracy_wilson[1]
        if rule == "observed":
            return self.num_cgee_correct >= self.num_full_correct
        raise ValueError(f"rule must be one of {list(ACCURACY_RULES)}, got {rule!r}")


def summarise_outcomes(outcomes: Sequence[QuestionOutcome], config: CGEEConfig) -> OutcomeSummary:
    """Replay ``config``'s level 1 on recorded questions (no model runs): skips, decision errors,
    accuracy of the vote, of always verifying and of CGEE, and the verifier seconds saved."""
    counts = dict.fromkeys(("decisions", "skipped", "errors", "lost", "gained", "vote", "full", "cgee"), 0)
    verify_s = saved_s = 0.0
    for o in outcomes:
        answer, skipped = o.answer(config)
        counts["decisions"] += o.summary.winner is not None
        counts["vote"] += o.summary.winner == o.gold
        counts["full"] += o.full_answer == o.gold
        counts["cgee"] += answer == o.gold
        verify_s += o.verify_s
        if skipped:
            counts["skipped"] += 1
            saved_s += o.verify_s
            if answer != o.full_answer:
                counts["errors"] += 1
                counts["lost"] += o.full_answer == o.gold
                counts["gained"] += answer == o.gold
    return OutcomeSummary(len(outcomes), counts["decisions"], counts["skipped"], counts["errors"], counts["lost"],
                          counts["gained"], counts["vote"], counts["full"], counts["cgee"], verify_s, saved_s)


def _check_outcomes(outcomes: object) -> list[QuestionOutcome]:
    if isinstance(outcomes, (str, bytes, dict)) or not isinstance(outcomes, Sequence):
        raise TypeError(f"outcomes must be a list of QuestionOutcome, got {type(outcomes).__name__}")
    bad = [i for i, o in enumerate(outcomes) if not isinstance(o, QuestionOutcome)]
    if bad:
        raise TypeError(f"outcomes must be a list of QuestionOutcome; outcomes[{bad[0]}] is a "
                        f"{type(outcomes[bad[0]]).__name__}")
    if not outcomes:
        raise ValueError("outcomes must not be empty")
    return list(outcomes)


def calibrate_accuracy(
    outcomes: Sequence[QuestionOutcome],
    rule: str = "wilson",
    *,
    base: CGEEConfig | None = None,
    tau_grid: Sequence[float] = TAU_GRID,
    margin_grid: Sequence[float] = MARGIN_GRID,
) -> tuple[CGEEConfig, OutcomeSummary]:
    """Level-1 thresholds that lose no accuracy against always verifying and save the most verifier time.

    Every ``(tau_conf, margin)`` on the grids, and skipping off, is replayed on ``outcomes``; those
    that keep accuracy by ``rule`` (``OutcomeSummary.keeps_accuracy``) are candidates, and the one
    whose skips avoid the most measured verifier seconds wins; ties go to fewer decision errors, then
    to the stricter thresholds, and skipping off wins when nothing is saved (so without measured
    ``verify_s`` skipping stays off). Skipping off always qualifies: it *is* always verifying.

    The winner is the best of many tries on the same questions, so its accuracy there is optimistic,
    and under ``"wilson"`` it tends to sit near the edge of the allowed loss: judge it on questions it
    was not chosen on (``calibrate_split``). Level-2 settings are copied from ``base`` unchanged.

    Returns:
        ``(config, summary)``: the thresholds and what they did on ``outcomes``.
    """
    outcomes = _check_outcomes(outcomes)
    if rule not in ACCURACY_RULES:
        raise ValueError(f"rule must be one of {list(ACCURACY_RULES)}, got {rule!r}")
    base = base or CGEEConfig()
    configs = [replace(base, skip_enabled=False)] + [
        replace(base, skip_enabled=True, tau_conf=t, margin=m) for t in tau_grid for m in margin_grid]
    best: tuple | None = None
    for config in configs:
        summary = summarise_outcomes(outcomes, config)
        if not summary.keeps_accuracy(rule):
            continue
        strict = (config.tau_conf, config.margin) if config.skip_enabled else (2.0, 2.0)
        key = (round(summary.verify_s_saved, 9), -summary.num_decision_errors, *strict)
        if best is None or key > best[0]:
            best = (key, config, summary)
    assert best is not None, "skipping off keeps accuracy by construction"
    return best[1], best[2]


def split_outcomes(outcomes: Sequence[QuestionOutcome], seed: int = 0) -> tuple[list[int], list[int]]:
    """``(calibration, held_out)`` indices: a seeded half of each level (group) each, disjoint,
    together every index. A level with an odd count gives its extra question to calibration."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    rng = random.Random(seed)
    groups: dict[int | None, list[int]] = {}
    for i, o in enumerate(outcomes):
        groups.setdefault(o.level, []).append(i)
    calibration, held_out = [], []
    for level in sorted(groups, key=lambda x: (x is None, x if x is not None else 0)):
        indices = groups[level]
        rng.shuffle(indices)
        half = (len(indices) + 1) // 2
        calibration += indices[:half]
        held_out += indices[half:]
    return sorted(calibration), sorted(held_out)


@dataclass(frozen=True)
class SplitCalibration:
    """Thresholds chosen on one half of the questions and judged on the other (``calibrate_split``).

    Attributes:
        config: The chosen thresholds (level 1; level 2 as in ``base``).
        rule: The accuracy rule they were held to (``OutcomeSummary.keeps_accuracy``).
        seed: The split's seed.
        calibration_indices / held_out_indices: Which outcomes fell in each half.
        calibration: What ``config`` did on the calibration half (optimistic: it was chosen there).
        held_out: What ``config`` did on the held-out half: skip rate, decision error against always
            verifying with its Wilson 95% interval, accuracy of the vote, of always verifying and of
            CGEE, verifier seconds saved.
        held_out_by_level: ``held_out`` per level.
    """

    config: CGEEConfig
    rule: str
    seed: int
    calibration_indices: tuple[int, ...]
    held_out_indices: tuple[int, ...]
    calibration: OutcomeSummary
    held_out: OutcomeSummary
    held_out_by_level: dict[int | None, OutcomeSummary]

    @property
    def keeps_accuracy_held_out(self) -> bool:
        """Whether the chosen thresholds also kept accuracy, by the same rule, on the held-out half."""
        return self.held_out.keeps_accuracy(self.rule)


def calibrate_split(
    outcomes: Sequence[QuestionOutcome],
    *,
    seed: int = 0,
    rule: str = "wilson",
    base: CGEEConfig | None = None,
    tau_grid: Sequence[float] = TAU_GRID,
    margin_grid: Sequence[float] = MARGIN_GRID,
) -> SplitCalibration:
    """Choose level-1 thresholds on a seeded half of ``outcomes`` (``calibrate_accuracy``) and report
    them on the other half, overall and per level.

    Example:
        >>> split = calibrate_split(outcomes, seed=0)
        >>> split.config.tau_conf, split.held_out.skip_rate, split.held_out.decision_error_wilson
    """
    outcomes = _check_outcomes(outcomes)
    calibration, held_out = split_outcomes(outcomes, seed)
    if not held_out:
        raise ValueError("outcomes must have at least two questions, one for each half")
    config, calibration_summary = calibrate_accuracy([outcomes[i] for i in calibration], rule, base=base,
                                                     tau_grid=tau_grid, margin_grid=margin_grid)
    held = [outcomes[i] for i in held_out]
    levels = sorted({o.level for o in held}, key=lambda x: (x is None, x if x is not None else 0))
    by_level = {level: summarise_outcomes([o for o in held if o.level == level], config) for level in levels}
    return SplitCalibration(config, rule, seed, tuple(calibration), tuple(held_out), calibration_summary,
                            summarise_outcomes(held, config), by_level)
