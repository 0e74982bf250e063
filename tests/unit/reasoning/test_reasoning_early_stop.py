"""``reason`` with early stopping on a tiny seeded model: ``decided`` (the default) never changes the
vote's winner and saves decode tokens; ``None`` runs every branch to its end, as before; waves
(``adaptive``) draw the same branches a single launch would; the report says what was stopped."""

import asyncio

import pytest
from conftest import make_char_tokenizer, make_tiny_model

from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.reasoning.cgee import CGEEConfig
from rksc_engine.reasoning.early_stop import AdaptiveConfig, EarlyStopConfig

PARAMS = SamplingParams(max_new_tokens=24, temperature=1.0, seed=0, stop=("a", "o"))


def first_letter_parity(text: str) -> str | None:
    """Two answers, drawn from the first character: a vote that is often decided early."""
    return None if not text else ("odd" if ord(text[0]) % 2 else "even")


def sampled(seed: int) -> SamplingParams:
    # Stop strings end the branches at different lengths, as real answers do.
    return SamplingParams(max_new_tokens=24, temperature=1.0, seed=seed, stop=("a", "o"))


def make_engine():
    return RKSCEngine(make_tiny_model(0), make_char_tokenizer())


def run(engine, seed, early_stop, n=8):
    return engine.reason("q?", n=n, params=sampled(seed),
                         prompt="Q: pick\nA:", answer_extractor=first_letter_parity, verifier=None,
                         cgee=CGEEConfig.off(), early_stop=early_stop)


def test_decided_never_changes_the_vote_winner_and_saves_tokens():
    engine = make_engine()
    saved, stopped_questions = 0, 0
    for seed in range(0, 120, 10):
        full = run(engine, seed, None)
        early = run(engine, seed, "decided")
        assert early.vote_summary.winner == full.vote_summary.winner, f"seed {seed}: decided changed the winner"
        full_tokens = sum(len(c.token_ids) for c in full.completions)
        assert early.early_stop.decode_tokens <= full_tokens
        saved += full_tokens - early.early_stop.decode_tokens
        stopped_questions += early.early_stop.branches_cancelled > 0
        for c, f in zip(early.completions, full.completions):  # a branch is a prefix of its full self
            assert f.token_ids[:len(c.token_ids)] == c.token_ids
            assert (c.finish_reason == "cancelled") == (len(c.token_ids) < len(f.token_ids))
    assert stopped_questions > 0 and saved > 0, "decided never stopped anything on a two-answer vote"


def test_early_stop_none_runs_every_branch_and_reports_nothing():
    engine = make_engine()
    result = run(engine, 3, None)
    assert result.early_stop is None
    assert all(c.finish_reason != "cancelled" for c in result.completions)
    assert len(result.completions) == 8 and all(b.voted for b in result.branches)


def test_the_default_is_decided_and_the_report_names_the_rule():
    engine = make_engine()
    result = engine.reason("q?", n=8, params=PARAMS, prompt="Q: pick\nA:", answer_extractor=first_letter_parity,
                           verifier=None, cgee=CGEEConfig.off())
    report = result.early_stop
    assert report is not None and report.branches_launched == 8
    assert {rule for _, rule in report.stopped_by} <= {"decided"}
    cancelled = [c.branch_index for c in result.completions if c.finish_reason == "cancelled"]
    assert sorted(i for i, _ in report.stopped_by) == cancelled
    assert all(not b.voted and b.answer is None for b, c in zip(result.branches, result.completions)
               if c.finish_reason == "cancelled")


def test_adaptive_waves_draw_the_branches_a_single_launch_would():
    engine = make_engine()
    full = run(engine, 5, None)
    waves = run(engine, 5, EarlyStopConfig(decided=False, adaptive=AdaptiveConfig(wave_size=2, threshold=0.999)))
    launched = waves.early_stop.branches_launched
    assert 2 <= launched <= 8 and launched % 2 == 0
    assert [c.token_ids for c in waves.completions] == [c.token_ids for c in full.completions[:launched]]


def test_areason_stops_the_same_branches_as_reason():
    engine = make_engine()
    want = run(engine, 7, "decided")
    got = asyncio.run(engine.areason("q?", n=8, params=sampled(7),
                                     prompt="Q: pick\nA:", answer_extractor=first_letter_parity, verifier=None,
                                     cgee=CGEEConfig.off(), early_stop="decided"))
    assert [c.token_ids for c in got.completions] == [c.token_ids for c in want.completions]
    assert got.early_stop == want.early_stop


def test_a_bad_early_stop_is_refused_before_anything_runs():
    engine = make_engine()
    with pytest.raises(ValueError, match="early_stop"):
        run(engine, 0, "sometimes")
    with pytest.raises(TypeError, match="early_stop"):
        run(engine, 0, 3)
    assert engine.stats().requests == 0
