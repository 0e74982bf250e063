"""Reasoning over a server (``RemoteEngine.reason``/``areason``/``tree_search``, branches a client can
end) against two real servers on loopback, each serving the tiny seeded model: ``rksc serve`` (in
process) and ``transformers serve`` (the CLI, a subprocess over a directory the model was saved to,
offline). The same tests run against both; the local engine on the same model is the reference
where the server's sampling allows a comparison (greedy everywhere; seeded samples only on ``rksc
serve``, since ``transformers serve`` seeds one generator shared by every request). What differs
between the servers is what they provide (``capabilities()``): ``transformers serve`` sends no
log-probs, no top log-probs, ignores ``n``, ends streams without ``[DONE]`` and decodes one request
at a time.

No assertion reads a clock; waits on the servers are bounded polls (``wait_until``)."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from rksc_engine import (  # noqa: E402
    CancelToken,
    CGEEConfig,
    RemoteEngine,
    RemoteServerError,
    RequestCancelled,
    SamplingParams,
)
from rksc_engine.reasoning.early_stop import (  # noqa: E402
    AnsweredConfig,
    ConfidenceConfig,
    EarlyStopConfig,
)
from rksc_engine.reasoning.few_shot import few_shot_messages  # noqa: E402
from rksc_engine.reasoning.logprob_judge import LogprobJudgeVerifier  # noqa: E402
from rksc_engine.reasoning.verifier import LLMJudgeVerifier  # noqa: E402
from rksc_engine.results import BranchControl  # noqa: E402
from rksc_serve.app import create_app  # noqa: E402
from tests.conftest import (  # noqa: E402
    engine_hf_greedy,
    save_tiny_model,
    serving,
    transformers_serving,
    wait_until,
)

QUESTION = "What is 2 + 3?"
GREEDY = SamplingParams(max_new_tokens=24)
SAMPLED = SamplingParams(temperature=0.8, max_new_tokens=40, seed=3)
SEARCH_PROMPT = "Q: 2+3?\nA:"
ENDLESS = SamplingParams(max_new_tokens=3000)  # greedy after SEARCH_PROMPT, the tiny model never ends: 3000 tokens


def first_char(text: str) -> str | None:
    """The tiny model states no numbers: a branch's answer here is its first character."""
    return text[:1] or None


def path_scorer(question, paths):
    """A scorer that needs no log-probs: deterministic in the path text."""
    return [(sum(map(ord, path)) % 97) / 97 for path in paths]


@pytest.fixture(scope="module")
def rksc_url(engine):
    with serving(create_app(engine, max_tokens_limit=4096)) as url:
        yield f"{url}/v1"


@pytest.fixture(scope="module")
def transformers_url(tmp_path_factory):
    with transformers_serving(save_tiny_model(tmp_path_factory.mktemp("tiny-model"))) as url:
        yield f"{url}/v1"


@pytest.fixture(params=["rksc", pytest.param("transformers", marks=pytest.mark.slow)])
def served(request):
    """``(server kind, RemoteEngine)`` for each server."""
    url = request.getfixturevalue(f"{request.param}_url")
    with RemoteEngine(url, model="rksc" if request.param == "rksc" else None, timeout=120) as remote:
        yield request.param, remote


# -- what each server provides -------------------------------------------------------------------
def test_the_probe_names_what_each_server_provides(served):
    kind, remote = served
    capabilities = remote.capabilities()
    if kind == "rksc":
        assert (capabilities.logprobs, capabilities.top_logprobs, capabilities.n, capabilities.seed,
                capabilities.cached_tokens, capabilities.done_marker) == (True, True, True, True, True, True)
        assert capabilities.limits() == ()
    else:
        assert (capabilities.logprobs, capabilities.top_logprobs, capabilities.n, capabilities.cached_tokens,
                capabilities.done_marker) == (False, False, False, False, False)
        assert capabilities.seed is not True, "transformers serve seeds one generator that every request draws from"
    assert remote.stats().requests == 0, "the probe's requests are not the caller's"


