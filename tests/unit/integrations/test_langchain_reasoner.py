"""MultiBranchReasoner on the tiny seeded model: the engine's result, every input form, custom
events through callbacks and astream_events, the CGEE decision, early stop, cache reuse, batch/async,
per-call options, construction, bad input and a failing verifier."""

from __future__ import annotations

import asyncio
import json
import threading
from operator import attrgetter

import pytest

pytest.importorskip("langchain_core")

from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.messages import ToolMessage  # noqa: E402
from langchain_core.prompt_values import ChatPromptValue, StringPromptValue  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnableLambda  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from rksc_engine import SamplingParams  # noqa: E402
from rksc_engine.evaluation.workloads import synthetic_problems  # noqa: E402
from rksc_engine.reasoning.cgee import CGEEConfig  # noqa: E402
from rksc_engine.reasoning.early_stop import AnsweredConfig, EarlyStopConfig  # noqa: E402
from rksc_engine.reasoning.few_shot import SYSTEM_PROMPT, few_shot_messages
from rksc_engine.reasoning.self_consistency import ReasoningResult  # noqa: E402
from rksc_integrations.langchain import (  # noqa: E402
    CACHE_EVENT,
    CGEE_EVENT,
    EARLY_STOP_EVENT,
    REASONER_EVENTS,
    RKSCLLM,
    VOTE_EVENT,
    ChatRKSC,
    MultiBranchReasoner,
    ReasonerOutput,
    RKSCEventCollector,
)
from tests.conftest import loop_turns_while_engine_held  # noqa: E402

QUESTION = "What is 2+3?"
SHOTS = synthetic_problems(2, seed=1)


def first_char(text: str) -> str | None:
    """A tiny random model writes noise; its first character makes a varied but deterministic answer."""
    return text[:1] or None


class CountingVerifier:
    """``fn(question, candidates) -> scores`` that records its calls and favours one answer."""

    def __init__(self, favourite: str | None = None):
        self.calls: list[tuple[str, list[str]]] = []
        self.favourite = favourite

    def __call__(self, question, candidates):
        self.calls.append((question, list(candidates)))
        return [1.0 if c == self.favourite else 0.1 for c in candidates]


class RunRecorder(BaseCallbackHandler):
    def __init__(self):
        self.chain_starts: list[tuple[object, object, str]] = []  # (run_id, parent_run_id, name)
        self.errors: list[BaseException] = []

    def on_chain_start(self, serialized, inputs, *, run_id, parent_run_id=None, **kwargs):
        self.chain_starts.append((run_id, parent_run_id, kwargs.get("name")))

    def on_chain_error(self, error, **kwargs):
        self.errors.append(error)


def make_reasoner(engine, **fields):
    defaults = dict(n=4, max_tokens=8, temperature=1.0, seed=3, answer_extractor=first_char, verifier=CountingVerifier())
    return MultiBranchReasoner(engine=engine, **{**defaults, **fields})


def cache_state(engine):
    stats = engine.stats()
    return stats.cache_bytes, stats.cache_tokens, stats.prefills, stats.prompt_tokens_computed, stats.decode_tokens


def test_invoke_returns_what_engine_reason_returns_for_the_same_seed(engine):
    reasoner = make_reasoner(engine, cgee=CGEEConfig.off())
    out = reasoner.invoke(QUESTION)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.95, seed=3)
    expected = engine.reason(QUESTION, n=4, params=params, prompt=few_shot_messages(QUESTION, []),
                             answer_extractor=first_char, verifier=CountingVerifier(), cgee=CGEEConfig.off())
    assert isinstance(out, ReasonerOutput) and isinstance(out.result, ReasoningResult)
    assert [b.text for b in out.branches] == [b.text for b in expected.branches]
    assert out.answer == expected.answer and str(out) == expected.answer
    assert out.votes == dict(expected.votes) and sum(out.votes.values()) <= 4
    assert list(out.vote_shares) == [a for a, _ in expected.vote_summary.shares]


