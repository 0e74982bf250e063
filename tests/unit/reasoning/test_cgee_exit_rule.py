"""CGEE level 2's exit rule has one copy, ``cgee.exits_after_layer``: the verifier applies it online
layer by layer, and ``cgee.lens_exit_layer`` and ``calibration.calibrate`` replay it offline on a
recorded lens. On the same per-layer decisions all of them stop at the same layer, and swapping the
rule moves every one of them."""

import math
from dataclasses import replace

import pytest
import torch
from conftest import make_char_tokenizer, make_tiny_model

from rksc_engine import RKSCEngine
from rksc_engine.evaluation import calibration
from rksc_engine.evaluation.calibration import CalibrationRecord, calibrate
from rksc_engine.reasoning import cgee, verifier
from rksc_engine.reasoning.cgee import (
    CGEEConfig,
    VoteSummary,
    exit_check_layers,
    exits_after_layer,
    lens_entropy,
    lens_exit_layer,
)
from rksc_engine.reasoning.verifier import LLMJudgeVerifier

NUM_LAYERS = 8
QUESTION = "Tom has 3 apples and buys 4 more. How many?"
CANDIDATES = ["7", "8", "12"]


def walked_exit_layer(entropy: torch.Tensor, config: CGEEConfig) -> int:
    """The rule asked layer by layer, as the verifier's hooks ask it: the checked layers in order,
    each with its rows' move since the previous checked layer (none before the baseline)."""
    num_layers = entropy.shape[0]
    previous = None
    for layer in exit_check_layers(num_layers, config):
        moved = torch.full_like(entropy[layer], math.inf) if previous is None else (entropy[layer] - previous).abs()
        if bool(exits_after_layer(layer, num_layers, entropy[layer], moved, config)):
            return layer
        previous = entropy[layer]
    return num_layers - 1


def calibrated_exit_layer(lens_logits: torch.Tensor, config: CGEEConfig) -> int:
    """The exit layer ``calibrate`` credits one recorded question with under ``config``'s level 2.

    Every candidate names the same answer, so an exit at any layer picks the full pass's answer and
    calibration turns level 2 on exactly when the exit saves a layer (else the pass is full depth)."""
    num_layers, num_candidates = lens_logits.shape[:2]
    same = VoteSummary(tuple(("a", 1 / num_candidates) for _ in range(num_candidates)))
    result = calibrate([CalibrationRecord(same, "a", lens_logits)], target_error=0.5,
                       base=replace(config, skip_enabled=False), tau_grid=(), margin_grid=(),
                       theta_grid=(config.theta,), epsilon_grid=(config.epsilon,),
                       min_layer_grid=(config.min_layer,), bound="empirical")
    if not result.config.exit_enabled:
        return num_layers - 1
    return int(result.mean_exit_layer)


def settling_lens(seed: int, num_layers: int = 10, num_candidates: int = 3) -> torch.Tensor:
    """``(num_layers, num_candidates, 2)`` label logits that drift less and grow surer layer by layer."""
    generator = torch.Generator().manual_seed(seed)
    steps = torch.randn(num_layers, num_candidates, 2, generator=generator)
    steps *= torch.linspace(2.0, 0.05, num_layers)[:, None, None]
    return steps.cumsum(0) * torch.linspace(0.5, 3.0, num_layers)[:, None, None]


def thresholds(entropy: torch.Tensor) -> list[float]:
    """Thetas between the batch's worst-row entropies, so each one exits somewhere else."""
    worst = sorted(set(float(x) for x in entropy.max(-1).values))
    return [(a + b) / 2 for a, b in zip(worst, worst[1:])] + [worst[-1] + 1.0]


def test_the_offline_replays_ask_the_rule_layer_by_layer_as_the_verifier_does():
    reached = set()
    for seed in range(12):
        lens = settling_lens(seed)
        entropy = lens_entropy(lens)
        for theta in thresholds(entropy)[::2]:
            for epsilon in (0.01, 0.1, 1.0):
                for min_layer in (0, 2, 5):
                    config = CGEEConfig(exit_enabled=True, theta=theta, epsilon=epsilon, min_layer=min_layer)
                    want = walked_exit_layer(entropy, config)
                    assert lens_exit_layer(entropy, config) == want, f"lens_exit_layer differs for {config}"
                    assert calibrated_exit_layer(lens, config) == want, f"calibrate differs for {config}"
                    reached.add(want)
    assert len(reached) >= 4, f"test setup: too few distinct exit layers {sorted(reached)}"
    off = CGEEConfig(exit_enabled=False, theta=1.0, epsilon=1.0, min_layer=0)
    assert lens_exit_layer(lens_entropy(settling_lens(0)), off) == walked_exit_layer(lens_entropy(settling_lens(0)), off) == 9


@pytest.fixture(scope="module")
def judged():
    """A tiny engine and the lens of one full-depth pass over ``CANDIDATES``."""
    engine = RKSCEngine(make_tiny_model(1, num_layers=NUM_LAYERS), make_char_tokenizer())
    _, trace = LLMJudgeVerifier(engine, record_lens=True).score_with_trace(QUESTION, CANDIDATES, CGEEConfig.off())
    assert trace.lens_logits.shape == (NUM_LAYERS, len(CANDIDATES), 2)
    return engine, trace.lens_logits


@pytest.mark.slow
def test_the_verifier_online_and_the_offline_replays_stop_at_the_same_layer(judged):
    engine, lens = judged
    entropy = lens_entropy(lens)
    online = LLMJudgeVerifier(engine)
    reached = set()
    for theta in thresholds(entropy):
        for epsilon in (0.01, 1.0):
            for min_layer in (1, 3):
                config = CGEEConfig(exit_enabled=True, theta=theta, epsilon=epsilon, min_layer=min_layer)
                layers = {s.exit_layer for s in online.score(QUESTION, CANDIDATES, config)}
                want = walked_exit_layer(entropy, config)
                assert layers == {want}, f"the verifier stopped at {layers}, the rule says {want} for {config}"
                assert lens_exit_layer(entropy, config) == calibrated_exit_layer(lens, config) == want
                reached.add(want)
    assert len(reached) >= 3, f"test setup: too few distinct exit layers {sorted(reached)}"


def test_a_different_rule_moves_the_online_and_the_offline_exit_together(judged, monkeypatch):
    engine, lens = judged
    config = CGEEConfig(exit_enabled=True, theta=1e-9, epsilon=1e-9, min_layer=2)  # the real rule never exits
    assert walked_exit_layer(lens_entropy(lens), config) == NUM_LAYERS - 1

    def at_the_baseline(layer, num_layers, entropy, moved, config):
        """Stop at ``min_layer`` itself, where the real rule only sets its baseline."""
        rows = torch.ones(entropy.shape[:-1], dtype=torch.bool, device=entropy.device)
        return (torch.as_tensor(layer) == config.min_layer) & rows

    for module in (cgee, verifier, calibration):
        monkeypatch.setattr(module, "exits_after_layer", at_the_baseline)
    online = {s.exit_layer for s in LLMJudgeVerifier(engine).score(QUESTION, CANDIDATES, config)}
    assert online == {2}, "the verifier does not ask cgee.exits_after_layer"
    assert lens_exit_layer(lens_entropy(lens), config) == 2, "lens_exit_layer does not ask cgee.exits_after_layer"
    assert calibrated_exit_layer(lens, config) == 2, "calibrate does not ask cgee.exits_after_layer"