# -- reason ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("early_stop", [None, "decided"])
def test_greedy_reasoning_over_the_server_is_the_local_engines(engine, served, early_stop):
    kind, remote = served
    kwargs = {"n": 3, "params": GREEDY, "answer_extractor": first_char, "early_stop": early_stop}
    local = engine.reason(QUESTION, **kwargs)
    result = remote.reason(QUESTION, **kwargs)
    assert result.answer == local.answer is not None
    finished = [c for c in result.completions if c.finish_reason != "cancelled"]
    assert finished and all(c.text == local.completions[0].text for c in finished), \
        "a greedy branch over the server must be the local engine's greedy branch"
    assert result.cgee_levels == (1,) and result.verification.skipped, "a unanimous vote skips verification"
    assert (result.server_limits == ()) == (kind == "rksc")
    if kind == "transformers":
        assert any("no log-probs" in line for line in result.server_limits)
        assert all(c.logprobs == () and c.confidence == 1.0 for c in result.completions), \
            "without log-probs every branch weighs 1"


def test_decided_early_stop_keeps_the_full_votes_winner_and_cancels_what_it_no_longer_needs(served):
    kind, remote = served
    kwargs = {"n": 5, "params": SamplingParams(max_new_tokens=30), "answer_extractor": first_char}
    full = remote.reason(QUESTION, early_stop=None, **kwargs)
    remote.reset_stats()
    stopped = remote.reason(QUESTION, early_stop="decided", **kwargs)
    decoded = remote.stats().decode_tokens
    assert stopped.answer == full.answer is not None, "decided is exact: it never changes the vote's winner"
    assert stopped.early_stop is not None and stopped.early_stop.branches_launched == 5
    if kind == "transformers":
        # One request at a time: after three agreeing branches the other two cannot change the
        # count, so their requests are closed before they start.
        assert stopped.early_stop.stopped_request_by == "decided" and stopped.early_stop.branches_cancelled >= 1
        assert decoded < sum(c.num_generated_tokens for c in full.completions), \
            "the cancelled branches must not have been decoded"
    assert all(c.branch_index == i for i, c in enumerate(stopped.completions))


def test_a_clustered_vote_over_the_server_votes_as_the_local_engine(engine, served):
    _, remote = served
    kwargs = {"n": 3, "params": GREEDY, "answer_extractor": first_char, "vote": "cluster"}
    local = engine.reason(QUESTION, **kwargs)
    result = remote.reason(QUESTION, **kwargs)
    assert result.vote is not None and result.vote.method == "cluster"
    assert result.early_stop is None, "decided counts votes per answer: it does not run under a clustered vote"
    assert (result.answer, result.votes) == (local.answer, local.votes)


def test_areason_over_the_server_answers_as_reason(engine, served):
    _, remote = served
    kwargs = {"n": 2, "params": GREEDY, "answer_extractor": first_char}
    result = asyncio.run(remote.areason(QUESTION, **kwargs))
    assert result.answer == engine.reason(QUESTION, **kwargs).answer is not None


def test_the_confidence_rule_runs_where_the_server_sends_log_probs_and_is_refused_where_it_does_not(engine, served):
    kind, remote = served
    rule = EarlyStopConfig(decided=False, confidence=ConfidenceConfig(window_tokens=4, warmup_branches=2,
                                                                      percentile=50))
    kwargs = {"n": 5, "params": SAMPLED, "answer_extractor": first_char, "early_stop": rule}
    if kind == "transformers":
        with pytest.raises(ValueError, match="early_stop.confidence.*sends none"):
            remote.reason(QUESTION, **kwargs)
        assert remote.stats().requests == 0, "refused before anything was sent"
        return
    local = engine.reason(QUESTION, **kwargs)
    result = remote.reason(QUESTION, **kwargs)
    assert [b.voted for b in result.branches] == [b.voted for b in local.branches], \
        "the confidence filter is a property of a branch's tokens: the same branches vote"
    assert result.answer == local.answer


