"""Reasoning over a server that misbehaves: a real ``rksc serve`` (the tiny model, in process) behind a
small loopback proxy that changes its answers on purpose, one fault at a time: it sends no
log-probs, ignores ``seed``, breaks a stream off, answers fewer choices than ``n``, ends streams
without ``[DONE]``, sends a usage per choice (as llama.cpp's server does). Each fault is named: a clear error, or a documented fallback that the result
says it took (``ServerCapabilities``, ``ReasoningResult.server_limits``).

(``transformers serve`` has several of these faults of its own: ``test_remote_reasoning.py`` runs
the same reasoning against it.) No assertion reads a clock."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, Response, StreamingResponse  # noqa: E402

from rksc_engine import RemoteEngine, RemoteServerError, SamplingParams  # noqa: E402
from rksc_serve.app import create_app  # noqa: E402
from tests.conftest import serving, wait_until  # noqa: E402

QUESTION = "What is 2 + 3?"
GREEDY = SamplingParams(max_new_tokens=20)


def first_char(text: str) -> str | None:
    return text[:1] or None


def proxy_app(upstream: str, *, rewrite_request: Callable[[dict], dict] | None = None,
              rewrite_event: Callable[[dict], dict | list[dict] | None] | None = None,
              cut_after: Callable[[dict], int | None] | None = None, send_done: bool = True) -> FastAPI:
    """Forward ``/v1`` to ``upstream``, changing the request body (``rewrite_request``), each
    streamed event (``rewrite_event``; None drops it, a list is sent event by event), ending the stream after the number of events
    ``cut_after(body)`` names (no finish, no ``[DONE]``), or leaving out ``[DONE]``."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> Response:
        async with httpx.AsyncClient() as client:
            answer = await client.get(f"{upstream}/v1/models")
        return JSONResponse(answer.json(), status_code=answer.status_code)

    @app.post("/v1/{path:path}")
    async def forward(path: str, request: Request) -> Response:
        body = await request.json()
        limit = cut_after(body) if cut_after is not None else None
        if rewrite_request is not None:
            body = rewrite_request(body)
        client = httpx.AsyncClient(timeout=60)
        answer = await client.send(client.build_request("POST", f"{upstream}/v1/{path}", json=body), stream=True)
        if answer.status_code >= 400 or not answer.headers.get("content-type", "").startswith("text/event-stream"):
            await answer.aread()
            await client.aclose()
            return Response(answer.content, status_code=answer.status_code, media_type="application/json")

        async def events():
            sent = 0
            try:
                async for line in answer.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        if send_done:
                            yield "data: [DONE]\n\n"
                        return
                    event = json.loads(data)
                    if rewrite_event is not None:
                        event = rewrite_event(event)
                    for out in event if isinstance(event, list) else [] if event is None else [event]:
                        if limit is not None and sent >= limit:
                            return  # the stream just ends: no finish_reason, no [DONE]
                        sent += 1
                        yield f"data: {json.dumps(out)}\n\n"
            finally:
                await answer.aclose()
                await client.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def without_logprobs(event: dict) -> dict:
    for choice in event.get("choices") or []:
        choice["logprobs"] = None
    return event


def without_seed(body: dict) -> dict:
    body.pop("seed", None)
    return body


def first_choice_only(event: dict) -> dict | None:
    event["choices"] = [c for c in event.get("choices") or [] if c.get("index", 0) == 0]
    return event if event["choices"] or event.get("usage") else None


def usage_per_choice_of_three(event: dict) -> dict | list[dict]:
    """llama.cpp's server's way with a request of ``n = 3``: a usage-only chunk per choice, each
    counting that choice's tokens (here the request's split unevenly in three) and the shared prompt."""
    usage = event.get("usage")
    if event.get("choices") or not usage:
        return event
    total = usage["completion_tokens"]
    shares = [1, total - 2, 1]
    return [{**event, "usage": {**usage, "completion_tokens": share, "total_tokens": usage["prompt_tokens"] + share}}
            for share in shares]


@pytest.fixture(scope="module")
def upstream(engine):
    with serving(create_app(engine, max_tokens_limit=4096)) as url:
        yield url


def behind(upstream: str, **faults):
    """A ``RemoteEngine`` over ``rksc serve`` behind a proxy with ``faults``, as a context manager."""
    import contextlib

    @contextlib.contextmanager
    def run():
        with serving(proxy_app(upstream, **faults)) as url, RemoteEngine(f"{url}/v1", model="rksc") as remote:
            yield remote

    return run()