def test_a_string_a_question_dict_and_prompt_values_are_the_same_input(engine):
    reasoner = make_reasoner(engine, few_shot=SHOTS)
    texts = lambda out: [b.text for b in out.branches]  # noqa: E731
    baseline = reasoner.invoke(QUESTION)
    assert texts(reasoner.invoke({"question": QUESTION})) == texts(baseline)
    assert texts(reasoner.invoke(StringPromptValue(text=QUESTION))) == texts(baseline)
    # Chat prompts carry the system message and the question; the field's shots go between them.
    messages = few_shot_messages(QUESTION, [])
    template = ChatPromptTemplate.from_messages([(m["role"].replace("user", "human"),
                                                  m["content"].replace("{", "{{").replace("}", "}}"))
                                                 for m in messages])
    chat_value = template.invoke({})
    assert isinstance(chat_value, ChatPromptValue)
    from_chat = reasoner.invoke(chat_value)
    assert texts(from_chat) == texts(baseline) and from_chat.question == QUESTION
    assert texts(reasoner.invoke({"messages": messages})) == texts(baseline)
    full = few_shot_messages(QUESTION, SHOTS)  # a prompt that already holds its shots: none from the field
    assert texts(reasoner.invoke({"messages": full, "few_shot": []})) == texts(baseline)
    # A per-input few_shot overrides the field.
    zero_shot = make_reasoner(engine).invoke(QUESTION)
    assert texts(reasoner.invoke({"question": QUESTION, "few_shot": []})) == texts(zero_shot) != texts(baseline)


def test_the_output_serialises_to_json_without_the_engine_result(engine):
    out = make_reasoner(engine).invoke(QUESTION)
    dumped = out.model_dump()
    assert "result" not in dumped
    assert json.loads(json.dumps(dumped))["answer"] == out.answer
    assert set(dumped) == {"question", "answer", "votes", "vote_shares", "branches", "cgee", "cache", "early_stop",
                           "generate_s"}


def test_vote_cgee_and_cache_events_reach_a_callback_handler_under_the_reasoners_run(engine):
    collector, runs = RKSCEventCollector(), RunRecorder()
    out = make_reasoner(engine, cgee=CGEEConfig.off()).invoke(QUESTION, config={"callbacks": [collector, runs]})
    assert [e.name for e in collector.events] == [VOTE_EVENT, CGEE_EVENT, CACHE_EVENT]
    reasoner_run = runs.chain_starts[0][0]
    assert all(e.run_id == reasoner_run for e in collector.events)
    vote, cgee, cache = (e.data for e in collector.events)
    assert vote["votes"] == out.votes and vote["answer"] == out.answer and vote["num_branches"] == 4
    assert cgee == out.cgee.model_dump() and cgee["skipped"] is False
    assert cache == {**out.cache.model_dump(), "num_generations": 4}
    json.dumps([e.data for e in collector.events])  # JSON-serialisable, as tracers need


def test_a_confident_vote_skips_the_verifier_and_the_event_says_why(engine):
    verifier = CountingVerifier()
    collector = RKSCEventCollector()
    out = make_reasoner(engine, verifier=verifier, cgee=CGEEConfig(tau_conf=0.0, margin=0.0)).invoke(
        QUESTION, config={"callbacks": [collector]})
    assert out.cgee.skipped and verifier.calls == []
    assert out.answer == out.result.vote_summary.winner
    (decision,) = collector.data(CGEE_EVENT)
    assert decision["skipped"] is True and "tau_conf" in decision["reason"] and decision["scores"] == {}


def test_without_skipping_the_verifier_scores_every_candidate_and_its_scores_pick_the_answer(engine):
    reasoner = make_reasoner(engine, n=6, cgee=CGEEConfig.off())
    candidates = list(reasoner.invoke(QUESTION).vote_shares)
    assert len(candidates) >= 2, "the seeded branches should disagree"
    underdog = candidates[-1]
    verifier = CountingVerifier(favourite=underdog)
    out = make_reasoner(engine, n=6, cgee=CGEEConfig.off(), verifier=verifier).invoke(QUESTION)
    assert verifier.calls == [(QUESTION, candidates)]
    assert out.cgee.scores == {c: (1.0 if c == underdog else 0.1) for c in candidates}
    shares = out.vote_shares
    assert out.answer == max(candidates, key=lambda c: shares[c] * out.cgee.scores[c])


