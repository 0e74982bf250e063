"""RKSCLLM on the tiny seeded model: new text only, stops in every path, batching, streaming,
async that leaves the event loop free, per-call kwargs, metadata and errors."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("langchain_core")

from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from rksc_engine import SamplingParams  # noqa: E402
from rksc_integrations.langchain import CACHE_EVENT, RKSCLLM  # noqa: E402
from tests.conftest import loop_turns_while_engine_held  # noqa: E402

PROMPT = "The quick brown fox"


@pytest.fixture
def llm(engine):
    return RKSCLLM(engine=engine, max_tokens=16)


class Recorder(BaseCallbackHandler):
    def __init__(self):
        self.tokens, self.events = [], []

    def on_llm_new_token(self, token, **kwargs):
        self.tokens.append(token)

    def on_custom_event(self, name, data, **kwargs):
        self.events.append((name, data))


def greedy(engine, n=16, stop=()):
    return engine.generate(PROMPT, SamplingParams(max_new_tokens=n, stop=stop)).text


def test_invoke_returns_the_engines_new_text_without_the_prompt(llm, engine):
    text = llm.invoke(PROMPT)
    assert text == greedy(engine)
    assert not text.startswith(PROMPT)


def test_a_multi_token_stop_string_is_honoured_by_invoke_stream_batch_and_ainvoke(llm, engine):
    full = greedy(engine)
    stop = full[4:7]  # three characters, so three tokens with the character tokenizer
    expected = full[: full.find(stop)]
    assert llm.invoke(PROMPT, stop=[stop]) == expected
    assert "".join(llm.stream(PROMPT, stop=[stop])) == expected
    assert llm.batch([PROMPT, PROMPT], stop=[stop]) == [expected, expected]
    assert asyncio.run(llm.ainvoke(PROMPT, stop=[stop])) == expected
    assert RKSCLLM(engine=engine, max_tokens=16, stop=[stop]).invoke(PROMPT) == expected


def test_batch_prefills_a_shared_prefix_once(llm, engine):
    # A preamble long enough to be worth a forward of its own (a few shared tokens are computed
    # again inside one packed forward instead).
    preamble = "Context: " + PROMPT + " over the lazy dog, twice over. " * 3
    prompts = [preamble + " jumps", preamble + " runs"]
    engine.reset_stats()
    results = llm.batch(prompts)
    assert engine.stats().prompt_tokens_reused >= len(engine.encode(preamble)) - 1
    assert results == [engine.generate(p, SamplingParams(max_new_tokens=16)).text for p in prompts]


def test_stream_yields_tokens_as_they_come_and_reports_each_to_callbacks(llm):
    recorder = Recorder()
    chunks = list(llm.stream(PROMPT, config={"callbacks": [recorder]}))
    assert len(chunks) > 1
    assert "".join(chunks) == llm.invoke(PROMPT)
    assert [t for t in recorder.tokens if t] == [c for c in chunks if c]


def test_per_call_kwargs_override_fields_and_unknown_ones_raise(llm, engine):
    assert llm.invoke(PROMPT, max_tokens=4) == greedy(engine, 4)
    with pytest.raises(TypeError, match="unexpected keyword argument.*'beam_width'"):
        llm.invoke(PROMPT, beam_width=3)
    with pytest.raises(ValueError, match="temperature"):
        llm.invoke(PROMPT, temperature=-1.0)


def test_bad_constructor_values_and_unknown_fields_are_rejected(engine):
    with pytest.raises(ValidationError, match="temperature"):
        RKSCLLM(engine=engine, temperature=-0.5)
    with pytest.raises(ValidationError, match="top_kk"):
        RKSCLLM(engine=engine, top_kk=3)
    with pytest.raises(TypeError, match="engine must be an RKSCEngine"):
        RKSCLLM(engine="not an engine")


def test_with_n_every_branch_is_kept_as_its_own_generation(llm, engine):
    result = llm.generate([PROMPT], n=3, temperature=0.9, seed=5)
    branches = engine.generate_branches(PROMPT, 3, SamplingParams(max_new_tokens=16, temperature=0.9, seed=5))
    assert [g.text for g in result.generations[0]] == [b.text for b in branches]
    assert len({g.text for g in result.generations[0]}) > 1


def test_generation_info_and_the_custom_event_report_prompt_cache_reuse(llm):
    llm.invoke(PROMPT)
    recorder = Recorder()
    result = llm.generate([PROMPT], callbacks=[recorder])
    info = result.generations[0][0].generation_info
    assert info["num_cached_tokens"] == info["num_prompt_tokens"] - 1 > 0
    assert info["usage"]["input_token_details"]["cache_read"] == info["num_cached_tokens"]
    assert info["finish_reason"] in ("length", "eos")
    assert recorder.events == [(CACHE_EVENT, info["rksc_cache_reuse"])]


@pytest.mark.slow
def test_ainvoke_and_astream_leave_the_event_loop_free(engine):
    llm = RKSCLLM(engine=engine, max_tokens=300)

    async def collect_stream():
        return "".join([c async for c in llm.astream(PROMPT)])

    async def main():
        text, free_during_invoke = await loop_turns_while_engine_held(engine, llm.ainvoke(PROMPT))
        streamed, free_during_stream = await loop_turns_while_engine_held(engine, collect_stream())
        return text, streamed, free_during_invoke, free_during_stream

    text, streamed, free_during_invoke, free_during_stream = asyncio.run(main())
    assert streamed == text
    assert free_during_invoke, "ainvoke blocked the event loop while it waited for the engine"
    assert free_during_stream, "astream blocked the event loop while it waited for the engine"


def test_a_prompt_that_is_not_a_string_is_a_clear_error(llm):
    with pytest.raises((TypeError, ValueError)):
        llm.invoke(12345)
    with pytest.raises(ValueError, match=r"prompts\[0\] must be a non-empty string"):
        llm.generate([""])
