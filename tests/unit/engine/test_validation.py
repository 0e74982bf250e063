"""Bad input gets a clear error naming the parameter and range, and leaves the engine usable with
its cache intact."""

import threading

import pytest

from rksc_engine import EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.config import RSBCMConfig


@pytest.mark.parametrize(
    "kwargs,error,fragment",
    [
        ({"temperature": -0.1}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_k": -1}, ValueError, "top_k"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
        ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens"),
        ({"max_new_tokens": True}, TypeError, "max_new_tokens"),
        ({"temperature": "hot"}, TypeError, "temperature"),
        ({"stop": [1, 2]}, TypeError, "stop"),
        ({"stop": [""]}, ValueError, "stop"),
        ({"seed": -3}, ValueError, "seed"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        SamplingParams(**kwargs)


def test_a_single_stop_string_is_accepted_as_a_tuple():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)


def test_invalid_engine_config_names_the_field():
    with pytest.raises(ValueError, match="cache_budget_mb"):
        RSBCMConfig(cache_budget_mb=0)
    with pytest.raises(TypeError, match="prefix_cache"):
        EngineConfig(prefix_cache={"enabled": True})
    with pytest.raises(TypeError, match="rsbcm.enabled"):
        RSBCMConfig(enabled="no")


def test_the_deprecated_prefix_cache_switch_folds_into_the_one_cache_config():
    from rksc_engine import PrefixCacheConfig

    with pytest.warns(DeprecationWarning, match="rsbcm=RSBCMConfig"):
        config = EngineConfig(prefix_cache=PrefixCacheConfig(enabled=False), rsbcm=RSBCMConfig(cache_budget_mb=8))
    assert config.rsbcm == RSBCMConfig(cache_budget_mb=8, enabled=False) and config.prefix_cache is None
    assert EngineConfig().rsbcm.enabled


def _bad_calls(engine):
    long_prompt = "a" * (engine.context_window + 5)
    return [
        (lambda: engine.generate(""), ValueError, "prompt"),
        (lambda: engine.generate([]), ValueError, "prompt"),
        (lambda: engine.generate(None), TypeError, "prompt"),
        (lambda: engine.generate(12), TypeError, "prompt"),
        (lambda: engine.generate(long_prompt), ValueError, "context window"),
        (lambda: engine.generate_branches("ok", 0), ValueError, "n must be >= 1"),
        (lambda: engine.generate_branches("ok", 2.0), TypeError, "n must be an int"),
        (lambda: engine.generate("ok", {"temperature": 1}), TypeError, "params"),
        (lambda: engine.generate([{"role": "wizard", "content": "x"}]), ValueError, "role"),
        (lambda: engine.generate([{"role": "user", "content": 5}]), TypeError, "content"),
        (lambda: engine.generate([10**9]), ValueError, "token ids"),
        (lambda: engine.generate_many("not a list"), TypeError, "prompts"),
        (lambda: engine.generate_many(["fine", ""]), ValueError, "prompt"),
    ]


def test_bad_input_raises_and_leaves_engine_and_cache_intact(tiny_engine):
    params = SamplingParams(max_new_tokens=12)
    reference = tiny_engine.generate("a cached prompt", params)
    cache_bytes, cache_nodes = tiny_engine.prefix_cache.total_bytes, tiny_engine.prefix_cache.num_nodes()
    stats_before = tiny_engine.stats()
    for call, error, fragment in _bad_calls(tiny_engine):
        with pytest.raises(error, match=fragment):
            call()
    assert tiny_engine.prefix_cache.total_bytes == cache_bytes
    assert tiny_engine.prefix_cache.num_nodes() == cache_nodes
    assert tiny_engine.stats().prompt_tokens_computed == stats_before.prompt_tokens_computed
    again = tiny_engine.generate("a cached prompt", params)
    assert again.token_ids == reference.token_ids
    assert again.num_cached_tokens == len(tiny_engine.encode("a cached prompt")) - 1


def test_generation_stops_at_the_context_window(tiny_model, tiny_tokenizer):
    engine = RKSCEngine(tiny_model, tiny_tokenizer)
    prompt = "z" * (engine.context_window - 3)
    c = engine.generate(prompt, SamplingParams(max_new_tokens=50))
    assert len(c.token_ids) <= 3
    assert c.finish_reason in ("length", "eos")


@pytest.mark.slow
def test_concurrent_calls_match_serial_calls(tiny_model, tiny_tokenizer):
    prompts = [f"thread prompt {i} " + "shared words " * (i % 3) for i in range(8)]
    params = [SamplingParams(max_new_tokens=16, temperature=0.8, seed=i) for i in range(8)]
    serial = [RKSCEngine(tiny_model, tiny_tokenizer).generate_branches(p, 2, s) for p, s in zip(prompts, params)]
    shared = RKSCEngine(tiny_model, tiny_tokenizer)
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def work(i):
        try:
            results[i] = shared.generate_branches(prompts[i], 2, params[i])
        except BaseException as exc:  # surface thread failures in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(8):
        assert [b.token_ids for b in results[i]] == [b.token_ids for b in serial[i]], f"cross-talk in call {i}"
