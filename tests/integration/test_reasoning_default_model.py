"""Verified self-consistency and CGEE on the real default model (SmolLM2-135M-Instruct, 30 layers)."""

import pytest
import torch

from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.evaluation.workloads import synthetic_problems
from rksc_engine.reasoning.cgee import CGEEConfig
from rksc_engine.reasoning.verifier import LLMJudgeVerifier

pytestmark = pytest.mark.integration

PROBLEM = synthetic_problems(1, seed=9)[0]
CANDIDATES = [PROBLEM.answer, str(int(PROBLEM.answer) + 10), "3"]


@pytest.fixture(scope="module")
def engine():
    return RKSCEngine.from_pretrained(progress=False)


def plain_scores(engine, judge, question, candidates):
    """One uncached, hook-free full forward per candidate; P(Yes) over the two label logits."""
    out = []
    with torch.inference_mode():
        for c in candidates:
            ids = torch.tensor([judge.prompt_ids(question, c)])
            out.append(engine.model(input_ids=ids).logits[0, -1, judge.label_ids].softmax(-1)[0].item())
    return out


def test_judging_with_cgee_off_equals_plain_full_depth_scoring_on_the_default_model(engine):
    engine.clear_cache()
    judge = LLMJudgeVerifier(engine)
    got = judge.score(PROBLEM.question, CANDIDATES, CGEEConfig.off())
    assert [s.score for s in got] == pytest.approx(plain_scores(engine, judge, PROBLEM.question, CANDIDATES), abs=1e-4)
    assert {s.exit_layer for s in got} == {len(engine.model.model.layers) - 1}


def test_a_forced_exit_on_the_default_model_runs_no_later_layer_and_leaves_no_hook(engine):
    layers = engine.model.model.layers
    calls = [0] * len(layers)
    handles = [layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
               for i, layer in enumerate(layers)]
    try:
        # theta and epsilon above any 2-label entropy (ln 2 nats): the first layer with a baseline exits.
        got = LLMJudgeVerifier(engine).score(
            PROBLEM.question, CANDIDATES, CGEEConfig(exit_enabled=True, theta=1.0, epsilon=1.0, min_layer=10)
        )
    finally:
        for h in handles:
            h.remove()
    assert {s.exit_layer for s in got} == {11}
    assert calls[:12] == [1] * 12 and calls[12:] == [0] * (len(layers) - 12)
    assert all(not layer._forward_hooks for layer in layers)
    assert engine.prefix_cache.evictable_bytes == engine.prefix_cache.total_bytes, "a cache node stayed locked"


def test_reason_on_the_default_model_returns_branches_votes_and_a_readable_report(engine):
    params = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=96, seed=0, stop=("<|im_end|>",))
    result = engine.reason(PROBLEM.question, n=4, params=params, few_shot=synthetic_problems(2, seed=1),
                           cgee=CGEEConfig.off())
    assert len(result.branches) == 4
    assert sum(result.votes.values()) == sum(b.answer is not None for b in result.branches)
    report = result.verification
    if result.votes:
        assert result.answer in result.votes
        assert not report.skipped and len(report.scores) == len(result.votes)
        assert "score=" in report.summary()


def test_the_recorded_lens_on_the_default_model_replays_the_online_exit_and_ends_at_the_full_scores(engine):
    from rksc_engine.reasoning.cgee import lens_entropy, lens_exit_layer

    recorder = LLMJudgeVerifier(engine, record_lens=True)
    full, trace = recorder.score_with_trace(PROBLEM.question, CANDIDATES, CGEEConfig.off())
    num_layers = len(engine.model.model.layers)
    assert trace.lens_logits.shape == (num_layers, len(CANDIDATES), 2)
    last = trace.lens_logits[-1].softmax(-1)[:, 0].tolist()
    assert last == pytest.approx([s.score for s in full], abs=1e-4), "the last layer's lens is not the full pass"
    entropy = lens_entropy(trace.lens_logits)
    # A theta just above the entropy the batch reaches at some middle layer, so the exit is mid-depth.
    theta = float(entropy[18].max()) + 1e-4
    config = CGEEConfig(exit_enabled=True, theta=theta, epsilon=1.0, min_layer=10)
    want = lens_exit_layer(entropy, config)
    got = LLMJudgeVerifier(engine).score(PROBLEM.question, CANDIDATES, config)
    assert {s.exit_layer for s in got} == {want} and want <= 18
    assert [s.score for s in got] == pytest.approx(trace.lens_logits[want].softmax(-1)[:, 0].tolist(), abs=1e-4)
