"""The scheduler on the real default model: requests of different lengths decoded together get the
tokens they get alone, greedy requests in a batch equal ``model.generate``, and concurrent requests
sharing a few-shot prefix read one copy of it from the prefix cache."""

from __future__ import annotations

import pytest
import torch

from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.evaluation.workloads import synthetic_problems
from rksc_engine.kvcache.suffix_pool import SUFFIX_ALIGNMENT
from rksc_engine.reasoning.few_shot import few_shot_messages

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine():
    return RKSCEngine.from_pretrained(progress=False)


def test_concurrent_requests_on_the_default_model_get_their_tokens_alone(engine):
    shots = synthetic_problems(3, seed=2)
    questions = [p.question for p in synthetic_problems(3, seed=9)]
    jobs = [
        (few_shot_messages(questions[0], shots), 4, SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=24, seed=1)),
        (few_shot_messages(questions[1], shots[:1]), 2, SamplingParams(temperature=0.7, max_new_tokens=16, seed=2)),
        ([{"role": "user", "content": "Name a colour."}], 1, SamplingParams(max_new_tokens=12)),
        ("The capital of France is", 1, SamplingParams(max_new_tokens=10)),
    ]
    alone = [[c.token_ids for c in engine.generate_branches(p, n, params)] for p, n, params in jobs]
    engine.clear_cache()
    engine.reset_stats()
    handles = [engine.submit(p, n, params) for p, n, params in jobs]
    together = [[c.token_ids for c in h.result()] for h in handles]
    assert together == alone, "a request's tokens changed when it shared its batch"
    assert engine.stats().peak_batch_rows >= 6
    # Greedy rows in that batch equal plain transformers.
    for (prompt, _, params), got in zip(jobs[2:], together[2:]):
        ids = torch.tensor([engine.encode(prompt)])
        with torch.no_grad():
            out = engine.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=params.max_new_tokens)
        want = tuple(out[0, ids.shape[1]:].tolist())
        assert got[0] == want[: len(got[0])] and (len(got[0]) == len(want) or got[0][-1] in engine.eos_token_ids)


def test_concurrent_requests_sharing_a_few_shot_prefix_hold_it_once(engine):
    shots = synthetic_problems(8, seed=3)
    prompts = [few_shot_messages(p.question, shots) for p in synthetic_problems(4, seed=11)]
    params = SamplingParams(temperature=0.7, max_new_tokens=8, seed=0)
    engine.clear_cache()
    engine.generate_branches(prompts[0], 2, params)  # the few-shot prefix is now cached
    engine.reset_stats()
    handles = [engine.submit(p, 4, params) for p in prompts]
    for handle in handles:
        handle.result()
    stats = engine.stats()
    prompt_bytes = len(engine.encode(prompts[0])) * engine.kv_bytes_per_token
    # The prefix cache holds the shared prefix once; running requests hold only their suffixes: the
    # suffix pool's slots, one aligned capacity for each of the 16 rows. Copies of the prompt would
    # be four prompts.
    assert stats.cache_peak_bytes < 2 * prompt_bytes
    suffix_bytes = 16 * SUFFIX_ALIGNMENT * engine.kv_bytes_per_token
    assert suffix_bytes < 4 * prompt_bytes
    assert stats.peak_running_kv_bytes <= suffix_bytes, "running requests copied their prompts"
