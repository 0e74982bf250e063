"""Rough edges a new user of the adapters hits: one engine per model for both frameworks, a single
stop string, empty prompts, the reasoner's inputs and warnings, function calling in LlamaIndex
without the tool protocol echoed, and the cache-reuse event on every streaming path."""

from __future__ import annotations

import asyncio
import dataclasses
import warnings

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.messages import HumanMessage  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnableLambda  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from rksc_engine import Completion, RKSCEngine, SamplingParams  # noqa: E402
from rksc_engine.evaluation.workloads import synthetic_problems  # noqa: E402
from rksc_engine.reasoning.few_shot import SYSTEM_PROMPT, few_shot_messages
from rksc_engine.results import ASKSDecision  # noqa: E402
from rksc_integrations import _engines  # noqa: E402
from rksc_integrations._common import tool_turn_content  # noqa: E402
from rksc_integrations.langchain import CACHE_EVENT, ChatRKSC, MultiBranchReasoner, RKSCEventCollector  # noqa: E402
from rksc_integrations.langchain import RKSCLLM as LangChainLLM  # noqa: E402
from rksc_integrations.langchain._base import ASKS_EVENT  # noqa: E402
from rksc_integrations.llama_index import RKSCLLM  # noqa: E402
from tests.conftest import make_char_tokenizer, make_tiny_model  # noqa: E402

# What the default model wrote before a tool call it started, echoing the tool protocol's instruction.
ECHO = "You can call a tool, reply with one block per call and nothing else:\n"
QUESTION = "What is 2 + 3?"


# -- one engine per model ---------------------------------------------------------------------------
def test_adapters_built_without_an_engine_share_one_engine_per_model(monkeypatch):
    loads = []

    def from_pretrained(model=None, *, device="auto", dtype="auto", config=None, progress=True):
        loads.append(model)
        return RKSCEngine(make_tiny_model(), make_char_tokenizer(), config)

    monkeypatch.setattr(RKSCEngine, "from_pretrained", staticmethod(from_pretrained))
    monkeypatch.setattr(_engines, "_shared_engines", {})
    first, second = RKSCLLM(), RKSCLLM(max_new_tokens=8)
    chat = ChatRKSC()
    reasoner = MultiBranchReasoner()
    assert first.engine is second.engine is chat.engine is reasoner.engine, "each adapter loaded its own engine"
    assert loads == [None], f"the default model was loaded {len(loads)} times"
    assert RKSCLLM(model="/some/other/model").engine is not first.engine
    assert loads == [None, "/some/other/model"]


# -- one stop string --------------------------------------------------------------------------------
def test_a_single_stop_string_is_accepted_by_every_constructor_and_works_like_a_per_call_stop(engine):
    full = ChatRKSC(engine=engine, max_tokens=12).invoke("hello").content
    stop = full[3:5]
    chat = ChatRKSC(engine=engine, max_tokens=12, stop=stop)
    assert chat.stop == [stop]
    assert chat.invoke("hello").content == full[: full.find(stop)]
    text = RKSCLLM(engine=engine, max_new_tokens=12).complete("hello").text
    llm = RKSCLLM(engine=engine, max_new_tokens=12, stop=text[2:4])
    assert llm.stop == [text[2:4]] and llm.complete("hello").text == text[: text.find(text[2:4])]
    assert LangChainLLM(engine=engine, stop=".").stop == ["."]
    assert MultiBranchReasoner(engine=engine, stop=".").stop == ["."]


# -- empty prompts ----------------------------------------------------------------------------------
def _engine_state(engine):
    stats = engine.stats()
    return stats.requests, stats.prompt_tokens_computed, engine.prefix_cache.total_bytes


