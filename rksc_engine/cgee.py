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

Calibration (``calibrate``): on held-out questions, each recorded with its vote, the decision of
full-depth verification and the logit lens of every layer (``CalibrationRecord``), both levels'
thresholds are chosen so that the decision error against full verification stays within a target
(by default its Wilson 95% upper bound), saving the most verifier work among those that do, as CALM
calibrates its exits. The rules are replayed offline (``lens_exit_layer``, ``pick_answer``), so
calibration runs no model and can be repeated on saved records.

``CGEEConfig`` lives in ``rksc_engine.config`` beside the other settings (it is also
``EngineConfig.cgee``) and is re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .config import CGEEConfig

__all__ = [
    "CGEEConfig", "Calibration", "CalibrationRecord", "VoteSummary", "calibrate", "label_entropy",
    "lens_entropy", "lens_exit_layer", "pick_answer", "should_skip", "summarise_votes", "wilson_interval",
]


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


def pick_answer(summary: VoteSummary, scores: Sequence[float]) -> str | None:
    """The reasoner's picking rule once verification ran.

    ``scores[i]`` is the verifier's score of ``summary.shares[i]``'s answer. The candidate maximising
    ``share x score`` wins; ties go to the vote winner, then to the earlier candidate.
    """
    if not summary.shares:
        return None
    if len(scores) != len(summary.shares):
        raise ValueError(f"got {len(scores)} scores for {len(summary.shares)} candidates")
    best = max(range(len(scores)), key=lambda i: (summary.shares[i][1] * scores[i], i == 0))
    return summary.shares[best][0]


def lens_exit_layer(entropy: torch.Tensor, config: CGEEConfig) -> int:
    """The layer-2 exit rule applied offline to recorded label entropies ``(num_layers, B)``.

    Layers ``min_layer`` to ``num_layers - 2`` are checked; the first checked layer only sets the
    baseline. The pass exits at the first checked layer where every row's entropy is ``< theta`` and
    moved ``< epsilon`` since the previous layer; otherwise it runs to ``num_layers - 1``. This is the
    rule the verifier's hooks apply online (a test keeps the two in step).
    """
    num_layers = entropy.shape[0]
    if not config.exit_enabled:
        return num_layers - 1
    for layer in range(config.min_layer + 1, num_layers - 1):
        stable = bool(((entropy[layer] - entropy[layer - 1]).abs() < config.epsilon).all())
        if stable and bool((entropy[layer] < config.theta).all()):
            return layer
    return num_layers - 1


def lens_entropy(lens_logits: torch.Tensor) -> torch.Tensor:
    """Label entropy in nats ``(..., B)`` of label logits ``(..., B, 2)``, computed as the hooks do."""
    logp = lens_logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


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
    jointly with it by replaying the exit rule (``lens_exit_layer``) and the picking rule
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
            passes = (moved < epsilon) & (top < theta)  # (N, L)
            for min_layer in grid:
                config = replace(base, exit_enabled=True, theta=theta, epsilon=epsilon, min_layer=min_layer)
                allowed = (layer_index > min_layer) & (layer_index < num_layers - 1)
                hit = passes & allowed
                exit_layer = torch.where(hit.any(1), hit.int().argmax(1), torch.tensor(num_layers - 1))  # (N,)
                checks = (torch.minimum(exit_layer, torch.tensor(num_layers - 2)) - min_layer + 1).clamp(min=0)
                saved = (num_layers - 1 - exit_layer - check_cost * checks) / num_layers
                options.append((config, wrong_at[rows, exit_layer], saved.float(), exit_layer))
    return options
