"""Real OpenAI-API clients against ``rksc serve`` (a uvicorn server on a loopback port, the tiny model):
the official ``openai`` client, LangChain's ``ChatOpenAI`` and LlamaIndex's ``OpenAILike`` get tool
calls, JSON answers and plain text that equal what the engine (and ``ChatRKSC``) give in-process, and
16 concurrent clients each get their own greedy tokens.

What ``test_serve.py`` already covers (n > 1 with logprobs and a stream through the ``openai`` client,
bad requests, disconnects, eight concurrent raw-HTTP clients sharing a batch) is not repeated here.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from pydantic import BaseModel, Field  # noqa: E402

from rksc_engine import RKSCEngine, SamplingParams  # noqa: E402
from rksc_engine.structured import tools as T  # noqa: E402
from rksc_serve.app import create_app  # noqa: E402
from tests.conftest import make_char_tokenizer, make_tiny_model, serving  # noqa: E402
from tests.unit.tool_models import Add  # noqa: E402

MESSAGES = [{"role": "user", "content": "Add 2 and 3."}]
ADD_PARAMETERS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                  "required": ["a", "b"]}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": ADD_PARAMETERS}}
PICK_SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"},
                                                "size": {"type": "integer", "minimum": 1, "maximum": 9}},
               "required": ["colour", "bright", "size"], "additionalProperties": False}


class Pick(BaseModel):
    """Pick a colour and say whether it is bright."""

    colour: str = Field(json_schema_extra={"enum": ["red", "green", "blue"]})
    bright: bool


class CallerEngine(RKSCEngine):
    """The tiny model, except that a free generation offered tools writes the tool-call opener first.

    An instruct model decides to call a tool by writing the opener; the random tiny model never does,
    so without this the "model started a call" path of ``tool_choice: auto`` would not run. Only the
    free generation (the one with the opener among its stops) is steered; the call's values are the
    model's own, decoded under the schema.
    """

    def submit(self, prompt, n=1, params=None, *, stream=False, logits_processor=None):
        if params is not None and T.TOOL_CALL_OPEN in params.stop:
            logits_processor = _writes_first(self.tokenizer, T.TOOL_CALL_OPEN)
        return super().submit(prompt, n, params, stream=stream, logits_processor=logits_processor)


def _writes_first(tokenizer, text):
    """A logits processor that makes every row write ``text`` first, then leaves it to the model."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def process(token_ids_per_row, logits):
        rows = []
        for row, generated in enumerate(token_ids_per_row):
            if len(generated) < len(ids):
                forced = logits[row].new_full(logits[row].shape, float("-inf"))
                forced[ids[len(generated)]] = 0.0
                rows.append(forced)
            else:
                rows.append(logits[row])
        return torch.stack(rows)

    return process


@pytest.fixture(scope="module")
def server_url(engine):
    with serving(create_app(engine)) as url:
        yield url


@pytest.fixture(scope="module")
def caller_url():
    with serving(create_app(CallerEngine(make_tiny_model(max_positions=4096), make_char_tokenizer()))) as url:
        yield url


def client_for(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def generated_tokens_served(url) -> float:
    metrics = httpx.get(f"{url}/metrics").text
    return float(next(line.split()[-1] for line in metrics.splitlines()
                      if line.startswith("rksc_generation_tokens_total ")))


def arguments_of(call) -> dict:
    """A client's tool call's arguments, checked to be a JSON string of an object valid for ``add``."""
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, ADD_PARAMETERS)
    return arguments


# -- the official openai client -----------------------------------------------------------------
def test_a_forced_call_is_an_openai_tool_call_equal_to_chat_rkscs(engine, server_url):
    ChatRKSC = pytest.importorskip("rksc_integrations.langchain").ChatRKSC

    client = client_for(server_url)
    before = generated_tokens_served(server_url)
    response = client.chat.completions.create(model="rksc", messages=MESSAGES, tools=[ADD], max_tokens=16,
                                              temperature=0, tool_choice={"type": "function", "function": {"name": "add"}})
    assert generated_tokens_served(server_url) - before == response.usage.completion_tokens, \
        "/metrics must count every token the call's value decodes generated"
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    arguments = arguments_of(call)
    in_process = ChatRKSC(engine=engine, max_tokens=16, temperature=0).bind_tools([ADD], tool_choice="add")
    [expected] = in_process.invoke(MESSAGES[0]["content"]).tool_calls
    assert arguments == expected["args"], "the server must decode the same call as ChatRKSC"
    assert response.usage.completion_tokens > 0 and response.usage.prompt_tokens > 0


