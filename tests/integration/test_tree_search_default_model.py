"""Tree search on the real default model under a tight RSBCM budget: the same tree as unbounded,
never over budget, nothing left locked."""

import pytest

from rksc_engine import EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.config import RSBCMConfig
from rksc_engine.evaluation.workloads import synthetic_problems

pytestmark = pytest.mark.integration


def test_a_tight_budget_changes_neither_the_tree_nor_the_answer():
    base = RKSCEngine.from_pretrained(progress=False)
    question = synthetic_problems(1, seed=3)[0].question
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=8, seed=0)
    kwargs = {"breadth": 2, "depth": 3, "beam": 1, "params": params}
    unbounded = base.tree_search(question, **kwargs)
    peak = base.stats().cache_peak_bytes
    budget_mb = 0.4 * peak / 2**20
    for policy in ("omega", "lru"):
        engine = RKSCEngine(base.model, base.tokenizer,
                            EngineConfig(rsbcm=RSBCMConfig(cache_budget_mb=budget_mb, policy=policy)))
        result = engine.tree_search(question, **kwargs)
        assert [n.token_ids for n in result.nodes] == [n.token_ids for n in unbounded.nodes], policy
        assert result.answer == unbounded.answer
        stats = engine.stats()
        assert stats.cache_peak_bytes <= engine.prefix_cache.budget_bytes < peak
        assert stats.prompt_tokens_computed > base.stats().prompt_tokens_computed, "the budget should bite"
        engine.prefix_cache.check_consistency()
        assert engine.prefix_cache.evictable_bytes == engine.prefix_cache.total_bytes