def test_a_runnable_verifier_gets_question_and_candidates_and_runs_as_a_child_run(engine):
    seen = []

    def score(payload):
        seen.append(payload)
        return [0.5] * len(payload["candidates"])

    runs = RunRecorder()
    verifier = RunnableLambda(score, name="my_verifier")
    out = make_reasoner(engine, verifier=verifier, cgee=CGEEConfig.off()).invoke(QUESTION, config={"callbacks": [runs]})
    assert seen == [{"question": QUESTION, "candidates": list(out.vote_shares)}]
    reasoner_run = runs.chain_starts[0][0]
    assert any(name == "my_verifier" and parent == reasoner_run for _, parent, name in runs.chain_starts)
    assert out.cgee.scores == dict.fromkeys(out.vote_shares, 0.5)


def test_branches_share_one_prefill_and_a_second_question_reuses_the_few_shot_prefix(engine):
    reasoner = make_reasoner(engine, n=4, few_shot=SHOTS)
    first = reasoner.invoke(QUESTION).cache
    assert first.prefills == 1 and first.num_branches == 4
    assert first.prompt_tokens_computed == first.num_prompt_tokens and first.prompt_tokens_reused == 0
    assert first.decode_tokens >= 4
    second_q = "What is 7+8?"
    second = reasoner.invoke(second_q).cache
    ids_a = engine.encode(few_shot_messages(QUESTION, SHOTS))
    ids_b = engine.encode(few_shot_messages(second_q, SHOTS))
    shared = next(i for i, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b)
    assert second.prefills == 1
    assert second.prompt_tokens_reused == shared > 0.5 * second.num_prompt_tokens
    assert second.prompt_tokens_computed == second.num_prompt_tokens - shared


def test_batch_submits_every_input_at_once_with_the_same_results_as_invoke(engine):
    reasoner = make_reasoner(engine, few_shot=SHOTS)
    questions = [QUESTION, "What is 7+8?", "What is 9-4?"]
    engine.reset_stats()
    batched = reasoner.batch(questions)
    assert [o.question for o in batched] == questions
    reused = sorted(o.cache.prompt_tokens_reused for o in batched)
    assert reused[0] == 0 and reused[1] > 0  # the first admitted pays for the shared prefix, the rest reuse it
    assert engine.stats().peak_batch_rows > reasoner.n, "the inputs were not decoded together"
    single = [reasoner.invoke(q) for q in questions]
    assert [[b.text for b in o.branches] for o in batched] == [[b.text for b in o.branches] for o in single]
    failed = reasoner.batch([QUESTION, ""], return_exceptions=True)
    assert isinstance(failed[0], ReasonerOutput) and isinstance(failed[1], ValueError)


def test_ainvoke_and_abatch_leave_the_event_loop_free_and_send_the_events(engine):
    reasoner = make_reasoner(engine, max_tokens=48, few_shot=SHOTS)
    expected = [b.text for b in reasoner.invoke(QUESTION).branches]
    collector = RKSCEventCollector()

    async def main():
        out, free = await loop_turns_while_engine_held(
            engine, reasoner.ainvoke(QUESTION, config={"callbacks": [collector]}))
        batched = await reasoner.abatch([QUESTION, "What is 7+8?"])
        return out, batched, free

    out, batched, loop_was_free = asyncio.run(main())
    assert [b.text for b in out.branches] == expected == [b.text for b in batched[0].branches]
    assert loop_was_free, "ainvoke blocked the event loop while it waited for the engine"
    assert [e.name for e in collector.events] == [VOTE_EVENT, CGEE_EVENT, CACHE_EVENT]


def test_astream_events_shows_the_custom_events_and_stream_yields_the_one_result(engine):
    reasoner = make_reasoner(engine)

    async def events():
        return [e async for e in reasoner.astream_events(QUESTION, version="v2")]

    seen = asyncio.run(events())
    custom = [e["name"] for e in seen if e["event"] == "on_custom_event"]
    assert custom == [VOTE_EVENT, CGEE_EVENT, CACHE_EVENT]
    end = [e for e in seen if e["event"] == "on_chain_end"][-1]
    assert isinstance(end["data"]["output"], ReasonerOutput)
    streamed = list(reasoner.stream(QUESTION))
    assert len(streamed) == 1 and [b.text for b in streamed[0].branches] == [b.text for b in reasoner.invoke(QUESTION).branches]

    async def astream():
        return [o async for o in reasoner.astream(QUESTION)]

    assert len(asyncio.run(astream())) == 1


def test_it_composes_between_a_prompt_template_and_a_parser(engine):
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{question}")])
    chain = prompt | make_reasoner(engine) | RunnableLambda(attrgetter("answer"))
    answer = chain.invoke({"question": QUESTION})
    assert answer == make_reasoner(engine).invoke(QUESTION).answer


