"""MultiBranchReasoner on the real default model: 8 branches over a cached few-shot prefix, voted
and verified by the engine's judge, with its decisions reported through LangChain callbacks."""

from __future__ import annotations

from operator import attrgetter

import pytest

pytest.importorskip("langchain_core")

from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnableLambda  # noqa: E402

from rksc_engine.evaluation.workloads import synthetic_problems  # noqa: E402
from rksc_engine.reasoning.few_shot import SYSTEM_PROMPT, few_shot_messages
from rksc_integrations.langchain import (  # noqa: E402
    CACHE_EVENT,
    CGEE_EVENT,
    EARLY_STOP_EVENT,
    VOTE_EVENT,
    ChatRKSC,
    MultiBranchReasoner,
    RKSCEventCollector,
)

pytestmark = pytest.mark.integration

SHOTS = synthetic_problems(3, seed=1)


def test_eight_branches_over_a_cached_few_shot_prefix_are_voted_verified_and_reported():
    reasoner = MultiBranchReasoner(n=8, seed=0, max_tokens=64, few_shot=SHOTS)  # the embedded default model
    questions = [p.question for p in synthetic_problems(2, seed=7)]
    collector = RKSCEventCollector()
    outputs = reasoner.batch(questions, config={"callbacks": [collector]})  # both submitted at once
    # The two runs finish in either order: group each run's events by its run id, in order.
    runs: dict = {}
    for event in collector.events:
        runs.setdefault(event.run_id, []).append(event)
    assert len(runs) == 2
    by_question = {events[0].data["question"]: events for events in runs.values()}
    num_layers = reasoner.engine.model.config.num_hidden_layers
    for out in outputs:
        events = by_question[out.question]
        # The early-stop event comes first, and only when a rule stopped something ("decided" by default).
        stopped = out.early_stop["branches_cancelled"] or out.early_stop["stopped_request_by"] is not None
        assert [e.name for e in events] == [EARLY_STOP_EVENT] * stopped + [VOTE_EVENT, CGEE_EVENT, CACHE_EVENT]
        vote, cgee, cache = events[-3:]
        assert len(out.branches) == 8
        answered = [b.answer for b in out.branches if b.answer is not None]
        assert len(answered) >= 4, f"most branches should end in a number: {[b.text[-40:] for b in out.branches]}"
        assert out.answer in out.votes and sum(out.votes.values()) == len(answered)
        assert vote.data["votes"] == out.votes and cgee.data == out.cgee.model_dump()
        assert cache.data["num_prompt_tokens"] == out.cache.num_prompt_tokens
        if out.cgee.skipped:
            assert out.cgee.scores == {} and out.answer == out.result.vote_summary.winner
        else:
            assert set(out.cgee.scores) == set(out.votes) and out.cgee.num_layers == num_layers
            assert all(0 <= layer < num_layers for layer in out.cgee.exit_layers.values())
        assert out.cache.prefills <= 2  # one for all eight branches, one for the judge's shared question
    # The question admitted second reuses the few-shot prefix the first one computed.
    ids = [reasoner.engine.encode(few_shot_messages(q, SHOTS)) for q in questions]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert max(o.cache.prompt_tokens_reused for o in outputs) >= shared > 300


def test_prompt_reasoner_parser_composes_and_shares_the_chat_models_engine():
    chat = ChatRKSC()
    reasoner = MultiBranchReasoner(chat, n=4, seed=1, max_tokens=48, few_shot=SHOTS[:1])
    assert reasoner.engine is chat.engine is MultiBranchReasoner().engine  # one shared default engine
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{question}")])
    chain = prompt | reasoner | RunnableLambda(attrgetter("answer"))
    question = "Ava has 3 boxes of 5 pencils. How many pencils does she have?"
    answer = chain.invoke({"question": question})
    assert answer == reasoner.invoke({"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                                   {"role": "user", "content": question}]}).answer