def test_a_required_call_streams_as_tool_call_deltas_the_client_accumulates(server_url):
    client = client_for(server_url)
    whole = client.chat.completions.create(model="rksc", messages=MESSAGES, tools=[ADD], tool_choice="required",
                                           max_tokens=16, temperature=0)
    with client.chat.completions.stream(model="rksc", messages=MESSAGES, tools=[ADD], tool_choice="required",
                                        max_tokens=16, temperature=0) as stream:
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, arguments_of(call)) == \
        (whole.choices[0].message.tool_calls[0].function.name, json.loads(whole.choices[0].message.tool_calls[0].function.arguments))


def test_auto_tools_a_call_the_model_starts_is_finished_under_the_schema_whole_and_streamed(caller_url):
    client = client_for(caller_url)
    response = client.chat.completions.create(model="rksc", messages=MESSAGES, tools=[ADD], max_tokens=16, temperature=0)
    assert response.choices[0].finish_reason == "tool_calls"
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "add"
    arguments = arguments_of(call)
    with client.chat.completions.stream(model="rksc", messages=MESSAGES, tools=[ADD], tool_choice="auto",
                                        max_tokens=16, temperature=0) as stream:
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert (streamed.function.name, arguments_of(streamed)) == ("add", arguments)


def test_auto_tools_without_a_call_answer_the_engines_free_text(engine, server_url):
    client = client_for(server_url)
    response = client.chat.completions.create(model="rksc", messages=MESSAGES, tools=[ADD], tool_choice="auto",
                                              max_tokens=12, temperature=0)
    prompt = T.encode_with_tools(engine, MESSAGES, T.ToolRequest.build([ADD]))
    expected = engine.generate(prompt, T.with_tool_call_stop(SamplingParams(max_new_tokens=12)))
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.message.content == expected.text
    assert choice.finish_reason == {"eos": "stop", "length": "length"}[expected.finish_reason]
    assert response.usage.prompt_tokens == len(prompt), "the tools must be offered in the prompt"
    chunks = list(client.chat.completions.create(model="rksc", messages=MESSAGES, tools=[ADD], max_tokens=12,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [choice.finish_reason]
    assert not any(c.choices[0].delta.tool_calls for c in chunks)


def test_response_format_json_schema_is_valid_json_of_the_schema_and_parses_into_a_model(server_url):
    client = client_for(server_url)
    response = client.chat.completions.create(
        model="rksc", messages=[{"role": "user", "content": "Pick a colour."}], max_tokens=16, temperature=0.8,
        seed=3, n=2, response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK_SCHEMA,
                                                                            "strict": True}})
    assert len(response.choices) == 2
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PICK_SCHEMA)
    parsed = client.chat.completions.parse(model="rksc", messages=[{"role": "user", "content": "Pick."}],
                                           max_tokens=16, temperature=0, response_format=Pick).choices[0].message
    assert isinstance(parsed.parsed, Pick) and parsed.parsed.colour in ("red", "green", "blue")


