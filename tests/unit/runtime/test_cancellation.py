"""A ``CancelToken`` stops a long engine call: a tree search between its levels (its requests in flight
at once), a reasoning call before its verifier pass. A cancelled call raises ``RequestCancelled`` and
leaves the engine exact and its cache consistent. Order decides, never time."""

from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import engine_hf_greedy

from rksc_engine import CancelToken, CGEEConfig, RequestCancelled, RKSCEngine, SamplingParams

PROMPT = "Q: 2+3?\nA:"
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, seed=0)
HANG_GUARD_S = 60


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    return RKSCEngine(tiny_model, tiny_tokenizer)


def tree_signature(result):
    return [(n.parent, n.token_ids, round(n.branch_score, 6), n.status, n.is_final) for n in result.nodes]


def assert_exact_and_consistent(engine, want_greedy):
    with engine.exclusive():  # after the step that dropped the cancelled requests: fresh stats
        stats = engine.stats()
        assert stats.running_requests == 0 and stats.waiting_requests == 0
        cache = engine.prefix_cache
        cache.check_consistency()
        assert cache.evictable_bytes == cache.total_bytes, "a radix node stayed locked after the cancel"
    assert engine.generate("after", SamplingParams(max_new_tokens=8)).token_ids == want_greedy


@pytest.mark.slow
def test_a_tree_search_cancelled_between_levels_stops_there_and_the_engine_stays_exact(engine):
    want = engine_hf_greedy(engine, "after", 8)
    token = CancelToken()
    scored = []

    def scorer(question, paths):
        scored.append(len(paths))
        if len(scored) == 2:
            token.cancel()  # while the second level is scored: the third never starts
        return [0.5] * len(paths)

    with pytest.raises(RequestCancelled, match=r"tree search cancelled .* after 2 finished levels"):
        engine.tree_search("What is 2+3?", breadth=2, depth=6, prompt=PROMPT, params=PARAMS, scorer=scorer,
                           final_marker=None, cancel=token)
    assert len(scored) == 2, "a level ran after the search was cancelled"
    assert_exact_and_consistent(engine, want)
    # The cancelled search's cached steps change nothing: a full search now is a fresh engine's.
    again = engine.tree_search("What is 2+3?", breadth=2, depth=4, prompt=PROMPT, params=PARAMS)
    fresh = RKSCEngine(engine.model, engine.tokenizer).tree_search("What is 2+3?", breadth=2, depth=4, prompt=PROMPT,
                                                                    params=PARAMS)
    assert tree_signature(again) == tree_signature(fresh)


def test_cancelling_a_tree_search_mid_level_cancels_its_requests_at_once(engine, monkeypatch):
    want = engine_hf_greedy(engine, "after", 8)
    token = CancelToken()
    entered, release = threading.Event(), threading.Event()
    calls = {"n": 0}

    def held_on_first_step(_ids, logits):
        calls["n"] += 1
        if calls["n"] == 1:
            entered.set()
            assert release.wait(HANG_GUARD_S)
        return logits

    submit, handles = engine.submit, []

    def submitting(prompt, *args, **kwargs):
        if not handles:
            kwargs["logits_processor"] = held_on_first_step
        handles.append(submit(prompt, *args, **kwargs))
        return handles[-1]

    monkeypatch.setattr(engine, "submit", submitting)
    outcome = []

    def search():
        try:
            engine.tree_search("What is 2+3?", breadth=2, depth=6, prompt=PROMPT, step_delimiter="@@@",
                               final_marker=None, params=SamplingParams(temperature=1.0, max_new_tokens=40, seed=0),
                               cancel=token)
        except RequestCancelled as error:
            outcome.append(error)

    thread = threading.Thread(target=search)
    thread.start()
    assert entered.wait(HANG_GUARD_S), "the search never started"
    token.cancel()  # while the first level decodes its first token
    assert handles[0].cancelled, "cancelling the token did not cancel the level's request"
    release.set()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive()
    assert len(outcome) == 1 and "after 0 finished levels" in str(outcome[0])
    assert len(handles) == 1, "the cancelled search submitted another level"
    assert calls["n"] < 40, f"the cancelled level decoded on for {calls['n']} steps"
    assert_exact_and_consistent(engine, want)