def test_the_answered_rule_ends_each_branch_where_the_local_engine_does(engine, rksc_url):
    rule = EarlyStopConfig(decided=False, answered=AnsweredConfig(pattern=r"\S"))
    kwargs = {"n": 4, "params": SAMPLED, "answer_extractor": first_char}
    with RemoteEngine(rksc_url, model="rksc") as remote:
        local = engine.reason(QUESTION, early_stop=rule, **kwargs)
        result = remote.reason(QUESTION, early_stop=rule, **kwargs)
        full = remote.reason(QUESTION, early_stop=None, **kwargs)
    assert [(c.text, c.finish_reason) for c in result.completions] == \
           [(c.text, c.finish_reason) for c in local.completions], "seeded branches end on the same line"
    assert result.answer == local.answer
    assert result.early_stop.decode_tokens == local.early_stop.decode_tokens
    if result.early_stop.branches_cancelled:
        assert result.early_stop.decode_tokens < sum(c.num_generated_tokens for c in full.completions)


def test_layer_exit_is_refused_over_a_server_before_anything_is_sent(served):
    _, remote = served
    with pytest.raises(ValueError, match="level 2.*hidden states"):
        remote.reason(QUESTION, n=2, params=GREEDY, cgee=CGEEConfig(exit_enabled=True))
    assert remote.stats().requests == 0


def test_a_split_vote_is_verified_by_the_log_prob_judge_or_answered_by_its_winner(served):
    kind, remote = served
    # Every branch a different answer (its index), so no vote is unanimous and CGEE verifies.
    answers = iter(range(1000))
    result = remote.reason(QUESTION, n=3, params=SamplingParams(max_new_tokens=4),
                           answer_extractor=lambda text: str(next(answers)), early_stop=None)
    report = result.verification
    assert not report.skipped and result.cgee_levels == (1,)
    if kind == "rksc":
        assert len(report.scores) == 3 and all(0.0 <= s.score <= 1.0 and s.exit_layer is None for s in report.scores)
    else:
        assert report.scores == [], "no top log-probs: no judge"
        assert result.answer == result.vote_summary.winner
        assert any("top_logprobs" in line for line in result.server_limits)


def test_the_log_prob_judge_scores_as_the_local_judge_when_the_labels_are_listed(engine, rksc_url):
    # Labels from the tiny model's two likeliest first tokens after the judge prompt, so both are
    # among the server's top log-probs; the judge then reads exactly the local judge's softmax.
    judge_prompt = LogprobJudgeVerifier(None).messages(QUESTION, "5")
    ids = engine.encode(judge_prompt)
    with torch.no_grad(), engine.exclusive():
        logits = engine.model(torch.tensor([ids])).logits[0, -1]
    labels = tuple(engine.tokenizer.decode([t]) for t in logits.topk(6).indices.tolist()
                   if engine.tokenizer.decode([t]).strip())[:2]
    candidates = ["5", "6", "seven"]
    local = LLMJudgeVerifier(engine, labels=labels).score(QUESTION, candidates, CGEEConfig())
    with RemoteEngine(rksc_url, model="rksc") as remote:
        served = LogprobJudgeVerifier(remote, labels=labels).score(QUESTION, candidates, CGEEConfig())
    assert [s.answer for s in served] == candidates
    assert [s.score for s in served] == pytest.approx([s.score for s in local], abs=1e-3)


# -- tree search -----------------------------------------------------------------------------------
def test_a_greedy_tree_search_over_the_server_continues_each_path_as_plain_greedy_decoding_does(engine, served):
    _, remote = served
    result = remote.tree_search(QUESTION, prompt=SEARCH_PROMPT, breadth=1, depth=3, scorer=path_scorer,
                                params=SamplingParams(max_new_tokens=10), final_marker=None)
    assert [n.depth for n in result.nodes] == [0, 1, 2, 3] and result.nodes[-1].status == "kept"
    # Each step is the greedy continuation of the prompt and its path's text, cut at the delimiter:
    # what plain transformers decodes from that text (the local search decodes its path from the
    # cache instead, whose rounding can break a near tie the other way).
    path = ""
    for node in result.nodes[1:]:
        expected = engine.tokenizer.decode(engine_hf_greedy(engine, SEARCH_PROMPT + path, 10), skip_special_tokens=True)
        assert node.text == expected.split("\n")[0], f"step {node.depth}"
        path += node.text + ("\n" if node.finish_reason == "stop" else "")
    assert result.text == path
    assert any("RSBCM" in line for line in result.server_limits)