def test_per_call_options_and_bind_override_fields_and_unknown_ones_raise(engine):
    reasoner = make_reasoner(engine)
    assert len(reasoner.invoke(QUESTION, n=2).branches) == 2
    assert len(reasoner.bind(n=3).invoke(QUESTION).branches) == 3
    assert all(len(engine.tokenizer(b.text)["input_ids"]) <= 3 for b in reasoner.invoke(QUESTION, max_tokens=3).branches)
    assert reasoner.invoke(QUESTION, cgee=CGEEConfig(tau_conf=0.0, margin=0.0)).cgee.skipped
    with pytest.raises(TypeError, match="unexpected keyword argument.*'beams'"):
        reasoner.invoke(QUESTION, beams=2)
    with pytest.raises(ValueError, match="temperature"):
        reasoner.invoke(QUESTION, temperature=-1.0)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        reasoner.invoke(QUESTION, n=0)
    with pytest.raises(TypeError, match="cgee must be a CGEEConfig"):
        reasoner.invoke(QUESTION, cgee={"tau_conf": 0.5})


@pytest.mark.parametrize("bad", [
    None, 123, "", "   ", {"q": QUESTION}, {"question": 5}, {"question": QUESTION, "extra": 1},
    {"question": QUESTION, "few_shot": ["not a problem"]}, {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "system", "content": "no question here"}]},
    ChatPromptValue(messages=[ToolMessage(content="42", tool_call_id="t1")]),
])
def test_bad_input_is_a_clear_error_and_leaves_the_engine_untouched(engine, bad):
    reasoner = make_reasoner(engine, few_shot=SHOTS)
    reasoner.invoke(QUESTION)
    before = cache_state(engine)
    with pytest.raises((TypeError, ValueError)) as info:
        reasoner.invoke(bad)
    assert any(word in str(info.value) for word in ("question", "input", "messages", "content", "Message"))
    assert cache_state(engine) == before
    assert reasoner.invoke(QUESTION).cache.prompt_tokens_reused > 0


def test_a_failing_verifier_surfaces_as_an_error_and_the_engine_stays_usable(engine):
    def broken(question, candidates):
        raise RuntimeError("verifier is down")

    runs = RunRecorder()
    reasoner = make_reasoner(engine, verifier=broken, cgee=CGEEConfig.off())
    with pytest.raises(RuntimeError, match="verifier is down"):
        reasoner.invoke(QUESTION, config={"callbacks": [runs]})
    assert len(runs.errors) == 1
    # The engine is not left held: another thread can generate at once.
    result: list = []
    worker = threading.Thread(target=lambda: result.append(engine.generate("ab", SamplingParams(max_new_tokens=2))))
    worker.start()
    worker.join(timeout=30)
    assert result, "the engine lock was left held after the verifier failed"
    assert make_reasoner(engine).invoke(QUESTION).answer is not None


def test_it_takes_the_settings_set_on_its_llm_as_defaults_and_its_own_arguments_win(engine):
    chat = ChatRKSC(engine=engine, max_tokens=8, temperature=0, stop=["\n"], seed=5)
    with pytest.warns(UserWarning, match="all 8 branches will be the same"):
        reasoner = MultiBranchReasoner(llm=chat, answer_extractor=first_char, verifier=CountingVerifier())
    assert (reasoner.max_new_tokens, reasoner.temperature, reasoner.stop, reasoner.seed) == (8, 0, ["\n"], 5)
    assert reasoner.n == 8 and reasoner.top_p == 0.95, "settings not set on the llm keep the reasoner's defaults"
    with pytest.warns(UserWarning, match="branches will be the same"):  # on every call too
        output = reasoner.invoke(QUESTION)
    assert all(c.num_generated_tokens <= 8 and "\n" not in c.text for c in output.result.completions)
    assert len({c.text for c in output.result.completions}) == 1, "greedy branches should all be the same"
    mine = MultiBranchReasoner(llm=chat, max_tokens=4, temperature=0.9, stop=None)
    assert (mine.max_new_tokens, mine.temperature, mine.stop, mine.seed) == (4, 0.9, None, 5)
    # A LangChain RKSCLLM and a LlamaIndex RKSCLLM (whose branches are the reasoner's n) give theirs too.
    assert MultiBranchReasoner(llm=RKSCLLM(engine=engine, max_tokens=6, n=3, temperature=0.5)).n == 3
    llama_index = pytest.importorskip("rksc_integrations.llama_index")
    from_llama = MultiBranchReasoner(llm=llama_index.RKSCLLM(engine=engine, branches=2, max_new_tokens=7, top_k=4))
    assert (from_llama.n, from_llama.max_new_tokens, from_llama.top_k, from_llama.temperature) == (2, 7, 4, 0.7)