@pytest.mark.parametrize("call", [
    lambda e: ChatRKSC(engine=e).invoke(""),
    lambda e: ChatRKSC(engine=e).invoke("   \n"),
    lambda e: ChatRKSC(engine=e).invoke([HumanMessage(content="")]),
    lambda e: list(ChatRKSC(engine=e).stream("")),
    lambda e: asyncio.run(ChatRKSC(engine=e).ainvoke("")),
    lambda e: LangChainLLM(engine=e).invoke(""),
    lambda e: RKSCLLM(engine=e).complete(""),
    lambda e: RKSCLLM(engine=e).complete("  "),
    lambda e: list(RKSCLLM(engine=e).stream_complete("")),
    lambda e: RKSCLLM(engine=e).chat([ChatMessage(role="user", content="")]),
    lambda e: RKSCLLM(engine=e, system_prompt="be brief").chat([ChatMessage(role="user", content=" ")]),
], ids=["chat-invoke", "chat-blank", "chat-message", "chat-stream", "chat-ainvoke", "lc-llm", "li-complete",
        "li-blank", "li-stream", "li-chat", "li-chat-system-prompt"])
def test_an_empty_prompt_is_a_value_error_naming_the_prompt_in_both_adapters(engine, call):
    engine.generate("warm up", SamplingParams(max_new_tokens=2))
    before = _engine_state(engine)
    with pytest.raises(ValueError, match=r"prompt.* must be (a )?non-empty"):
        call(engine)
    assert _engine_state(engine) == before, "an empty prompt reached the engine"


def test_a_chat_whose_text_is_blank_but_that_carries_tool_calls_is_not_empty(engine):
    from langchain_core.messages import AIMessage, ToolMessage

    call = {"name": "add", "args": {"a": 1}, "id": "c1", "type": "tool_call"}
    reply = ChatRKSC(engine=engine, max_tokens=3).invoke([AIMessage("", tool_calls=[call]), ToolMessage("", tool_call_id="c1")])
    assert isinstance(reply.content, str)


# -- MultiBranchReasoner ----------------------------------------------------------------------------
SHOTS = synthetic_problems(1, seed=1)


def reasoner(engine, **fields):
    fields = {"n": 2, "max_tokens": 6, "seed": 0, "verifier": lambda q, c: [0.5] * len(c), **fields}
    return MultiBranchReasoner(engine=engine, **fields)


def texts(output):
    return [b.text for b in output.branches]


def test_the_reasoner_reads_content_block_messages_like_string_ones(engine):
    plain = reasoner(engine).invoke({"messages": [{"role": "user", "content": QUESTION}]})
    blocks = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 3?"}]
    as_dict = reasoner(engine).invoke({"messages": [{"role": "user", "content": blocks}]})
    as_prompt = reasoner(engine).invoke(ChatPromptTemplate.from_messages([HumanMessage(content=blocks)]).invoke({}))
    assert texts(as_dict) == texts(as_prompt) == texts(plain)
    assert as_prompt.question == QUESTION
    with pytest.raises(ValueError, match=r"messages\[0\] holds a 'image_url' content block"):
        reasoner(engine).invoke({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]})


def test_the_reasoners_few_shot_is_used_with_a_chat_prompt_template(engine):
    with_shots = reasoner(engine, few_shot=SHOTS)
    template = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{question}")])
    from_template = (template | with_shots).invoke({"question": QUESTION})
    from_string = with_shots.invoke(QUESTION)
    assert from_template.cache.num_prompt_tokens == len(engine.encode(few_shot_messages(QUESTION, SHOTS)))
    assert texts(from_template) == texts(from_string), "the template's prompt lost the few-shot problems"
    without = (template | reasoner(engine)).invoke({"question": QUESTION})
    assert without.cache.num_prompt_tokens < from_template.cache.num_prompt_tokens