def test_a_sampled_tree_search_with_early_stop_runs_on_both_servers(served):
    kind, remote = served
    kwargs = {"prompt": SEARCH_PROMPT, "breadth": 3, "depth": 2, "early_stop": "length",
              "params": SamplingParams(temperature=0.9, max_new_tokens=12, seed=5)}
    if kind == "transformers":
        with pytest.raises(ValueError, match="scorer='confidence'.*sends none"):
            remote.tree_search(QUESTION, **kwargs)
        with pytest.raises(ValueError, match="scorer='judge'.*sends none"):
            remote.tree_search(QUESTION, scorer="judge", **kwargs)
        kwargs["scorer"] = path_scorer
    result = remote.tree_search(QUESTION, **kwargs)
    totals = result.early_stop
    # Children are nodes: a blank child goes on from its blank text or makes none.
    assert result.nodes[0].status == "expanded" and totals["children_launched"] == len(result.nodes) - 1
    stopped = [n for n in result.nodes if n.status == "stopped"]
    assert len(stopped) == totals["children_stopped"] == totals["stopped_by"]["length"]
    assert all(n.index not in {m.index for m in result.best_path} for n in stopped), "a stopped child is never kept"


@pytest.mark.parametrize("early_stop", [None, EarlyStopConfig(decided=False, confidence=ConfidenceConfig(
    window_tokens=2, warmup_branches=1, percentile=50))], ids=["off", "confidence"])
def test_a_seeded_tree_search_over_rksc_serve_builds_the_local_engines_tree(engine, rksc_url, early_stop):
    kwargs = {"prompt": SEARCH_PROMPT, "breadth": 3, "depth": 2, "early_stop": early_stop,
              "params": SamplingParams(temperature=0.9, max_new_tokens=12, seed=5)}
    local = engine.tree_search(QUESTION, **kwargs)
    with RemoteEngine(rksc_url, model="rksc") as remote:
        result = remote.tree_search(QUESTION, **kwargs)
    # Which children an early-stop rule leaves out is a property of their tokens; where it cut one
    # depends on when the threshold was known, so a stopped child's text is not compared.
    assert [(n.status, n.parent, n.branch_index) for n in result.nodes] == \
           [(n.status, n.parent, n.branch_index) for n in local.nodes]
    assert [n.text for n in result.nodes if n.status != "stopped"] == \
           [n.text for n in local.nodes if n.status != "stopped"], "seeded children make the same tree"
    # A child's request prefills its parent's path where the local search decodes it: the
    # log-probs agree to rounding, not bit for bit.
    assert [n.branch_score for n in result.nodes if n.status != "stopped"] == pytest.approx(
        [n.branch_score for n in local.nodes if n.status != "stopped"], rel=2e-2)
    assert result.answer == local.answer


# -- branches a client can end ---------------------------------------------------------------------
class StopAfter:
    """A monitor that stops branch ``index`` at its ``tokens``-th token and adds ``add`` branches
    when it first sees a token."""

    def __init__(self, index: int, tokens: int, add: int = 0) -> None:
        self.index, self.tokens, self.add = index, tokens, add
        self.seen = []

    def observe(self, events):
        self.seen += [(e.branch_index, e.num_tokens) for e in events]
        stop = frozenset(e.branch_index for e in events if e.branch_index == self.index and e.num_tokens >= self.tokens
                         and e.completion is None)
        add, self.add = self.add, 0
        return BranchControl(stop, add) if stop or add else None


def test_a_stopped_branch_is_closed_on_the_server_and_added_branches_are_seeded_on(engine, rksc_url):
    params = SamplingParams(temperature=0.8, max_new_tokens=3000, seed=21, stop=("\n",))
    monitor = StopAfter(index=1, tokens=5, add=2)
    before = engine.stats().decode_tokens
    with RemoteEngine(rksc_url, model="rksc") as remote:
        completions = remote.submit(QUESTION, 2, params, monitor=monitor, max_branches=4).result(timeout=120)
    assert [c.branch_index for c in completions] == [0, 1, 2, 3]
    stopped = completions[1]
    assert stopped.finish_reason == "cancelled" and stopped.num_generated_tokens == 5
    assert wait_until(lambda: engine.stats().running_requests == 0, timeout_s=60), "the server kept decoding a closed branch"
    assert engine.stats().decode_tokens - before < 3000, "the stopped branch did not run to max_new_tokens"
    local = engine.generate_branches(QUESTION, 4, params)
    for i in (0, 2, 3):
        assert completions[i].text == local[i].text, f"branch {i} is seeded seed + {i}, as locally"
    assert completions[1].text == local[1].text[:len(completions[1].text)]
    assert max(c.num_cached_tokens for c in completions[2:]) > 0, "the server's prefix cache served the prompt"


