"""RKSCLLM on the tiny model: LlamaIndex endpoints, streaming, async, stops, events, tools, branches,
and early stop under ``RKSCBranchQueryEngine``."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import threading
from typing import Any, Literal

import pytest
from pydantic import BaseModel

pytest.importorskip("llama_index.core")

from llama_index.core.base.llms.types import ChatMessage, MessageRole  # noqa: E402
from llama_index.core.callbacks import CallbackManager, CBEventType  # noqa: E402
from llama_index.core.callbacks.base_handler import BaseCallbackHandler  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.instrumentation.events.llm import LLMCompletionEndEvent  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.core.query_engine import CustomQueryEngine  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from llama_index.core.types import PydanticProgramMode  # noqa: E402

from rksc_engine import Completion, RKSCEngine, SamplingParams  # noqa: E402
from rksc_engine.reasoning.cgee import CGEEConfig  # noqa: E402
from rksc_integrations.llama_index import (  # noqa: E402
    RKSC_EVENT_TYPES,
    RKSCLLM,
    RKSCASKSReuseEvent,
    RKSCBranchQueryEngine,
    RKSCBranchVoteEvent,
    RKSCCacheReuseEvent,
    RKSCCGEESkipEvent,
    RKSCEarlyExitEvent,
    RKSCEarlyStopEvent,
    RKSCVerificationEvent,
    normalise_answer,
)
from rksc_integrations.llama_index.branches import decide  # noqa: E402
from rksc_integrations.llama_index.messages import parse_tool_calls, to_engine_messages  # noqa: E402
from tests.conftest import loop_turns_while_engine_held, make_char_tokenizer, make_tiny_model  # noqa: E402


class Recorder(BaseEventHandler):
    events: list = []

    def handle(self, event, **kwargs):
        self.events.append(event)


@pytest.fixture
def recorder():
    handler = Recorder(events=[])
    root = get_dispatcher()
    root.add_event_handler(handler)
    yield handler
    root.event_handlers.remove(handler)


@pytest.fixture
def llm(tiny_engine):
    return RKSCLLM(engine=tiny_engine, max_new_tokens=12)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- metadata and formatting --------------------------------------------------------------------
def test_metadata_comes_from_the_engine_and_the_fields(llm, tiny_engine):
    meta = llm.metadata
    assert meta.context_window == tiny_engine.context_window == 512
    assert meta.num_output == 12
    assert meta.is_chat_model is True  # the char tokenizer has a chat template
    # rksc decodes tool calls under their schemas itself, whatever the template (this one takes no tools).
    assert meta.is_function_calling_model is True
    assert meta.model_name == tiny_engine.model_name


def test_with_the_field_none_function_calling_is_advertised_only_when_the_template_takes_tools(tiny_model):
    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}" + tokenizer.chat_template
    assert RKSCLLM(engine=RKSCEngine(tiny_model, tokenizer), is_function_calling_model=None).metadata.is_function_calling_model is True
    plain = RKSCEngine(tiny_model, make_char_tokenizer())
    assert RKSCLLM(engine=plain, is_function_calling_model=None).metadata.is_function_calling_model is False
    assert RKSCLLM(engine=plain, is_function_calling_model=False).metadata.is_function_calling_model is False


def test_complete_answers_the_prompt_as_a_user_turn_of_the_chat_template(llm, tiny_engine):
    expected = tiny_engine.generate(user("hello"), SamplingParams(max_new_tokens=12)).text
    assert llm.complete("hello").text == expected


def test_formatted_complete_sends_the_prompt_verbatim(llm, tiny_engine):
    expected = tiny_engine.generate("raw text", SamplingParams(max_new_tokens=12)).text
    assert llm.complete("raw text", formatted=True).text == expected


def test_streaming_and_non_streaming_complete_format_the_prompt_identically(tiny_engine):
    llm = RKSCLLM(engine=tiny_engine, max_new_tokens=12, completion_to_prompt=lambda p: f"Q: {p}\nA:")
    whole = llm.complete("hi").text
    pieces = list(llm.stream_complete("hi"))
    assert whole == tiny_engine.generate("Q: hi\nA:", SamplingParams(max_new_tokens=12)).text
    assert pieces[-1].text == whole
    assert "".join(p.delta for p in pieces) == whole
    assert len(pieces) > 2  # token by token, not one final chunk
    assert all(later.text.startswith(earlier.text) for earlier, later in zip(pieces, pieces[1:]))


def test_system_prompt_becomes_the_system_turn(tiny_engine):
    llm = RKSCLLM(engine=tiny_engine, max_new_tokens=12, system_prompt="Be brief.")
    expected = tiny_engine.generate(
        [{"role": "system", "content": "Be brief."}, *user("hello")], SamplingParams(max_new_tokens=12)
    ).text
    assert llm.complete("hello").text == expected


def test_chat_and_stream_chat_render_messages_with_the_chat_template(llm, tiny_engine):
    messages = [ChatMessage(role=MessageRole.SYSTEM, content="sys"), ChatMessage(role=MessageRole.USER, content="hey")]
    expected = tiny_engine.generate(
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "hey"}], SamplingParams(max_new_tokens=12)
    ).text
    assert llm.chat(messages).message.content == expected
    streamed = list(llm.stream_chat(messages))
    assert streamed[-1].message.content == expected
    assert "".join(r.delta for r in streamed) == expected


def test_llama_index_roles_fold_onto_the_engine_roles():
    messages = [
        ChatMessage(role=MessageRole.DEVELOPER, content="d"),
        ChatMessage(role=MessageRole.CHATBOT, content="c"),
        ChatMessage(role=MessageRole.FUNCTION, content="f"),
    ]
    assert [m["role"] for m in to_engine_messages(messages)] == ["system", "assistant", "tool"]


# -- stops --------------------------------------------------------------------------------------
def test_a_stop_string_spanning_several_tokens_cuts_text_and_stream(llm):
    full = llm.complete("hello", max_new_tokens=12).text
    stop = full[3:6]  # three characters = three tokens of the char tokenizer
    cut = full[: full.find(stop)]
    assert llm.complete("hello", stop=[stop]).text == cut
    pieces = list(llm.stream_complete("hello", stop=stop))
    assert "".join(p.delta for p in pieces) == cut
    assert pieces[-1].additional_kwargs["finish_reason"] == "stop"


# -- cache reuse and instrumentation ------------------------------------------------------------
def test_a_repeated_prompt_reports_its_prefix_as_cached(llm):
    first = llm.complete("shared context")
    second = llm.complete("shared context")
    assert first.additional_kwargs["cached_tokens"] == 0
    assert second.additional_kwargs["cached_tokens"] == second.additional_kwargs["prompt_tokens"] - 1


def test_a_custom_event_handler_receives_the_cache_reuse_event_inside_the_llm_span(llm, recorder):
    llm.complete("shared context")
    llm.complete("shared context")
    reuse = [e for e in recorder.events if isinstance(e, RKSCCacheReuseEvent)]
    ends = [e for e in recorder.events if isinstance(e, LLMCompletionEndEvent)]
    assert len(reuse) == 2 and len(ends) == 2
    assert reuse[0].num_cached_tokens == 0 and reuse[1].num_cached_tokens == reuse[1].num_prompt_tokens - 1
    assert reuse[1].reuse_rate > 0.9
    assert reuse[1].cache_tokens > 0
    assert reuse[1].span_id == ends[1].span_id  # tied to the LLM call that caused it


def test_streams_and_async_calls_emit_the_cache_event_too(llm, recorder):
    list(llm.stream_complete("abc"))
    asyncio.run(llm.acomplete("abc"))
    reuse = [e for e in recorder.events if isinstance(e, RKSCCacheReuseEvent)]
    assert [e.num_cached_tokens > 0 for e in reuse] == [False, True]


def test_multi_branch_calls_emit_vote_and_cgee_events(llm, recorder):
    response = llm.complete("pick", branches=3, seed=0)
    vote = [e for e in recorder.events if isinstance(e, RKSCBranchVoteEvent)]
    cgee = [e for e in recorder.events if isinstance(e, RKSCCGEESkipEvent)]
    assert len(vote) == 1 and vote[0].num_branches == 3 and sum(vote[0].votes.values()) == 3
    assert len(cgee) == 1 and cgee[0].skipped == response.additional_kwargs["rksc_branches"]["cgee_skipped"]


class LLMEvents(BaseCallbackHandler):
    def __init__(self):
        super().__init__([], [])
        self.starts, self.ends = 0, 0

    def on_event_start(self, event_type, payload=None, event_id="", parent_id="", **kwargs):
        self.starts += event_type == CBEventType.LLM
        return event_id

    def on_event_end(self, event_type, payload=None, event_id="", **kwargs):
        self.ends += event_type == CBEventType.LLM

    def start_trace(self, trace_id=None):
        pass

    def end_trace(self, trace_id=None, trace_map=None):
        pass


def test_llama_index_callbacks_see_every_endpoint(tiny_engine):
    handler = LLMEvents()
    llm = RKSCLLM(engine=tiny_engine, max_new_tokens=4, callback_manager=CallbackManager([handler]))
    msgs = [ChatMessage(role=MessageRole.USER, content="x")]
    llm.complete("x")
    list(llm.stream_complete("x"))
    llm.chat(msgs)
    list(llm.stream_chat(msgs))

    async def run_async():
        await llm.acomplete("x")
        [r async for r in await llm.astream_complete("x")]
        await llm.achat(msgs)
        [r async for r in await llm.astream_chat(msgs)]

    asyncio.run(run_async())
    assert (handler.starts, handler.ends) == (8, 8)


# -- async --------------------------------------------------------------------------------------
def test_acomplete_does_not_block_the_event_loop(llm, tiny_engine):
    expected = llm.complete("hello").text
    response, loop_was_free = asyncio.run(loop_turns_while_engine_held(tiny_engine, llm.acomplete("hello")))
    assert response.text == expected
    assert loop_was_free, "acomplete blocked the event loop while it waited for the engine"


def test_astream_complete_streams_tokens_without_blocking_the_loop(llm, tiny_engine):
    expected = llm.complete("hello").text

    async def consume():
        return [r async for r in await llm.astream_complete("hello")]

    pieces, loop_was_free = asyncio.run(loop_turns_while_engine_held(tiny_engine, consume()))
    assert pieces[-1].text == expected and "".join(p.delta for p in pieces) == expected
    assert len(pieces) > 2
    assert loop_was_free, "astream_complete blocked the event loop while it waited for the engine"


def test_an_abandoned_async_stream_releases_the_engine(llm, tiny_engine):
    async def take_two():
        stream = await llm.astream_complete("hello", max_new_tokens=64)
        got = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()
        return got

    assert len(asyncio.run(take_two())) == 2
    result = []
    worker = threading.Thread(target=lambda: result.append(tiny_engine.generate("again", SamplingParams(max_new_tokens=2))))
    worker.start()
    worker.join(timeout=10)
    assert result and result[0].num_generated_tokens == 2


def test_achat_matches_chat(llm):
    msgs = [ChatMessage(role=MessageRole.USER, content="yo")]
    assert asyncio.run(llm.achat(msgs)).message.content == llm.chat(msgs).message.content


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda llm: llm.complete(""), ValueError, "non-empty"),
        (lambda llm: llm.complete(["not", "a", "string"]), TypeError, "prompt must be a string"),
        (lambda llm: llm.complete("x", max_tokens=5), TypeError, "per-call options"),
        (lambda llm: llm.complete("x", temperature=-1.0), ValueError, "temperature"),
        (lambda llm: llm.complete("x", branches=0), ValueError, "branches"),
        (lambda llm: llm.complete("x" * 600, formatted=True), ValueError, "context window"),
        (lambda llm: llm.chat([]), ValueError, "must not be empty"),
        # LlamaIndex's own callback validates messages first (pydantic's ValidationError is a ValueError).
        (lambda llm: llm.chat(["hi"]), ValueError, "ChatMessage"),
        (lambda llm: llm.stream_complete("x", stop=[""]), ValueError, "non-empty"),
        (lambda llm: llm.chat([ChatMessage(content="hi")], tools=[{"description": "no name"}]), ValueError, "'name'"),
        (lambda llm: llm.chat([ChatMessage(content="hi")], tools=[{"name": "f"}], tool_choice="g"), ValueError, "tool_choice"),
    ],
)
def test_bad_input_raises_a_clear_error_and_the_engine_stays_usable(llm, call, error, match):
    before = llm.complete("ok").text
    with pytest.raises(error, match=match):
        call(llm)
    assert llm.complete("ok").text == before


def test_bad_fields_fail_at_construction(tiny_engine):
    with pytest.raises(ValueError):
        RKSCLLM(engine=tiny_engine, top_p=0.0)
    with pytest.raises(ValueError, match="either engine or model"):
        RKSCLLM(engine=tiny_engine, model="/some/dir")
    with pytest.raises(TypeError, match="RKSCEngine"):
        RKSCLLM(engine="not an engine")


# -- tool calls ---------------------------------------------------------------------------------
def test_tool_call_blocks_are_parsed_and_malformed_ones_stay_in_the_prose():
    prose, calls = parse_tool_calls('Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert prose == "Sure." and [(c.tool_name, c.tool_kwargs) for c in calls] == [("add", {"a": 1})]
    text = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(text) == (text, [])


def _scripted(engine, monkeypatch, text: str) -> list:
    """Make the engine answer ``text``; returns the prompts it was given."""
    prompts = []
    generate = engine.generate

    def scripted(prompt, params=None):
        prompts.append(prompt)
        real = generate(prompt, SamplingParams(max_new_tokens=1))
        return Completion(text=text, token_ids=real.token_ids, logprobs=real.logprobs, finish_reason="eos",
                          num_prompt_tokens=real.num_prompt_tokens, num_cached_tokens=real.num_cached_tokens)

    monkeypatch.setattr(engine, "generate", scripted)
    return prompts


def test_predict_and_call_offers_the_tools_and_runs_the_call_the_model_makes(monkeypatch):
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    # The tool offer is longer than the default tiny model's 512 positions (one character a token).
    engine = RKSCEngine(make_tiny_model(max_positions=4096), make_char_tokenizer())
    # The char template takes no tools; function calling is advertised anyway (the default).
    llm = RKSCLLM(engine=engine, max_new_tokens=12)
    prompts = _scripted(engine, monkeypatch, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    result = llm.predict_and_call([FunctionTool.from_defaults(fn=add)], user_msg="What is 2 + 3?")
    assert result.response == "5"
    system = prompts[0][0]
    assert system["role"] == "system" and '"name": "add"' in system["content"] and "<tool_call>" in system["content"]


def test_a_reply_without_a_tool_call_is_an_error_only_when_one_is_required(llm, tiny_engine, monkeypatch):
    _scripted(tiny_engine, monkeypatch, "no tools needed")
    response = llm.chat_with_tools([FunctionTool.from_defaults(fn=lambda x: x, name="echo")], user_msg="hi")
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="expected at least one tool call"):
        llm.get_tool_calls_from_response(response)


# -- branches -----------------------------------------------------------------------------------
def _completion(text: str, logprob: float) -> Completion:
    return Completion(text=text, token_ids=(1,), logprobs=(logprob,), finish_reason="eos", num_prompt_tokens=3)


def test_normalised_answers_vote_together_and_the_most_confident_of_the_winners_is_returned():
    completions = [_completion("London", -0.1), _completion("Paris.", -1.0), _completion("  paris", -0.2)]
    decision = decide(completions, normalise_answer, CGEEConfig())
    assert decision.answer == "paris" and decision.votes == {"london": 1, "paris": 2}
    assert decision.chosen_branch == 2
    assert decision.cgee_skipped is False  # 2 of 3 is not a decisive vote


def test_a_unanimous_vote_lets_cgee_skip_verification():
    completions = [_completion("Yes", -0.1), _completion("yes!", -0.2), _completion("YES", -0.3)]
    decision = decide(completions, normalise_answer, CGEEConfig())
    assert decision.cgee_skipped is True and decision.p == 1.0 and decision.lead == 1.0


def test_greedy_settings_still_sample_distinct_branches(llm):
    response = llm.complete("pick", branches=4, seed=1)
    assert sum(response.additional_kwargs["rksc_branches"]["votes"].values()) <= 4
    assert len(response.additional_kwargs["rksc_branches"]["votes"]) > 1  # branch_temperature, not argmax


# -- verified branches, CGEE and ASKS events -----------------------------------------------------
def _branch_keys(engine, prompt: str, n: int, seed: int) -> list[str]:
    params = SamplingParams(max_new_tokens=12, temperature=0.7, seed=seed)
    return [normalise_answer(c.text) for c in engine.generate_branches(user(prompt), n, params)]


def test_an_undecided_vote_is_verified_and_the_verifier_can_overturn_the_majority(tiny_engine, recorder):
    keys = _branch_keys(tiny_engine, "pick", 4, seed=0)
    underdog = min(set(keys), key=keys.count)  # the answer with the fewest votes
    asked = []

    def verifier(question, candidates):
        asked.append((question, list(candidates)))
        return [1.0 if c == underdog else 0.0 for c in candidates]

    llm = RKSCLLM(engine=tiny_engine, max_new_tokens=12, branches=4, seed=0, verifier=verifier,
                  cgee=CGEEConfig(skip_enabled=False), answer_key=normalise_answer, vote="exact")
    response = llm.complete("pick")
    decision = response.additional_kwargs["rksc_branches"]
    assert decision["verified"] and decision["answer"] == underdog and normalise_answer(response.text) == underdog
    assert asked[0][0] == "pick" and set(asked[0][1]) == set(keys)  # the call's prompt, every voted answer
    assert decision["scores"] == {k: float(k == underdog) for k in set(keys)}
    [verification] = [e for e in recorder.events if isinstance(e, RKSCVerificationEvent)]
    assert verification.answer == underdog


def test_a_decisive_vote_skips_the_verifier(tiny_engine, recorder):
    def must_not_run(question, candidates):
        raise AssertionError("CGEE should have skipped verification")

    llm = RKSCLLM(engine=tiny_engine, max_new_tokens=12, branches=3, seed=0, verifier=must_not_run,
                  cgee=CGEEConfig(tau_conf=0.0, margin=0.0))
    decision = llm.complete("pick").additional_kwargs["rksc_branches"]
    assert decision["cgee_skipped"] and not decision["verified"]
    assert not [e for e in recorder.events if isinstance(e, RKSCVerificationEvent)]


def test_the_default_judge_exits_early_under_cgee_level_2_and_the_event_says_where(recorder):
    engine = RKSCEngine(make_tiny_model(num_layers=4), make_char_tokenizer())
    cgee = CGEEConfig(skip_enabled=False, exit_enabled=True, theta=1.0, epsilon=1.0, min_layer=0)  # any entropy passes
    llm = RKSCLLM(engine=engine, max_new_tokens=8, branches=3, seed=0, cgee=cgee)
    decision = llm.complete("pick").additional_kwargs["rksc_branches"]
    assert decision["verified"] and decision["num_layers"] == 4
    assert decision["exit_layers"] and all(layer == 1 for layer in decision["exit_layers"])
    [exit_event] = [e for e in recorder.events if isinstance(e, RKSCEarlyExitEvent)]
    assert exit_event.exit_layers == decision["exit_layers"] and exit_event.layers_saved == 2 * len(decision["exit_layers"])


def test_a_full_depth_verification_emits_no_early_exit_event(tiny_engine, recorder):
    llm = RKSCLLM(engine=tiny_engine, max_new_tokens=8, branches=3, seed=0, cgee=CGEEConfig.off())
    decision = llm.complete("pick").additional_kwargs["rksc_branches"]
    assert decision["verified"] and decision["layers_saved"] == 0
    assert not [e for e in recorder.events if isinstance(e, RKSCEarlyExitEvent)]


def test_a_failing_verifier_surfaces_as_an_error_and_the_engine_stays_usable(llm, tiny_engine):
    before = llm.complete("ok").text

    def broken(question, candidates):
        raise RuntimeError("verifier down")

    failing = RKSCLLM(engine=tiny_engine, max_new_tokens=12, branches=3, verifier=broken, cgee=CGEEConfig.off())
    with pytest.raises(RuntimeError, match="verifier down"):
        failing.complete("pick")
    assert llm.complete("ok").text == before
    with pytest.raises(TypeError, match="verifier must be"):
        RKSCLLM(engine=tiny_engine, verifier=42)


@dataclasses.dataclass(frozen=True)
class _Decision:
    """Stands in for rksc_engine.results.ASKSDecision (same field names), so the test does not wait on it."""

    reused: bool
    sigma: float
    tau: float
    reused_tokens: int
    recomputed_tokens: int


@dataclasses.dataclass(frozen=True)
class _CompletionWithASKS(Completion):
    asks: object = None


def test_a_completion_carrying_an_asks_decision_emits_the_asks_event(llm, tiny_engine, monkeypatch, recorder):
    generate = tiny_engine.generate
    decision = _Decision(reused=True, sigma=0.97, tau=0.9, reused_tokens=40, recomputed_tokens=3)

    def with_asks(prompt, params=None):
        real = generate(prompt, params)
        fields = {f.name: getattr(real, f.name) for f in dataclasses.fields(Completion) if f.name != "asks"}
        return _CompletionWithASKS(**fields, asks=decision)

    llm.complete("plain")
    assert not [e for e in recorder.events if isinstance(e, RKSCASKSReuseEvent)]  # no decision, no event
    monkeypatch.setattr(tiny_engine, "generate", with_asks)
    response = llm.complete("hello")
    [event] = [e for e in recorder.events if isinstance(e, RKSCASKSReuseEvent)]
    assert (event.reused, event.sigma, event.num_reused_tokens, event.num_recomputed_tokens) == (True, 0.97, 40, 3)
    assert response.additional_kwargs["rksc_asks"]["tau"] == 0.9


# -- tool calls and structured output under the schema ------------------------------------------
class Pick(BaseModel):
    """Pick a colour."""

    colour: Literal["red", "green", "blue"]
    count: int
    bright: bool


def _add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
def long_llm():
    engine = RKSCEngine(make_tiny_model(max_positions=4096), make_char_tokenizer())
    return RKSCLLM(engine=engine, max_new_tokens=12)


def test_a_required_tool_call_is_decoded_under_the_tool_schema_in_every_chat_path(long_llm):
    tool = FunctionTool.from_defaults(fn=_add)
    response = long_llm.chat_with_tools([tool], user_msg="add 2 and 3", tool_required=True)
    [selection] = long_llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "_add" and set(selection.tool_kwargs) == {"a", "b"}
    assert all(type(v) is int for v in selection.tool_kwargs.values())
    assert response.additional_kwargs["finish_reason"] == "tool_calls"
    streamed = list(long_llm.stream_chat_with_tools([tool], user_msg="add 2 and 3", tool_required=True))
    assert long_llm.get_tool_calls_from_response(streamed[-1])[0].tool_kwargs == selection.tool_kwargs

    async def achat():
        return await long_llm.achat_with_tools([tool], user_msg="add 2 and 3", tool_required=True)

    assert long_llm.get_tool_calls_from_response(asyncio.run(achat()))[0].tool_kwargs == selection.tool_kwargs


def test_structured_predict_decodes_the_output_class_under_its_schema(long_llm):
    prompt = PromptTemplate("Choose a colour for {thing}.")
    value = long_llm.structured_predict(Pick, prompt, thing="a door")
    assert isinstance(value, Pick) and value.colour in ("red", "green", "blue")
    assert asyncio.run(long_llm.astructured_predict(Pick, prompt, thing="a door")) == value  # greedy: same answer


def test_structured_predict_in_function_mode_goes_through_a_forced_tool_call(long_llm):
    # LlamaIndex's FunctionCallingProgram, which calls predict_and_call(tool_required=True).
    long_llm.pydantic_program_mode = PydanticProgramMode.FUNCTION
    long_llm.is_function_calling_model = True
    value = long_llm.structured_predict(Pick, PromptTemplate("Choose a colour for {thing}."), thing="a door")
    assert isinstance(value, Pick)


def test_the_engine_package_never_imports_llama_index():
    code = "import sys, rksc_engine; sys.exit(any(m.startswith('llama_index') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- early stop under RKSCBranchQueryEngine -------------------------------------------------------
class AskLLM(CustomQueryEngine):
    """The smallest query engine: the query string straight to the LLM."""

    llm: Any

    def custom_query(self, query_str: str) -> str:
        return str(self.llm.complete(query_str))

    async def acustom_query(self, query_str: str) -> str:
        return str(await self.llm.acomplete(query_str))


def first_char_parity(text: str) -> str | None:
    """Two answers from the first character: a vote that is often decided before every branch ends."""
    return None if not text else ("odd" if ord(text[0]) % 2 else "even")


def parity_llm(engine, seed: int) -> RKSCLLM:
    # Stop strings end the branches at different lengths, so some still run when the vote is decided.
    # An exact vote: the clustered default runs no ``decided`` rule.
    return RKSCLLM(engine=engine, max_new_tokens=24, branches=8, temperature=0.5, seed=seed, stop=["a", "o"],
                   answer_key=first_char_parity, vote="exact", verifier=None, cgee=CGEEConfig.off())


def decided_early(engine) -> tuple[int, dict]:
    """``(seed, final decision)`` of the first seeded query whose branches the default rule cut short."""
    for seed in range(12):
        final = RKSCBranchQueryEngine(AskLLM(llm=parity_llm(engine, seed))).query("pick").metadata["rksc"]["final"]
        if final["early_stop"]["branches_cancelled"]:
            return seed, final
    pytest.fail("'decided' never stopped a branch on twelve seeded two-answer votes")


def test_a_branch_query_engine_stops_branches_that_cannot_change_the_winner_and_reports_it(tiny_engine, recorder):
    seed, _ = decided_early(tiny_engine)
    recorder.events.clear()
    response = RKSCBranchQueryEngine(AskLLM(llm=parity_llm(tiny_engine, seed))).query("pick")
    final = response.metadata["rksc"]["final"]
    everything = parity_llm(tiny_engine, seed).complete("pick").additional_kwargs["rksc_branches"]  # outside a query
    report = final["early_stop"]
    assert report["branches_launched"] == 8 and report["stopped_request_by"] == "decided"
    assert [s["rule"] for s in report["stopped_by"]] == ["decided"] * report["branches_cancelled"]
    assert final["answer"] == everything["answer"], "decided changed the vote's winner"
    assert sum(final["votes"].values()) <= 8 - report["branches_cancelled"], "a stopped branch still voted"
    assert everything["early_stop"] is None, "a call outside a branch query ran under early stop"
    [event] = [e for e in recorder.events if isinstance(e, RKSCEarlyStopEvent)]
    assert {name: getattr(event, name) for name in report} == report
    vote_events = [i for i, e in enumerate(recorder.events) if isinstance(e, RKSCBranchVoteEvent)]
    assert recorder.events.index(event) < vote_events[0], "the early-stop event should come before the vote"


@pytest.mark.slow
def test_early_stop_none_runs_every_branch_as_a_call_outside_a_query_would(tiny_engine, recorder):
    seed, _ = decided_early(tiny_engine)
    recorder.events.clear()
    response = RKSCBranchQueryEngine(AskLLM(llm=parity_llm(tiny_engine, seed)), early_stop=None).query("pick")
    final = response.metadata["rksc"]["final"]
    everything = parity_llm(tiny_engine, seed).complete("pick").additional_kwargs["rksc_branches"]
    assert final["early_stop"] is None
    assert final == everything, "with early stop off the query's call should run and vote every branch"
    assert not [e for e in recorder.events if isinstance(e, RKSCEarlyStopEvent)]


def test_aquery_runs_its_calls_under_the_same_early_stop(tiny_engine, recorder):
    seed, expected = decided_early(tiny_engine)
    recorder.events.clear()
    response = asyncio.run(RKSCBranchQueryEngine(AskLLM(llm=parity_llm(tiny_engine, seed))).aquery("pick"))
    final = response.metadata["rksc"]["final"]
    assert final["early_stop"] == expected["early_stop"], "aquery stopped other branches than query"
    assert final["answer"] == expected["answer"]
    assert [e.branches_cancelled for e in recorder.events if isinstance(e, RKSCEarlyStopEvent)] == \
        [expected["early_stop"]["branches_cancelled"]]
    off = asyncio.run(RKSCBranchQueryEngine(AskLLM(llm=parity_llm(tiny_engine, seed)), early_stop=None).aquery("pick"))
    assert off.metadata["rksc"]["final"]["early_stop"] is None


@pytest.mark.parametrize(("bad", "error"), [("sometimes", ValueError), (3, TypeError), ({"decided": True}, TypeError)])
def test_a_bad_early_stop_is_refused_naming_the_field_before_anything_runs(tiny_engine, bad, error):
    before = tiny_engine.stats().decode_tokens
    with pytest.raises(error, match="early_stop must be"):
        RKSCBranchQueryEngine(AskLLM(llm=parity_llm(tiny_engine, 0)), early_stop=bad)
    assert tiny_engine.stats().decode_tokens == before


def test_the_early_stop_event_is_one_of_the_rksc_event_types():
    assert RKSCEarlyStopEvent in RKSC_EVENT_TYPES and RKSCEarlyStopEvent.class_name() == "RKSCEarlyStopEvent"