def test_it_is_built_from_a_chat_model_an_llm_or_an_engine_and_rejects_bad_settings(engine):
    assert MultiBranchReasoner(ChatRKSC(engine=engine)).engine is engine
    assert MultiBranchReasoner(llm=RKSCLLM(engine=engine)).engine is engine
    assert MultiBranchReasoner(engine=engine).engine is engine
    with pytest.raises(ValueError, match="at most one of llm, engine and model"):
        MultiBranchReasoner(ChatRKSC(engine=engine), engine=engine)
    with pytest.raises(TypeError, match="llm must be a ChatRKSC or RKSCLLM"):
        MultiBranchReasoner("not a model")
    with pytest.raises(TypeError, match="engine must be an RKSCEngine"):
        MultiBranchReasoner(engine="not an engine")
    for bad in ({"n": 0}, {"top_p": 1.5}, {"answer_extractor": "roman"}, {"verifier": 42}, {"n_branches": 3},
                {"early_stop": "sometimes"}):
        with pytest.raises(ValidationError):
            MultiBranchReasoner(engine=engine, **bad)


def test_the_collector_keeps_rksc_events_or_only_the_names_given(engine):
    everything, only_votes = RKSCEventCollector(), RKSCEventCollector(names=[VOTE_EVENT])
    chain = RunnableLambda(lambda q: q) | make_reasoner(engine)
    chain.invoke(QUESTION, config={"callbacks": [everything, only_votes]})
    assert [e.name for e in everything.events] == [VOTE_EVENT, CGEE_EVENT, CACHE_EVENT]
    assert [e.name for e in only_votes.events] == [VOTE_EVENT]
    everything.clear()
    assert everything.events == []


def test_the_package_exports_exactly_what_all_lists():
    import rksc_integrations.langchain as package

    assert sorted(package.__all__) == sorted(
        name for name in vars(package) if not name.startswith("_") and name.isidentifier()
        and not isinstance(vars(package)[name], type(package))
    )
    assert {"MultiBranchReasoner", "RKSCEventCollector", "ReasonerOutput", "ChatRKSC", "RKSCLLM"} <= set(package.__all__)


def test_configurable_fields_rebuild_the_reasoner_on_the_same_engine(engine):
    from langchain_core.runnables import ConfigurableField

    configurable = make_reasoner(engine).configurable_fields(n=ConfigurableField(id="branches"))
    out = configurable.invoke(QUESTION, config={"configurable": {"branches": 2}})
    assert len(out.branches) == 2 and out.cache.model_name == engine.model_name
    assert [b.text for b in out.branches] == [b.text for b in make_reasoner(engine, n=2).invoke(QUESTION).branches]


# -- early stop ---------------------------------------------------------------------------------------
def first_char_parity(text: str) -> str | None:
    """Two answers from the first character: a vote that is often decided before every branch ends."""
    return None if not text else ("odd" if ord(text[0]) % 2 else "even")


def parity_reasoner(engine, seed, **fields):
    # Stop strings end the branches at different lengths, so some still run when the vote is decided.
    return make_reasoner(engine, n=8, max_tokens=24, temperature=0.5, seed=seed, stop=["a", "o"],
                         answer_extractor=first_char_parity, cgee=CGEEConfig.off(), **fields)


def decided_early(engine):
    """``(seed, output)`` of the first seeded call whose branches the default rule cut short."""
    for seed in range(12):
        out = parity_reasoner(engine, seed).invoke(QUESTION)
        if out.early_stop["branches_cancelled"]:
            return seed, out
    pytest.fail("'decided' never stopped a branch on twelve seeded two-answer votes")