def test_response_format_json_object_is_a_json_object_whole_and_streamed(server_url):
    client = client_for(server_url)
    fields = {"model": "rksc", "messages": [{"role": "user", "content": "JSON please."}], "max_tokens": 8,
              "temperature": 0, "response_format": {"type": "json_object"}}
    whole = client.chat.completions.create(**fields).choices[0].message.content
    assert isinstance(json.loads(whole), dict)
    chunks = list(client.chat.completions.create(**fields, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_an_agent_loops_history_with_calls_and_tool_results_is_rendered_as_the_adapters_render_it(engine, server_url):
    client = client_for(server_url)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    response = client.chat.completions.create(model="rksc", messages=history, max_tokens=8, temperature=0)
    rendered = [*MESSAGES, {"role": "assistant", "content": T.format_tool_call("add", {"a": 2, "b": 3})},
                {"role": "tool", "content": "5"}]
    expected = engine.generate(rendered, SamplingParams(max_new_tokens=8))
    assert response.usage.prompt_tokens == len(engine.encode(rendered)), "the earlier call must be in the prompt"
    assert response.choices[0].message.content == expected.text
    again = client.chat.completions.create(model="rksc", messages=history, tools=[ADD], tool_choice="required",
                                           max_tokens=8, temperature=0)
    assert again.choices[0].message.tool_calls[0].function.name == "add"


# -- LangChain's ChatOpenAI -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_openai(server_url):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=f"{server_url}/v1", api_key="none", model="rksc", temperature=0,
                                       max_tokens=12, max_retries=0, timeout=60)


def test_chat_openai_invoke_is_the_engines_answer_and_stream_concatenates_to_it(engine, chat_openai):
    expected = engine.generate([{"role": "user", "content": "hello"}], SamplingParams(max_new_tokens=12)).text
    assert chat_openai.invoke("hello").content == expected
    chunks = list(chat_openai.stream("hello"))
    assert len([c for c in chunks if c.content]) > 1, "the answer must arrive in pieces"
    assert "".join(c.content for c in chunks) == expected


def test_chat_openai_bind_tools_returns_tool_calls_invoked_and_streamed(chat_openai):
    bound = chat_openai.bind_tools([Add], tool_choice="Add")
    [call] = bound.invoke("add 2 and 3").tool_calls
    assert call["name"] == "Add" and set(call["args"]) == {"a", "b"}
    assert all(type(v) is int for v in call["args"].values())
    chunks = list(bound.stream("add 2 and 3"))
    full = chunks[0]
    for chunk in chunks[1:]:
        full += chunk
    [streamed] = full.tool_calls
    assert (streamed["name"], streamed["args"]) == ("Add", call["args"])


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_chat_openai_with_structured_output_returns_the_pydantic_model(chat_openai, method):
    value = chat_openai.with_structured_output(Pick, method=method).invoke("choose a colour")
    assert isinstance(value, Pick) and value.colour in ("red", "green", "blue")


# -- LlamaIndex's OpenAILike ----------------------------------------------------------------------
def test_llama_index_openai_like_complete_chat_and_stream_chat_answer_the_engines_text(engine, server_url):
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage

    def llm(is_chat_model):
        return openai_like.OpenAILike(model="rksc", api_base=f"{server_url}/v1", api_key="none", max_tokens=10,
                                      temperature=0, is_chat_model=is_chat_model, context_window=4096, max_retries=0)

    completion = llm(False).complete("Once upon a time")
    assert completion.text == engine.generate("Once upon a time", SamplingParams(max_new_tokens=10)).text
    chat_llm = llm(True)
    expected = engine.generate([{"role": "user", "content": "hello"}], SamplingParams(max_new_tokens=10)).text
    assert chat_llm.chat([ChatMessage(role="user", content="hello")]).message.content == expected
    pieces = [r.delta for r in chat_llm.stream_chat([ChatMessage(role="user", content="hello")])]
    assert len([p for p in pieces if p]) > 1 and "".join(p or "" for p in pieces) == expected


# -- many clients -------------------------------------------------------------------------------
def test_sixteen_concurrent_clients_each_get_the_engines_greedy_tokens(engine, server_url):
    prompts = [[{"role": "user", "content": f"Question {i}: " + "why " * (i % 5)}] for i in range(16)]
    alone = [engine.generate(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    tokenizer = engine.tokenizer

    async def ask(i):
        client = openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0, timeout=60)
        async with client:
            fields = {"model": "rksc", "messages": prompts[i], "max_tokens": 12, "temperature": 0}
            if i % 2:  # half stream
                stream = await client.chat.completions.create(**fields, stream=True)
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]), None
            response = await client.chat.completions.create(**fields, logprobs=True)
            return response.choices[0].message.content, [t.token for t in response.choices[0].logprobs.content]

    async def all_at_once():
        return await asyncio.gather(*(ask(i) for i in range(16)))

    answers = asyncio.run(all_at_once())
    assert len(answers) == 16
    for i, ((text, tokens), expected) in enumerate(zip(answers, alone)):
        assert text == expected.text, f"client {i} got another answer than the engine alone"
        if tokens is not None:
            assert tokens == [tokenizer.decode([t]) for t in expected.token_ids], f"client {i}'s tokens differ"