def test_a_server_without_log_probs_gets_a_count_vote_and_the_rules_that_need_them_are_refused(engine, upstream):
    with behind(upstream, rewrite_event=without_logprobs) as remote:
        capabilities = remote.capabilities()
        assert not capabilities.logprobs and not capabilities.top_logprobs and capabilities.n
        result = remote.reason(QUESTION, n=4, params=GREEDY, answer_extractor=first_char)
        assert result.answer == engine.reason(QUESTION, n=4, params=GREEDY, answer_extractor=first_char).answer
        assert all(c.logprobs == () and c.confidence == 1.0 for c in result.completions)
        assert result.vote_summary.p == 1.0, "every branch weighs 1: the shares are counts"
        assert any("no log-probs" in line for line in result.server_limits)
        with pytest.raises(ValueError, match="early_stop.confidence"):
            remote.reason(QUESTION, n=4, params=GREEDY, early_stop="confidence")
        with pytest.raises(ValueError, match="scorer='confidence'"):
            remote.tree_search(QUESTION, prompt="Q: 2+3?\nA:", breadth=1, depth=1, params=GREEDY)


def test_a_monitor_over_a_server_without_log_probs_counts_one_token_per_delta(upstream):
    seen = []

    class Record:
        def observe(self, events):
            seen.extend(events)

    with behind(upstream, rewrite_event=without_logprobs) as remote:
        [completion] = remote.submit(QUESTION, 1, GREEDY, monitor=Record()).result(timeout=60)
    assert [e.logprob for e in seen] == [0.0] * len(seen), "an unknown log-prob reads as 0.0"
    assert seen[-1].completion == completion and seen[-1].num_tokens == len(seen)
    assert completion.num_reported_tokens == 20, "the usage's count"


def test_a_server_that_ignores_seed_is_named_in_the_result(upstream):
    with behind(upstream, rewrite_request=without_seed) as remote:
        assert remote.capabilities().seed is False
        result = remote.reason(QUESTION, n=2, params=SamplingParams(temperature=0.8, max_new_tokens=8, seed=1),
                               answer_extractor=first_char, early_stop=None)
        assert any("seed" in line for line in result.server_limits), result.server_limits


def test_a_stream_that_breaks_off_fails_the_request_and_closes_the_other_branches(engine, upstream):
    long_requests = {"cut_after": lambda body: 3 if body.get("max_tokens", 0) >= 500 else None}
    with behind(upstream, **long_requests) as remote:
        remote.capabilities()  # short requests: answered whole
        with pytest.raises(ConnectionError, match="ended before 'data: \\[DONE\\]' with a choice unfinished"):
            remote.reason(QUESTION, n=3, params=SamplingParams(temperature=0.8, max_new_tokens=600, seed=0),
                          answer_extractor=first_char)
        with pytest.raises(ConnectionError, match="unfinished"):
            remote.generate(QUESTION, SamplingParams(max_new_tokens=600))
    assert wait_until(lambda: engine.stats().running_requests == 0, timeout_s=60), "the other branches were left decoding"


def test_a_server_that_answers_fewer_choices_is_an_error_until_it_is_known_then_fanned_out(upstream):
    with behind(upstream, rewrite_event=first_choice_only) as remote:
        with pytest.raises(RemoteServerError, match="choices \\[0\\] for n=3.*ignores n"):
            remote.generate_branches(QUESTION, 3, GREEDY)
        assert remote.capabilities().n is False
        assert [c.branch_index for c in remote.generate_branches(QUESTION, 3, GREEDY)] == [0, 1, 2]


def test_a_stream_without_done_that_finished_every_choice_is_accepted(engine, upstream):
    with behind(upstream, send_done=False) as remote:
        assert remote.capabilities().done_marker is False
        assert remote.generate(QUESTION, GREEDY).text == engine.generate(QUESTION, GREEDY).text


def test_a_server_that_sends_a_usage_per_choice_has_their_tokens_added_up(upstream):
    params = SamplingParams(temperature=0.8, max_new_tokens=12, seed=3)
    with behind(upstream) as one_usage:
        expected = one_usage.generate_branches(QUESTION, 3, params)
        counted = one_usage.stats()
    with behind(upstream, rewrite_event=usage_per_choice_of_three) as usage_per_choice:
        completions = usage_per_choice.generate_branches(QUESTION, 3, params)
        stats = usage_per_choice.stats()
    assert [c.text for c in completions] == [c.text for c in expected], "seeded branches: the same tokens"
    assert counted.decode_tokens >= 3
    assert stats.decode_tokens == counted.decode_tokens, "the choices' usages were not added up"
    assert (stats.prompt_tokens_computed + stats.prompt_tokens_reused
            == counted.prompt_tokens_computed + counted.prompt_tokens_reused), "the shared prompt counts once"
    assert stats.requests == counted.requests == 1
