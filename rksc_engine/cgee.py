"""CGEE: confidence-gated early exit for the verifier.

Level 1 (skip): before verifying, the vote is summarised as confidence-weighted shares. Branch b
with answer a(b) and confidence c(b) (exp of its mean token logprob) contributes c(b) to a(b);
``p(a) = sum_{b: a(b)=a} c(b) / sum_b c(b)`` over branches that produced an answer. The winner's
confidence is ``p = p(winner)`` and its lead is ``p(winner) - p(runner-up)`` (the runner-up's share
is 0 when all branches agree). Verification is skipped when ``p >= tau_conf`` and
``lead >= margin`` — the stopping rule of Early-Stopping Self-Consistency, applied to the verifier.

Level 2 (layer exit): during a verifier pass, a forward hook on each decoder layer from
``min_layer`` on projects the scored position's hidden state through the final norm and only the
label tokens' rows of the LM head (a 2 x hidden product for Yes/No instead of the 49,152-row
vocabulary), and stops the pass once the label entropy is below ``theta`` and moved less than
``epsilon`` since the previous layer. The label logits of that layer are the score.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import _check_type


@dataclass(frozen=True)
class CGEEConfig:
    """Thresholds of both CGEE levels.

    Attributes:
        skip_enabled: Level 1, skip verification when the vote is confident. Default True.
        tau_conf: Smallest confidence-weighted winner share that may skip, in [0, 1]. Default 0.75.
        margin: Smallest lead over the runner-up that may skip, in [0, 1]. Default 0.5.
        exit_enabled: Level 2, stop verifier passes early on low label entropy. Default False until
            ``benchmarks/cgee.py`` has measured its decision error: on the default model the logit lens
            of middle layers is poorly calibrated (Yes/No probabilities near 0.99 at layer 20 where the
            full pass gives 0.35), the brittleness SimExit reports.
        theta: Label-entropy threshold in nats, > 0 (max for 2 labels is ln 2 = 0.693). Default 0.3.
        epsilon: Largest entropy change between consecutive layers that counts as stable, > 0. Default 0.05.
        min_layer: First layer (0-based) allowed to exit, >= 0. Default 8.
    """

    skip_enabled: bool = True
    tau_conf: float = 0.75
    margin: float = 0.5
    exit_enabled: bool = False
    theta: float = 0.3
    epsilon: float = 0.05
    min_layer: int = 8

    def __post_init__(self) -> None:
        for name in ("skip_enabled", "exit_enabled"):
            _check_type(f"cgee.{name}", getattr(self, name), bool)
        for name in ("tau_conf", "margin"):
            value = getattr(self, name)
            _check_type(f"cgee.{name}", value, (int, float))
            if not 0 <= value <= 1:
                raise ValueError(f"cgee.{name} must be in [0, 1], got {value}")
        for name in ("theta", "epsilon"):
            value = getattr(self, name)
            _check_type(f"cgee.{name}", value, (int, float))
            if not value > 0:
                raise ValueError(f"cgee.{name} must be > 0, got {value}")
        _check_type("cgee.min_layer", self.min_layer, int)
        if self.min_layer < 0:
            raise ValueError(f"cgee.min_layer must be >= 0, got {self.min_layer}")

    @classmethod
    def off(cls) -> CGEEConfig:
        """Both levels disabled: every candidate is verified at full depth."""
        return cls(skip_enabled=False, exit_enabled=False)


@dataclass(frozen=True)
class VoteSummary:
    """Confidence-weighted shares of each answer, best first."""

    shares: tuple[tuple[str, float], ...]

    @property
    def winner(self) -> str | None:
        return self.shares[0][0] if self.shares else None

    @property
    def p(self) -> float:
        return self.shares[0][1] if self.shares else 0.0

    @property
    def lead(self) -> float:
        if not self.shares:
            return 0.0
        return self.shares[0][1] - (self.shares[1][1] if len(self.shares) > 1 else 0.0)


def summarise_votes(answers: Sequence[str | None], confidences: Sequence[float]) -> VoteSummary:
    """Confidence-weighted answer shares (see the module docstring); ties keep first-seen order."""
    weights: dict[str, float] = {}
    for answer, confidence in zip(answers, confidences):
        if answer is not None:
            weights[answer] = weights.get(answer, 0.0) + max(confidence, 0.0)
    total = sum(weights.values())
    if total <= 0:  # all confidences zero: fall back to plain counts
        weights = {a: float(sum(1 for x in answers if x == a)) for a in weights}
        total = sum(weights.values())
    if not weights:
        return VoteSummary(())
    order = sorted(weights.items(), key=lambda kv: -kv[1])  # sorted() is stable: ties keep first-seen
    return VoteSummary(tuple((a, w / total) for a, w in order))


def should_skip(summary: VoteSummary, config: CGEEConfig) -> tuple[bool, str]:
    """Level 1 decision and its reason."""
    if not config.skip_enabled:
        return False, "skip disabled"
    if summary.winner is None:
        return False, "no branch produced an answer"
    if summary.p < config.tau_conf:
        return False, f"p={summary.p:.3f} < tau_conf={config.tau_conf}"
    if summary.lead < config.margin:
        return False, f"lead={summary.lead:.3f} < margin={config.margin}"
    return True, f"p={summary.p:.3f} >= tau_conf={config.tau_conf} and lead={summary.lead:.3f} >= margin={config.margin}"


def label_entropy(label_logits: torch.Tensor) -> float:
    """Entropy in nats of the softmax over label logits (1-D)."""
    logp = label_logits.float().log_softmax(-1)
    return float(-(logp.exp() * logp).sum())


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
class Calibration:
    """The thresholds ``calibrate`` picked and what they did on the held-out questions."""

    config: CGEEConfig
    skip_rate: float
    error_rate: float
    error_upper: float
    num_questions: int


def calibrate(
    records: Sequence[tuple[VoteSummary, str | None]],
    target_error: float = 0.01,
    *,
    base: CGEEConfig | None = None,
    tau_grid: Sequence[float] = tuple(i / 20 for i in range(8, 21)),
    margin_grid: Sequence[float] = tuple(i / 10 for i in range(0, 11)),
    bound: str = "wilson",
) -> Calibration:
    """Pick ``tau_conf`` and ``margin`` on held-out questions to meet a target decision error.

    Each record is a question's vote summary and the answer that full verification chose for it.
    A skip decides the vote winner, so it errs when that differs from the full decision. Among the
    grid points whose error (the Wilson 95% upper bound by default, as CALM bounds its exit risk;
    ``bound="empirical"`` uses the observed rate) is at most ``target_error``, the one that skips most
    wins (ties: the stricter thresholds). If none qualifies, skipping is turned off.
    """
    if not 0 < target_error < 1:
        raise ValueError(f"target_error must be in (0, 1), got {target_error}")
    if bound not in ("wilson", "empirical"):
        raise ValueError(f"bound must be 'wilson' or 'empirical', got {bound!r}")
    if not records:
        raise ValueError("calibrate needs at least one record")
    base = base or CGEEConfig()
    n = len(records)
    best: Calibration | None = None
    for tau in tau_grid:
        for margin in margin_grid:
            config = CGEEConfig(**{**base.__dict__, "skip_enabled": True, "tau_conf": tau, "margin": margin})
            skipped = [(s, full) for s, full in records if should_skip(s, config)[0]]
            errors = sum(s.winner != full for s, full in skipped)
            upper = wilson_interval(errors, n)[1] if bound == "wilson" else errors / n
            if upper > target_error:
                continue
            candidate = Calibration(config, len(skipped) / n, errors / n, upper, n)
            if best is None or (candidate.skip_rate, tau, margin) > (best.skip_rate, best.config.tau_conf, best.config.margin):
                best = candidate
    if best is None:
        return Calibration(CGEEConfig(**{**base.__dict__, "skip_enabled": False}), 0.0, 0.0, 0.0, n)
    return best