def test_rksc_serves_prefix_cache_computes_the_prompt_of_a_fanned_out_request_once(engine, rksc_url):
    prompt = "A prompt no other test sends, long enough to be worth caching. " * 4
    before = engine.stats().prompt_tokens_computed
    with RemoteEngine(rksc_url, model="rksc") as remote:
        completions = remote.submit(prompt, 6, SamplingParams(temperature=0.8, max_new_tokens=4, seed=1),
                                    monitor=StopAfter(index=9, tokens=1)).result(timeout=60)
    computed = engine.stats().prompt_tokens_computed - before
    assert computed < 2 * completions[0].num_prompt_tokens, f"six requests of one prompt computed {computed} tokens"
    assert sum(c.num_cached_tokens > 0 for c in completions) == 5, "each Completion reports the server's cached tokens"


def test_a_streamed_monitored_request_streams_each_branch_and_ends_it_with_its_completion(rksc_url):
    with RemoteEngine(rksc_url, model="rksc") as remote:
        chunks = list(remote.submit(QUESTION, 3, SAMPLED, stream=True, monitor=StopAfter(index=9, tokens=1)))
        whole = remote.submit(QUESTION, 3, SAMPLED, monitor=StopAfter(index=9, tokens=1)).result(timeout=60)
    for completion in whole:
        mine = [c for c in chunks if c.branch_index == completion.branch_index]
        assert "".join(c.text for c in mine) == completion.text
        assert [c.completion is not None for c in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].completion.text == completion.text
        assert [lp for c in mine for lp in c.logprobs] == pytest.approx(list(completion.logprobs), abs=1e-6)


def test_cancel_branches_closes_that_branch_and_keeps_the_others(engine, rksc_url):
    params = SamplingParams(temperature=0.8, max_new_tokens=2000, seed=4)  # seeded: 388 and 96 tokens to eos
    submitted, handles = threading.Event(), []

    class CancelAtThree:
        """Asks the handle to cancel branch 0 when its third token is seen: a point in its tokens,
        not in time."""

        def observe(self, events):
            if any(e.branch_index == 0 and e.num_tokens == 3 for e in events):
                assert submitted.wait(30)
                handles[0].cancel_branches([0])

    with RemoteEngine(rksc_url, model="rksc") as remote:
        handles.append(remote.submit(QUESTION, 2, params, monitor=CancelAtThree()))
        submitted.set()
        completions = handles[0].result(timeout=120)
    local = engine.generate_branches(QUESTION, 2, params)
    assert (completions[0].finish_reason, completions[0].num_generated_tokens) == ("cancelled", 3)
    assert completions[0].text == local[0].text[:3]
    assert (completions[1].finish_reason, completions[1].text) == (local[1].finish_reason, local[1].text)
    assert wait_until(lambda: engine.stats().running_requests == 0, timeout_s=60), "the server kept decoding the closed branch"


def test_a_monitor_that_raises_fails_its_request_and_closes_every_branch(engine, rksc_url):
    class Broken:
        def observe(self, events):
            raise RuntimeError("broken monitor")

    with RemoteEngine(rksc_url, model="rksc") as remote:
        with pytest.raises(RuntimeError, match="broken monitor"):
            remote.submit(QUESTION, 3, SamplingParams(max_new_tokens=3000), monitor=Broken()).result(timeout=60)
    assert wait_until(lambda: engine.stats().running_requests == 0, timeout_s=60)


def test_the_monitor_sees_every_token_with_its_log_prob_and_the_last_one_carries_the_completion(engine, rksc_url):
    events = []

    class Record:
        def observe(self, batch):
            events.extend(batch)

    with RemoteEngine(rksc_url, model="rksc") as remote:
        [completion] = remote.submit(QUESTION, 1, SAMPLED, monitor=Record()).result(timeout=60)
    [local] = engine.generate_branches(QUESTION, 1, SAMPLED)
    assert [e.num_tokens for e in events] == list(range(1, len(local.token_ids) + 1))
    assert [e.logprob for e in events] == pytest.approx(list(local.logprobs), abs=1e-4)
    assert [e.completion is not None for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1].completion.text == completion.text == local.text
    assert all(e.token_id == -1 for e in events), "a server sends no token ids"