def test_greedy_branches_warn_that_they_will_all_be_the_same(engine):
    with pytest.warns(UserWarning, match="temperature=0.*all 2 branches will be the same"):
        greedy = reasoner(engine, temperature=0.0)
    with pytest.warns(UserWarning, match="all 3 branches will be the same"):
        reasoner(engine).invoke(QUESTION, n=3, temperature=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reasoner(engine, temperature=0.0, n=1)  # one greedy branch is fine
    assert greedy.temperature == 0.0


def test_branches_cut_by_max_tokens_before_an_answer_are_counted_and_warned_about(engine):
    collector = RKSCEventCollector()
    with pytest.warns(UserWarning, match=r"2 of 2 branches hit max_new_tokens before stating an answer"):
        out = reasoner(engine, max_tokens=1, answer_extractor=lambda text: None).invoke(
            QUESTION, config={"callbacks": [collector]})
    assert out.answer is None and out.votes == {}
    assert out.num_truncated == 2 and out.result.num_truncated == 2
    assert [b.finish_reason for b in out.branches] == ["length", "length"]
    assert collector.data("rksc_vote")[0]["num_truncated"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        answered = reasoner(engine, max_tokens=1, answer_extractor=lambda text: "7").invoke(QUESTION)
    assert answered.num_truncated == 0 and answered.answer == "7"


# -- LlamaIndex function calling without the protocol echoed --------------------------------------
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _started_call(engine, prose: str) -> Completion:
    """A free generation that wrote ``prose`` and stopped at the tool-call opener."""
    ids = tuple(engine.tokenizer(prose + "<tool_call>", add_special_tokens=False)["input_ids"])
    return Completion(prose, ids, (-0.1,) * len(ids), "stop", num_prompt_tokens=10)


def _script_first(monkeypatch, engine, method: str, make):
    """The engine's first ``method`` call returns ``make(real_result)``; later calls are real."""
    real = getattr(engine, method)
    calls = []

    def scripted(*args, **kwargs):
        calls.append(args)
        result = real(*args, **kwargs)
        return make(result) if len(calls) == 1 else result

    monkeypatch.setattr(engine, method, scripted)
    return calls


def test_llama_index_advertises_function_calling_so_a_function_agent_runs_on_the_default(engine):
    from llama_index.core.agent.workflow import FunctionAgent

    async def run(llm):
        return await FunctionAgent(tools=[FunctionTool.from_defaults(fn=add)], llm=llm).run("hi")

    llm = RKSCLLM(engine=engine, max_new_tokens=4)
    assert llm.metadata.is_function_calling_model is True
    assert isinstance(str(asyncio.run(run(llm))), str)
    with pytest.raises(ValueError, match="LLM must be a FunctionCallingLLM"):  # what the default used to give
        asyncio.run(run(RKSCLLM(engine=engine, max_new_tokens=4, is_function_calling_model=False)))


def test_a_tool_call_turn_never_echoes_the_tool_protocol_into_the_llama_index_message(engine, monkeypatch):
    llm = RKSCLLM(engine=engine, max_new_tokens=12)
    _script_first(monkeypatch, engine, "generate", lambda real: _started_call(engine, ECHO))
    response = llm.chat_with_tools([FunctionTool.from_defaults(fn=add)], user_msg=QUESTION)
    calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
    assert [c.tool_name for c in calls] == ["add"] and set(calls[0].tool_kwargs) == {"a", "b"}
    assert "reply with one block" not in (response.message.content or ""), response.message.content
    assert response.message.content in ("", None)


def test_a_streamed_tool_call_turn_ends_in_a_message_without_the_echo(engine, monkeypatch):
    from rksc_engine.results import StreamChunk

    llm = RKSCLLM(engine=engine, max_new_tokens=12)
    started = _started_call(engine, ECHO)

    def stream(prompt, params=None):
        yield StreamChunk(ECHO, started.token_ids[:-1])
        yield StreamChunk("", started.token_ids[-1:], started)

    monkeypatch.setattr(engine, "stream", stream)
    last = list(llm.stream_chat_with_tools([FunctionTool.from_defaults(fn=add)], user_msg=QUESTION))[-1]
    assert [b.tool_name for b in last.message.blocks if isinstance(b, ToolCallBlock)] == ["add"]
    assert "reply with one block" not in (last.message.content or "")


def test_a_langchain_tool_call_turn_never_echoes_the_tool_protocol_either(engine, monkeypatch):
    class Add(BaseModel):
        """Add two integers."""

        a: int = Field(description="first")
        b: int = Field(description="second")

    chat = ChatRKSC(engine=engine, max_tokens=12).bind_tools([Add])
    _script_first(monkeypatch, engine, "generate_branches", lambda real: [_started_call(engine, ECHO)])
    message = chat.invoke(QUESTION)
    assert [c["name"] for c in message.tool_calls] == ["Add"]
    assert message.content == "", f"the protocol echo reached the message: {message.content!r}"


def test_prose_before_a_call_is_kept_when_the_template_itself_takes_tools():
    class TemplateWithTools:
        chat_template = "{% for t in tools %}{% endfor %}"

    class PlainTemplate:
        chat_template = "{{ messages }}"

    assert tool_turn_content("Let me add them.", TemplateWithTools()) == "Let me add them."
    assert tool_turn_content(ECHO, PlainTemplate()) == ""


# -- the cache-reuse event on every path ------------------------------------------------------------
class RunEvents(BaseCallbackHandler):
    """Chat-model run ids and the custom events sent, with the run they were sent on."""

    def __init__(self):
        self.model_runs, self.events = [], []

    def on_chat_model_start(self, serialized, messages, *, run_id, **kwargs):
        self.model_runs.append(run_id)

    def on_custom_event(self, name, data, *, run_id, **kwargs):
        self.events.append((name, data, run_id))


def _paths(chat):
    async def astream(config):
        return [c async for c in chat.astream("hello", config=config)]

    return {
        "invoke": lambda config: chat.invoke("hello", config=config),
        "stream": lambda config: list(chat.stream("hello", config=config)),
        "astream": lambda config: asyncio.run(astream(config)),
        "chain-stream": lambda config: list((RunnableLambda(lambda x: x) | chat).stream("hello", config=config)),
    }


@pytest.mark.parametrize("path", ["invoke", "stream", "astream", "chain-stream"])
def test_every_path_sends_one_cache_reuse_event_on_the_chat_model_run(engine, path):
    chat = ChatRKSC(engine=engine, max_tokens=5)
    chat.invoke("hello")  # so the event reports a cache hit
    handler = RunEvents()
    _paths(chat)[path]({"callbacks": [handler]})
    cache_events = [(data, run) for name, data, run in handler.events if name == CACHE_EVENT]
    assert len(cache_events) == 1, f"{path}: {len(cache_events)} rksc_cache_reuse events"
    data, run_id = cache_events[0]
    assert run_id == handler.model_runs[-1], f"{path}: the event is not on the chat model's run"
    assert data["num_cached_tokens"] > 0 and data["num_generations"] == 1


def test_astream_events_carries_the_cache_reuse_event(engine):
    chat = ChatRKSC(engine=engine, max_tokens=5)

    async def collect():
        return [e async for e in chat.astream_events("hello", version="v2")]

    events = asyncio.run(collect())
    custom = [e for e in events if e["event"] == "on_custom_event"]
    start = next(e for e in events if e["event"] == "on_chat_model_start")
    assert [e["name"] for e in custom] == [CACHE_EVENT]
    assert custom[0]["run_id"] == start["run_id"]


def test_the_asks_decision_is_sent_as_an_event_on_stream_and_invoke(engine, monkeypatch):
    decision = ASKSDecision(reused=True, sigma=0.995, tau=0.99, prefix_tokens=4, request_span_tokens=3,
                            cached_span_tokens=3, remainder_tokens=40, position_shift=0, reused_tokens=40,
                            recomputed_tokens=0, check_tokens=3)
    real_stream, real_branches = engine.stream, engine.generate_branches

    def stream(*args, **kwargs):
        for chunk in real_stream(*args, **kwargs):
            yield chunk if chunk.completion is None else dataclasses.replace(
                chunk, completion=dataclasses.replace(chunk.completion, asks=decision))

    def generate_branches(*args, **kwargs):
        return [dataclasses.replace(c, asks=decision) for c in real_branches(*args, **kwargs)]

    monkeypatch.setattr(engine, "stream", stream)
    monkeypatch.setattr(engine, "generate_branches", generate_branches)
    chat = ChatRKSC(engine=engine, max_tokens=5)
    for run in (lambda c: list(chat.stream("hello", config=c)), lambda c: chat.invoke("hello", config=c)):
        collector = RKSCEventCollector()
        run({"callbacks": [collector]})
        assert [e.name for e in collector.events] == [CACHE_EVENT, ASKS_EVENT]
        assert collector.data(ASKS_EVENT)[0]["sigma"] == 0.995
