"""ChatRKSC on the tiny seeded model: rendering of every role, cache accounting, streaming, tool
calls decoded under their schema, structured output, and errors."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from rksc_engine import RKSCEngine, SamplingParams  # noqa: E402
from rksc_integrations.langchain import ChatRKSC  # noqa: E402
from rksc_integrations.langchain.messages import to_engine_messages  # noqa: E402
from tests.conftest import make_char_tokenizer, make_tiny_engine  # noqa: E402
from tests.unit.tool_models import Add  # noqa: E402


class Pick(BaseModel):
    """Pick a colour and say whether it is bright."""

    colour: str = Field(json_schema_extra={"enum": ["red", "green", "blue"]})
    bright: bool
    note: str | None = None


@pytest.fixture
def chat(engine):
    return ChatRKSC(engine=engine, max_tokens=12)


def test_invoke_equals_the_engine_on_the_chat_template_and_reports_cache_reuse(chat, engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    expected = engine.generate(messages, SamplingParams(max_new_tokens=12))
    first = chat.invoke([SystemMessage("be brief"), HumanMessage("hi")])
    again = chat.invoke([SystemMessage("be brief"), HumanMessage("hi")])
    assert first.content == again.content == expected.text
    assert again.usage_metadata["input_tokens"] == len(engine.encode(messages))
    assert again.usage_metadata["input_token_details"]["cache_read"] == len(engine.encode(messages)) - 1
    assert again.response_metadata["model_name"] == engine.model_name
    assert again.response_metadata["num_cached_tokens"] == again.usage_metadata["input_token_details"]["cache_read"]
    assert again.response_metadata["finish_reason"] in ("length", "eos")


def test_a_history_ending_in_a_tool_message_renders_every_role():
    call = {"name": "Add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}
    history = [HumanMessage("add"), AIMessage("", tool_calls=[call]), ToolMessage("3", tool_call_id="c1")]
    rendered = to_engine_messages(history)
    assert [m["role"] for m in rendered] == ["user", "assistant", "tool"]
    assert rendered[1]["content"] == '<tool_call>{"name": "Add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    native = to_engine_messages(history, native_tools=True)
    assert native[1]["tool_calls"][0]["function"] == {"name": "Add", "arguments": {"a": 1, "b": 2}}


def test_stream_concatenates_to_invoke_and_only_the_last_chunk_carries_usage(chat):
    chunks = list(chat.stream("hello"))
    assert len(chunks) > 1
    assert "".join(c.content for c in chunks) == chat.invoke("hello").content
    assert chunks[-1].chunk_position == "last"
    assert [c.usage_metadata is not None for c in chunks].count(True) == 1


def test_a_multi_token_stop_is_honoured_in_invoke_stream_and_astream(chat):
    full = chat.invoke("hello").content
    stop = full[3:6]
    expected = full[: full.find(stop)]
    assert chat.invoke("hello", stop=[stop]).content == expected
    assert "".join(c.content for c in chat.stream("hello", stop=[stop])) == expected

    async def collect():
        return "".join([c.content async for c in chat.astream("hello", stop=[stop])])

    assert asyncio.run(collect()) == expected


def test_with_n_every_branch_is_its_own_chat_generation(chat):
    result = chat.generate([[HumanMessage("hello")]], n=3, temperature=1.0, seed=3)
    texts = [g.message.content for g in result.generations[0]]
    assert len(texts) == 3 and len(set(texts)) > 1


def test_a_forced_tool_call_is_decoded_under_the_tool_schema(chat):
    message = chat.bind_tools([Add], tool_choice="Add").invoke("add 2 and 3")
    [call] = message.tool_calls
    assert call["name"] == "Add" and call["id"]
    assert set(call["args"]) == {"a", "b"} and all(type(v) is int for v in call["args"].values())
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert message.usage_metadata["output_tokens"] > 0


def test_tool_choice_any_picks_one_of_the_bound_tools_and_streams_it_as_a_tool_call_chunk(chat):
    bound = chat.bind_tools([Add, Pick], tool_choice="any")
    chunks = list(bound.stream("pick"))
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    [call] = full.tool_calls
    assert call["name"] in ("Add", "Pick")
    schema = (Add if call["name"] == "Add" else Pick).model_json_schema()
    assert set(call["args"]) == set(schema["required"])


def test_structured_output_follows_enum_bool_and_optional_fields_by_every_method(chat):
    for method in ("function_calling", "json_schema"):
        value = chat.with_structured_output(Pick, method=method).invoke("choose")
        assert isinstance(value, Pick)
        assert value.colour in ("red", "green", "blue") and value.note is None
    raw = chat.with_structured_output(Pick, method="json_schema", include_raw=True).invoke("choose")
    assert raw["parsing_error"] is None and json.loads(raw["raw"].content) == raw["parsed"].model_dump(exclude_none=True)
    assert isinstance(chat.with_structured_output(None, method="json_mode").invoke("json please"), dict)


def test_a_template_that_takes_tools_receives_them(engine):
    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = "{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}" + tokenizer.chat_template
    chat = ChatRKSC(engine=RKSCEngine(engine.model, tokenizer), max_tokens=4)
    message = chat.bind_tools([Add], tool_choice="Add").invoke("add")
    assert message.tool_calls[0]["name"] == "Add"
    assert message.usage_metadata["input_tokens"] == len(tokenizer("[Add]<user>add\n<assistant>")["input_ids"])


def test_bad_input_is_a_clear_error(chat):
    with pytest.raises(ValueError, match="image"):
        chat.invoke([HumanMessage(content=[{"type": "image", "url": "http://x/y.png"}])])
    with pytest.raises(TypeError, match="messages\\[0\\] must be a BaseMessage"):
        to_engine_messages([{"role": "user", "content": "hi"}])
    with pytest.raises(TypeError, match="unexpected keyword argument.*'frequency_penalty'"):
        chat.invoke("hi", frequency_penalty=1.0)
    with pytest.raises(ValueError, match="tool_choice"):
        chat.bind_tools([Add], tool_choice="Subtract")
    with pytest.raises(ValueError, match="n must be 1"):
        list(chat.stream("hi", n=2))


def test_response_metadata_carries_the_asks_decision_when_a_reworded_prompt_reuses_kv():
    from rksc_engine import ASKSConfig, EngineConfig

    engine = make_tiny_engine(EngineConfig(asks=ASKSConfig(enabled=True, tau=0.0)))
    chat = ChatRKSC(engine=engine, max_tokens=4)
    body = "Here is a long shared context that both prompts repeat word for word. " * 3
    first = chat.invoke([SystemMessage("Answer briefly."), HumanMessage(body)])
    assert first.response_metadata["asks"] is None, "nothing was cached yet, so ASKS had nothing to act on"
    reworded = chat.invoke([SystemMessage("Please answer in few words."), HumanMessage(body)])
    decision = reworded.response_metadata["asks"]
    assert decision is not None and decision["reused"], decision
    assert decision["reused_tokens"] >= 32
    assert decision["position_shift"] == len("Please answer in few words.") - len("Answer briefly.")


def test_async_tool_calls_and_structured_output_equal_the_sync_ones(chat):
    bound = chat.bind_tools([Add], tool_choice="Add")
    structured = chat.with_structured_output(Pick)

    async def both():
        return await bound.ainvoke("add 2 and 3"), await structured.ainvoke("choose")

    message, value = asyncio.run(both())
    assert [c["args"] for c in message.tool_calls] == [c["args"] for c in bound.invoke("add 2 and 3").tool_calls]
    assert value == structured.invoke("choose") and isinstance(value, Pick)


def test_abatch_of_plain_chats_decodes_them_together_and_equals_invoke(chat, engine):
    prompts = ["hello", "good morning", "x"]
    want = [chat.invoke(p).content for p in prompts]
    engine.reset_stats()
    got = asyncio.run(chat.abatch(prompts))
    assert [m.content for m in got] == want
    assert engine.stats().peak_batch_rows >= 2, "abatch did not submit its inputs together"