def test_a_server_that_ignores_n_is_named_and_then_fanned_out(engine, served):
    kind, remote = served
    if kind == "rksc":
        assert len(remote.generate_branches(QUESTION, 3, GREEDY)) == 3
        return
    with pytest.raises(RemoteServerError, match="answered choices \\[0\\] for n=3.*ignores n"):
        remote.generate_branches(QUESTION, 3, GREEDY)
    assert not remote.capabilities().n
    branches = remote.generate_branches(QUESTION, 3, GREEDY)  # now one request per branch
    assert [c.branch_index for c in branches] == [0, 1, 2]
    assert {c.text for c in branches} == {engine.generate(QUESTION, GREEDY).text}


def test_few_shot_prompts_reach_the_server_as_chat_messages(engine, served):
    _, remote = served
    messages = few_shot_messages(QUESTION, [])
    assert re.fullmatch(r".+", remote.generate(messages, SamplingParams(max_new_tokens=3)).text or "x", re.S)
    kwargs = {"n": 2, "params": GREEDY, "prompt": messages, "answer_extractor": first_char}
    assert remote.reason(QUESTION, **kwargs).answer == engine.reason(QUESTION, **kwargs).answer


# -- cancellation ----------------------------------------------------------------------------------
def cancel_once_running(engine, token, count: int = 1) -> threading.Thread:
    """Cancel ``token`` once the server runs ``count`` requests: a point in the work, not in time."""
    def run():
        assert wait_until(lambda: engine.stats().running_requests >= count, timeout_s=60), "nothing started"
        token.cancel()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("early_stop", [None, "decided"])
def test_a_cancel_token_ends_reasoning_over_the_server_and_closes_its_branches(engine, rksc_url, early_stop):
    token = CancelToken()
    before = engine.stats().decode_tokens
    with RemoteEngine(rksc_url, model="rksc") as remote:
        remote.capabilities()
        thread = cancel_once_running(engine, token)
        with pytest.raises(RequestCancelled, match="CancelToken"):
            remote.reason(QUESTION, n=3, params=ENDLESS, prompt=SEARCH_PROMPT, answer_extractor=lambda text: None,
                          early_stop=early_stop, cancel=token)
        thread.join()
    assert wait_until(lambda: engine.stats().running_requests == 0, timeout_s=60), "the server kept decoding"
    assert engine.stats().decode_tokens - before < 3 * 3000, "the branches ran to max_new_tokens"


def test_a_cancel_token_ends_a_tree_search_over_the_server_and_closes_its_level(engine, rksc_url):
    token = CancelToken()
    before = engine.stats().decode_tokens
    with RemoteEngine(rksc_url, model="rksc") as remote:
        remote.capabilities()
        thread = cancel_once_running(engine, token)
        with pytest.raises(RequestCancelled, match="after 0 finished levels"):
            remote.tree_search(QUESTION, prompt=SEARCH_PROMPT, breadth=1, depth=4, step_delimiter="\x00",
                               scorer=path_scorer, params=ENDLESS, cancel=token)
        thread.join()
    assert wait_until(lambda: engine.stats().running_requests == 0, timeout_s=60), "the server kept decoding"
    assert engine.stats().decode_tokens - before < 3000


def test_a_request_that_is_not_streamed_queues_no_chunks_as_a_local_one(engine, rksc_url):
    # result() waits for news on the request's channel: a chunk nobody takes would be news at once,
    # and the wait would spin, starving the threads that read the server's streams.
    params = SamplingParams(temperature=0.8, max_new_tokens=8, seed=6)
    assert list(engine.submit(QUESTION, 2, params)) == [], "the local engine's reference"
    with RemoteEngine(rksc_url, model="rksc") as remote:
        assert list(remote.submit(QUESTION, 2, params)) == []
        assert list(remote.submit(QUESTION, 2, params, monitor=StopAfter(index=0, tokens=2))) == []
