"""``benchmarks/early_stop.py`` replays recorded full-``n`` branches through the early-stop monitor
(``rksc_bench.early_stop_replay``) instead of generating again. That is only worth its tables if the
replay is exact: for every rule, it must reach the same winner, decode the same tokens and launch
and cancel the same branches as a live ``reason`` call with that rule on the same seeds."""

from __future__ import annotations

import pytest
from conftest import make_char_tokenizer, make_tiny_model

from rksc_bench import early_stop_replay
from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.reasoning.cgee import CGEEConfig
from rksc_engine.reasoning.early_stop import (
    AdaptiveConfig,
    AnsweredConfig,
    ConfidenceConfig,
    EarlyStopConfig,
    LengthConfig,
)

N = 8


def parity(text: str) -> str | None:
    return None if not text else ("odd" if ord(text[0]) % 2 else "even")


RULES = {
    "decided": EarlyStopConfig(),
    "answered": EarlyStopConfig(answered=AnsweredConfig(pattern=r"[0-9]")),
    "confidence": EarlyStopConfig(confidence=ConfidenceConfig(window_tokens=4, warmup_branches=3, percentile=30.0)),
    "adaptive": EarlyStopConfig(adaptive=AdaptiveConfig(wave_size=3, threshold=0.8)),
    "adaptive esc": EarlyStopConfig(decided=False, adaptive=AdaptiveConfig(wave_size=2, method="esc")),
    "length": EarlyStopConfig(length=LengthConfig(finished_fraction=0.25, factor=1.5)),
}


@pytest.mark.parametrize("seed", [0, pytest.param(40, marks=pytest.mark.slow), 90])
def test_a_replayed_rule_matches_the_live_run_on_the_same_seeds(seed):
    bench = early_stop_replay
    engine = RKSCEngine(make_tiny_model(0), make_char_tokenizer())
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=seed, stop=("a", "o"))
    kwargs = dict(n=N, params=params, prompt="Q: pick\nA:", answer_extractor=parity, verifier=None,
                  cgee=CGEEConfig.off())
    full = engine.reason("q?", early_stop=None, **kwargs)
    record = {"max_new_tokens": params.max_new_tokens, "stop": list(params.stop),
              "branches": [{"tokens": list(c.token_ids), "logprobs": list(c.logprobs), "finish": c.finish_reason,
                            "text": c.text} for c in full.completions]}
    texts = bench.BranchTexts(engine.tokenizer, record["branches"], record["stop"])
    off = bench.replay_question(record, N, None, texts, parity)
    assert off.winner == full.vote_summary.winner
    for label, config in RULES.items():
        live = engine.reason("q?", early_stop=config, **kwargs)
        replayed = bench.replay_question(record, N, config, texts, parity)
        report = live.early_stop
        assert replayed.winner == live.vote_summary.winner, f"{label}: another winner"
        assert replayed.decode_tokens == report.decode_tokens == sum(len(c.token_ids) for c in live.completions), label
        assert (replayed.launched, replayed.cancelled) == (report.branches_launched,
                                                           sum(c.finish_reason == "cancelled" for c in live.completions)), label
