"""The shared-prefix decode path on the real default model: the probe accepts it, and sampled
branches equal the old DynamicCache path's token for token in float32."""

import pytest

from rksc_engine import EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.evaluation.workloads import synthetic_problems
from rksc_engine.reasoning.few_shot import few_shot_messages

pytestmark = pytest.mark.integration


def test_default_model_branches_through_the_shared_prefix_equal_the_old_path():
    new = RKSCEngine.from_pretrained(progress=False)
    old = RKSCEngine(new.model, new.tokenizer, EngineConfig(decode_attention="dynamic_cache"))
    ids = new.encode(few_shot_messages(synthetic_problems(1, seed=4)[0].question, synthetic_problems(2, seed=2)))
    params = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.95, seed=1)
    got = new.generate_branches(ids, 6, params)
    assert new.runner.shared_prefix_probe.supported, new.runner.shared_prefix_probe.reason
    want = old.generate_branches(ids, 6, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert len({g.token_ids for g in got}) > 1, "sampled branches should differ"