def test_early_stop_none_runs_every_branch_to_its_end_and_reports_nothing(engine):
    collector = RKSCEventCollector()
    seed, _ = decided_early(engine)
    out = parity_reasoner(engine, seed, early_stop=None).invoke(QUESTION, config={"callbacks": [collector]})
    assert out.early_stop is None and out.result.early_stop is None
    assert all(b.finish_reason != "cancelled" and b.voted for b in out.branches), "early_stop=None cancelled a branch"
    assert collector.data(EARLY_STOP_EVENT) == [], "an early-stop event was sent with early stop off"
    per_call = parity_reasoner(engine, seed).invoke(QUESTION, early_stop=None)
    assert per_call.early_stop is None and [b.text for b in per_call.branches] == [b.text for b in out.branches]


def test_decided_stops_branches_that_cannot_change_the_winner_and_reports_what_it_saved(engine):
    seed, _ = decided_early(engine)
    collector = RKSCEventCollector()
    out = parity_reasoner(engine, seed).invoke(QUESTION, config={"callbacks": [collector]})
    full = parity_reasoner(engine, seed, early_stop=None).invoke(QUESTION)
    report = out.early_stop
    assert out.result.vote_summary.winner == full.result.vote_summary.winner, "decided changed the vote's winner"
    assert report == out.result.early_stop.as_dict() and report["branches_launched"] == 8
    cancelled = [i for i, b in enumerate(out.branches) if b.finish_reason == "cancelled"]
    assert [s["branch_index"] for s in report["stopped_by"]] == cancelled
    assert {s["rule"] for s in report["stopped_by"]} == {"decided"} and report["stopped_request_by"] == "decided"
    assert all(not out.branches[i].voted and out.branches[i].answer is None for i in cancelled)
    assert report["decode_tokens"] < full.cache.decode_tokens, "stopping branches saved no decode tokens"
    assert [e.name for e in collector.events] == [EARLY_STOP_EVENT, VOTE_EVENT, CGEE_EVENT, CACHE_EVENT]
    assert collector.data(EARLY_STOP_EVENT) == [{"question": QUESTION, **report}]
    json.dumps(collector.data(EARLY_STOP_EVENT))


def test_ainvoke_passes_early_stop_and_sends_the_early_stop_event(engine):
    seed, expected = decided_early(engine)
    collector = RKSCEventCollector()
    out = asyncio.run(parity_reasoner(engine, seed).ainvoke(QUESTION, config={"callbacks": [collector]}))
    assert out.early_stop == expected.early_stop, "areason stopped other branches than reason"
    assert collector.data(EARLY_STOP_EVENT) == [{"question": QUESTION, **expected.early_stop}]
    off = asyncio.run(parity_reasoner(engine, seed, early_stop=None).ainvoke(QUESTION))
    assert off.early_stop is None and all(b.finish_reason != "cancelled" for b in off.branches)


def test_an_early_stop_config_is_passed_as_is(engine):
    # Any completed line settles a branch: each ends at its first newline, unless it ended before.
    config = EarlyStopConfig(decided=False, answered=AnsweredConfig(pattern=r"."))
    out = make_reasoner(engine, early_stop=config, max_tokens=48).invoke(QUESTION)
    stopped = {s["branch_index"]: s["rule"] for s in out.early_stop["stopped_by"]}
    assert stopped and set(stopped.values()) == {"answered"}, f"'answered' ended no branch: {out.early_stop}"
    assert all(out.branches[i].finish_reason == "cancelled" and out.branches[i].text.endswith("\n") for i in stopped)
    assert out.early_stop["stopped_request_by"] is None
    assert all(b.voted for b in out.branches), "a branch ended by 'answered' still votes"


@pytest.mark.parametrize("bad", ["sometimes", 3, {"decided": True}])
def test_a_bad_early_stop_is_refused_naming_the_field_before_anything_runs(engine, bad):
    with pytest.raises(ValidationError, match="early_stop"):
        make_reasoner(engine, early_stop=bad)
    reasoner = make_reasoner(engine)
    reasoner.invoke(QUESTION)
    before = cache_state(engine)
    with pytest.raises((TypeError, ValueError), match="early_stop must be"):
        reasoner.invoke(QUESTION, early_stop=bad)
    assert cache_state(engine) == before, "a refused early_stop still ran something"


def test_the_early_stop_event_is_one_of_the_reasoner_events():
    assert EARLY_STOP_EVENT == "rksc_early_stop" and EARLY_STOP_EVENT in REASONER_EVENTS
