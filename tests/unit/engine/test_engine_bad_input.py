"""Bad input at the engine's door: each is a ``TypeError``/``ValueError`` naming the parameter, and
leaves the engine's counters and cache exactly as they were. Plus the engine's side of out-of-memory
recovery (budget floor and step-wise restore) and of the shared-prefix probe (an exception is not a
verdict)."""

import dataclasses

import pytest
import torch
from conftest import make_char_tokenizer, make_tiny_model

from rksc_engine import EngineConfig, RKSCEngine, RSBCMConfig, SamplingParams
from rksc_engine.config import MAX_SEED
from rksc_engine.kvcache.probe import ProbeResult


def make_engine(**config) -> RKSCEngine:
    return RKSCEngine(make_tiny_model(0), make_char_tokenizer(), EngineConfig(**config))


def snapshot(engine: RKSCEngine) -> dict:
    stats = dataclasses.asdict(engine.stats())
    return {"stats": stats, "nodes": engine.prefix_cache.num_nodes, "bytes": engine.prefix_cache.total_bytes}


@pytest.fixture
def warm_engine():
    engine = make_engine()
    engine.generate("warm the cache", SamplingParams(max_new_tokens=3))
    return engine


BAD_CALLS = [
    ("bytes prompt", lambda e: e.generate(b"hello"), TypeError, "decode bytes first"),
    ("bytearray prompt", lambda e: e.generate(bytearray(b"hello")), TypeError, "got bytearray"),
    ("lone surrogate", lambda e: e.generate("hi \ud800 there"), ValueError, r"prompt is not valid Unicode text"),
    ("surrogate in a message", lambda e: e.encode_chat([{"role": "user", "content": "a\udfffb"}]), ValueError,
     r"messages\[0\]\['content'\] is not valid Unicode"),
    ("seed + n past the generator's range", lambda e: e.generate_branches("hi", 4, SamplingParams(seed=MAX_SEED)),
     None, None),
    ("n too large for the cache", lambda e: e.generate_branches("hi", 10**5, SamplingParams(max_new_tokens=256)),
     ValueError, r"n=100000 branches .* more than the cache budget .* n can be at most"),
    ("n zero", lambda e: e.submit("hi", 0), ValueError, "n must be >= 1"),
    ("generate_many of bytes", lambda e: e.generate_many(b"ab"), TypeError, "prompts must be a list"),
]


@pytest.mark.parametrize("name,call,error,message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_refused_before_anything_changes(warm_engine, name, call, error, message):
    before = snapshot(warm_engine)
    if error is None:  # within range by construction: must simply work
        call(warm_engine)
        return
    with pytest.raises(error, match=message):
        call(warm_engine)
    assert snapshot(warm_engine) == before, f"{name}: the engine changed before refusing"


def test_seed_plus_branches_beyond_the_generator_range_is_refused_before_any_work(warm_engine):
    from rksc_engine.config import MAX_BRANCH_SEED

    before = snapshot(warm_engine)
    with pytest.raises(ValueError, match=r"seed \+ n - 1 must be <= "):
        warm_engine.submit("hi", MAX_BRANCH_SEED - MAX_SEED + 2, SamplingParams(seed=MAX_SEED, max_new_tokens=1))
    assert snapshot(warm_engine) == before


def test_extra_message_keys_and_an_assistant_only_history_are_accepted():
    engine = make_engine()
    engine.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    ids = engine.encode([{"role": "assistant", "content": "hello", "name": "bot", "id": "x1"}])
    assert engine.tokenizer.decode(ids).startswith("assistant: hello")


def test_an_oom_shrinks_the_budget_to_no_less_than_the_prompt_and_successes_restore_it_step_by_step():
    engine = make_engine(rsbcm=RSBCMConfig(cache_budget_mb=1.0, oom_backoff_s=0.0))
    configured = engine.prefix_cache.configured_budget_bytes
    prompt = "x" * 40
    original = engine.model.forward
    failures = {"left": 1}

    def flaky_forward(*args, **kwargs):
        if failures["left"]:
            failures["left"] -= 1
            raise torch.OutOfMemoryError("simulated")
        return original(*args, **kwargs)

    engine.model.forward = flaky_forward
    try:
        engine.generate(prompt, SamplingParams(max_new_tokens=2))
    finally:
        engine.model.forward = original
    stats = engine.stats()
    assert stats.oom_retries == 1
    shrunk = engine.prefix_cache.budget_bytes
    assert len(engine.encode(prompt)) * engine.kv_bytes_per_token <= shrunk < configured
    for _ in range(12):
        engine.generate("y", SamplingParams(max_new_tokens=1))
    assert engine.prefix_cache.budget_bytes == configured, "successful requests did not restore the budget"


def test_an_exception_in_the_shared_prefix_probe_is_retried_on_a_later_request(monkeypatch):
    import rksc_engine.runtime.model_runner as engine_module

    engine = make_engine()
    calls = {"n": 0}
    real_probe = engine_module.probe

    def flaky_probe(model, forward):
        calls["n"] += 1
        if calls["n"] == 1:
            return ProbeResult(False, "shared-prefix probe failed: RuntimeError: transient", inconclusive=True)
        return real_probe(model, forward)

    monkeypatch.setattr(engine_module, "probe", flaky_probe)
    want = engine.generate("hello", SamplingParams(max_new_tokens=6)).token_ids  # plain path this time
    assert engine.stats().extra["shared_prefix_probe_errors"] == 1
    assert engine.generate("hello", SamplingParams(max_new_tokens=6)).token_ids == want
    assert calls["n"] == 2 and engine.runner.shared_prefix_probe.supported, "the probe was not retried"


def test_a_logits_processor_failing_mid_decode_fails_its_request_only():
    engine = make_engine()
    params = SamplingParams(max_new_tokens=10)
    want = engine.generate("world", params).token_ids

    def fail_on_third_token(token_ids, logits):
        if len(token_ids[0]) >= 3:
            raise RuntimeError("processor failed late")
        return logits

    with engine.exclusive():  # queue both before either runs, so they share decode steps
        bad = engine.submit("hello", 1, params, logits_processor=fail_on_third_token)
        good = engine.submit("world", 1, params)
    with pytest.raises(RuntimeError, match="failed late"):
        bad.result(timeout=30)
    assert good.result(timeout=30)[0].token_ids == want
    engine.prefix_cache.check_consistency()
    assert engine.prefix_cache.locked_bytes == 0, "a radix node was left locked"
