"""CGEE: confidence-gated early exit for the verifier, the rules applied while reasoning.

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
``epsilon`` since the previous layer (``exits_after_layer``). The label logits of that layer are the
score.

Choosing the thresholds on held-out questions is offline work and lives in
``rksc_engine.evaluation.calibration``, which replays these rules (``exits_after_layer``, ``pick_answer``,
``should_skip``) on recorded questions; this module never imports it.

``CGEEConfig`` lives in ``rksc_engine.config`` beside the other settings (it is also
``EngineConfig.cgee``) and is re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import CGEEConfig

__all__ = [
    "CGEEConfig", "VoteSummary", "exit_check_layers", "exits_after_layer", "label_entropy", "lens_entropy",
    "lens_exit_layer", "pick_answer", "should_skip", "summarise_votes",
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


def exit_check_layers(num_layers: int, config: CGEEConfig) -> range:
    """The decoder layers after which level 2 reads the label lens of a ``num_layers``-layer pass:
    ``min_layer`` (which only sets the baseline) up to the one before the last (the last layer's
    output is the full pass); none when level 2 is off."""
    return range(config.min_layer, num_layers - 1) if config.exit_enabled else range(0)


def exits_after_layer(
    layer: int | torch.Tensor, num_layers: int, entropy: torch.Tensor, moved: torch.Tensor, config: CGEEConfig
) -> torch.Tensor:
    """Level 2's exit rule: whether a verifier pass stops after decoder layer ``layer``.

    This is the one copy of the rule: the verifier applies it online, layer by layer
    (``LLMJudgeVerifier``), and it is replayed offline on recorded lenses (``lens_exit_layer``,
    ``rksc_engine.evaluation.calibration.calibrate``). The pass stops when level 2 is on, ``layer`` is a checked
    layer other than the first (``exit_check_layers``; the first only sets the baseline), and every
    candidate row's label entropy is ``< theta`` and moved ``< epsilon`` since the previous layer.

    Args:
        layer: 0-based decoder layer, an int or a tensor of layers (broadcast against the rows' batch dims).
        num_layers: Decoder layers of the judge model.
        entropy: Label entropy in nats of each candidate row after ``layer``, ``(..., B)`` (``lens_entropy``).
        moved: Each row's absolute change of that entropy since the previous layer, ``(..., B)``.
        config: The thresholds (``exit_enabled``, ``min_layer``, ``theta``, ``epsilon``).

    Returns:
        A bool tensor of shape ``(...)``: stop here.
    """
    layer = torch.as_tensor(layer)
    checked = (layer > config.min_layer) & (layer < num_layers - 1) & config.exit_enabled
    return checked & (moved < config.epsilon).all(-1) & (entropy < config.theta).all(-1)


def lens_exit_layer(entropy: torch.Tensor, config: CGEEConfig) -> int:
    """The layer a verifier pass exits at, replayed on recorded label entropies ``(num_layers, B)``
    (``lens_entropy`` of ``PassTrace.lens_logits``): the first layer where ``exits_after_layer`` says
    stop, else the last layer, ``num_layers - 1``."""
    num_layers = entropy.shape[0]
    moved = torch.cat([torch.full_like(entropy[:1], math.inf), (entropy[1:] - entropy[:-1]).abs()])
    stops = exits_after_layer(torch.arange(num_layers, device=entropy.device), num_layers, entropy, moved, config)
    return int(stops.int().argmax()) if bool(stops.any()) else num_layers - 1


def lens_entropy(lens_logits: torch.Tensor) -> torch.Tensor:
    """Label entropy in nats ``(..., B)`` of label logits ``(..., B, 2)``, computed as the hooks do."""
    logp = lens_logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)