def test_a_cancel_token_that_was_cancelled_before_the_search_stops_it_before_any_request(engine):
    token = CancelToken()
    token.cancel()
    with pytest.raises(RequestCancelled, match="after 0 finished levels"):
        engine.tree_search("What is 2+3?", breadth=2, depth=3, prompt=PROMPT, params=PARAMS, cancel=token)
    assert engine.stats().requests == 0


@pytest.mark.parametrize("bad", ["yes", threading.Event(), 1])
def test_cancel_must_be_a_cancel_token(engine, bad):
    with pytest.raises(TypeError, match="cancel must be a CancelToken"):
        engine.tree_search("What is 2+3?", breadth=2, depth=3, prompt=PROMPT, params=PARAMS, cancel=bad)
    with pytest.raises(TypeError, match="cancel must be a CancelToken"):
        engine.reason("What is 2+3?", n=2, prompt=PROMPT, cancel=bad)
    assert engine.stats().requests == 0


def reasoning_kwargs(extract, verify):
    # CGEE off: the verifier runs whatever the vote; no early stop: every branch runs to its end.
    return {"n": 2, "prompt": PROMPT, "params": PARAMS, "answer_extractor": extract, "verifier": verify,
            "cgee": CGEEConfig.off(), "early_stop": None}


def test_reason_checks_its_token_before_the_verifier_pass(engine):
    want = engine_hf_greedy(engine, "after", 8)
    token, verified = CancelToken(), []

    def extract_then_cancel(text):
        token.cancel()  # the branches are done: cancel between them and the verifier pass
        return "5"

    def verify(question, candidates):
        verified.append(candidates)
        return [1.0] * len(candidates)

    with pytest.raises(RequestCancelled, match="before its verifier pass"):
        engine.reason("What is 2+3?", cancel=token, **reasoning_kwargs(extract_then_cancel, verify))
    token = CancelToken()
    with pytest.raises(RequestCancelled, match="before its verifier pass"):
        asyncio.run(engine.areason("What is 2+3?", cancel=token, **reasoning_kwargs(extract_then_cancel, verify)))
    assert verified == [], "the verifier ran after the call was cancelled"
    assert_exact_and_consistent(engine, want)


def test_cancelling_the_task_awaiting_areason_keeps_its_verifier_pass_from_running(engine):
    verified = []
    extracting, go_on = threading.Event(), threading.Event()

    def extract(text):
        extracting.set()  # in the worker thread, after the branches, before the verifier
        assert go_on.wait(HANG_GUARD_S)
        return "5"

    def verify(question, candidates):
        verified.append(candidates)
        return [1.0] * len(candidates)

    async def scenario():
        task = asyncio.ensure_future(engine.areason("What is 2+3?", **reasoning_kwargs(extract, verify)))
        assert await asyncio.to_thread(extracting.wait, HANG_GUARD_S), "the branches never finished"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go_on.set()

    asyncio.run(scenario())  # returns once the loop's worker threads have ended
    assert verified == [], "the verifier pass ran for a call whose task was cancelled"


def test_a_cancel_token_runs_each_callback_once_and_never_raises_into_the_canceller():
    token, ran = CancelToken(), []

    class Handle:
        def __init__(self, name):
            self.name = name

        def cancel(self):
            ran.append(self.name)
            raise RuntimeError("a broken handle")

    with token.cancelling([Handle("a")]):
        token.cancel()
        token.cancel()
    with token.cancelling([Handle("late")]):  # already cancelled: at once
        pass
    assert ran == ["a", "late"]
    with pytest.raises(RequestCancelled, match="the thing: cancelled"):
        token.raise_if_cancelled("the thing")
