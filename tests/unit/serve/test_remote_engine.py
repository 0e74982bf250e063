"""``RemoteEngine`` against a real ``rksc serve`` app (uvicorn on a loopback port) over the tiny
model: the same answers as the in-process engine, streaming, stats from usage, cancellation on the
server, and a wrong key. The transport's other faults are in ``test_remote_faults.py``."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from rksc_engine import RemoteEngine, RequestCancelled, SamplingParams  # noqa: E402
from rksc_serve.app import create_app  # noqa: E402
from tests.conftest import serving, wait_until  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def base_url(engine):
    with serving(create_app(engine, max_tokens_limit=4096)) as url:
        yield f"{url}/v1"


@pytest.fixture
def remote(base_url):
    with RemoteEngine(base_url, model="rksc") as remote:
        yield remote


@pytest.mark.parametrize("prompt", ["Once upon a time", MESSAGES], ids=["text", "chat"])
def test_greedy_generate_is_the_in_process_engines_answer(engine, remote, prompt):
    params = SamplingParams(max_new_tokens=24)
    local = engine.generate(prompt, params)
    served = remote.generate(prompt, params)
    assert served.text == local.text
    assert served.finish_reason == local.finish_reason
    assert served.num_prompt_tokens == local.num_prompt_tokens
    assert served.token_ids == (), "a server sends no token ids"
    assert served.logprobs == pytest.approx(local.logprobs, abs=1e-4)
    assert served.confidence == pytest.approx(local.confidence, rel=1e-4)
    assert served.num_cached_tokens > 0, "the prompt was cached by the local run on the same engine"


def test_seeded_branches_are_the_local_engines_branches(engine, remote):
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=11)
    local = engine.generate_branches(MESSAGES, 3, params)
    served = remote.generate_branches(MESSAGES, 3, params)
    assert [c.text for c in served] == [c.text for c in local]
    assert [c.branch_index for c in served] == [0, 1, 2] and all(c.seed == 11 for c in served)


def test_a_stop_string_is_reported_as_stop_and_the_model_ending_as_eos(engine, remote):
    whole = engine.generate("Once upon a time", SamplingParams(max_new_tokens=20)).text
    params = SamplingParams(max_new_tokens=20, stop=(whole[5:7],))
    local = engine.generate("Once upon a time", params)
    served = remote.generate("Once upon a time", params)
    assert (served.text, served.finish_reason) == (local.text, local.finish_reason) == (local.text, "stop")


def test_stream_concatenates_to_generate_and_ends_with_the_completion(remote):
    params = SamplingParams(max_new_tokens=20)
    whole = remote.generate(MESSAGES, params)
    chunks = list(remote.stream(MESSAGES, params))
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[-1].completion is not None and chunks[-1].completion.text == whole.text
    assert all(c.completion is None for c in chunks[:-1])
    assert chunks[-1].completion.logprobs == pytest.approx(whole.logprobs, abs=1e-4)


def test_generate_many_and_the_async_forms_match_the_local_engine(engine, remote):
    prompts = ["Hello", "Goodbye", "Once upon a time"]
    params = SamplingParams(max_new_tokens=8)
    local = [engine.generate(p, params).text for p in prompts]
    assert [c.text for c in remote.generate_many(prompts, params)] == local

    async def run():
        single = await remote.agenerate(prompts[0], params)
        many = await remote.agenerate_many(prompts, params)
        branches = await remote.agenerate_branches(prompts[1], 2, params)
        streamed = "".join([chunk.text async for chunk in remote.astream(prompts[2], params)])
        return single.text, [c.text for c in many], [c.text for c in branches], streamed

    single, many, branches, streamed = asyncio.run(run())
    assert (single, many, branches, streamed) == (local[0], local, [local[1]] * 2, local[2])


def test_stats_come_from_the_servers_usage(remote):
    first = remote.generate("A prompt seen once", SamplingParams(max_new_tokens=5))
    second = remote.generate("A prompt seen once", SamplingParams(max_new_tokens=5))
    stats = remote.stats()
    assert stats.requests == 2 and stats.decode_tokens == 10
    assert stats.prompt_tokens_computed + stats.prompt_tokens_reused == first.num_prompt_tokens * 2
    assert stats.prompt_tokens_reused == first.num_cached_tokens + second.num_cached_tokens > 0
    remote.reset_stats()
    assert remote.stats().requests == 0


def test_closing_a_stream_cancels_the_request_on_the_server(engine, remote):
    before = engine.stats().decode_tokens
    stream = remote.stream(MESSAGES, SamplingParams(max_new_tokens=4000))
    next(stream)
    stream.close()
    assert wait_until(lambda: engine.stats().running_requests == 0), "the server kept decoding a closed stream"
    assert engine.stats().decode_tokens - before < 4000


def test_cancelling_a_call_that_is_not_streamed_cancels_the_request_on_the_server(engine, remote):
    before = engine.stats().decode_tokens
    handle = remote.submit(MESSAGES, 1, SamplingParams(max_new_tokens=4000))
    assert wait_until(lambda: engine.stats().running_requests == 1), "the request never started on the server"
    handle.cancel()
    with pytest.raises(RequestCancelled):
        handle.result()
    assert wait_until(lambda: engine.stats().running_requests == 0), "the server kept decoding a cancelled call"
    assert engine.stats().decode_tokens - before < 4000


def test_the_model_defaults_to_the_first_the_server_lists(engine, base_url):
    with RemoteEngine(base_url) as remote:
        assert remote.model_name == engine.model_name


# -- what a remote engine refuses ----------------------------------------------------------------
def test_token_ids_and_local_only_features_raise_clear_errors(remote):
    with pytest.raises(TypeError, match="takes text"):
        remote.generate([5, 6, 7])
    with pytest.raises(NotImplementedError, match="local RKSCEngine"):
        remote.submit("hi", logits_processor=lambda ids, logits: logits)
    with pytest.raises(TypeError, match="prompt must be text over a server"):
        remote.tree_search("What is 2 + 3?", prompt=MESSAGES)
    with pytest.raises(AttributeError, match="RSBCM"):
        _ = remote.config


def test_a_request_the_server_refuses_is_a_value_error_naming_the_field(remote):
    with pytest.raises(ValueError, match="max_tokens"):
        remote.generate("Hello", SamplingParams(max_new_tokens=5000))


# -- transport faults (the rest, against servers that misbehave on purpose: test_remote_faults.py) --
def test_a_wrong_api_key_is_a_permission_error(engine):
    with serving(create_app(engine, api_key="sekrit")) as url:
        with RemoteEngine(f"{url}/v1", model="m", api_key="wrong") as remote:
            with pytest.raises(PermissionError, match="401"):
                remote.generate("Hello", SamplingParams(max_new_tokens=2))
        with RemoteEngine(f"{url}/v1", model="m", api_key="sekrit") as remote:
            assert remote.generate("Hello", SamplingParams(max_new_tokens=2)).finish_reason in ("eos", "stop", "length")
