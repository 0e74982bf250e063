"""``RemoteEngine``'s transport against small OpenAI-like apps on a loopback port that misbehave on
purpose: what is sent again and what never is (counted on the server), and what cancelling a call
does to its connection and its worker thread (the disconnect counted on the server).

No assertion reads a clock: each counts what the server saw, and where the client must first get
somewhere it is awaited by a bounded poll (``wait_until``) or a bounded wait on an event."""

from __future__ import annotations

import asyncio
import email.utils
import json
import socket
import subprocess
import sys
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, Response, StreamingResponse  # noqa: E402

from rksc_engine import RemoteEngine, RemoteServerError, RequestCancelled, SamplingParams  # noqa: E402
from tests.conftest import serving, wait_until  # noqa: E402

# The longest any fake server works on one request, in polls of its client (bounded: a test that
# fails must not leave a server thread spinning).
POLL_S, MAX_POLLS = 0.01, 2000
USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _choice(text: str, finish_reason: str | None = None) -> dict:
    return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}


def _answer(text: str, stream: bool) -> Response:
    """A whole answer of ``text``, as a stream when the request asked for one."""
    if not stream:
        return JSONResponse({"choices": [_choice(text, "stop")], "usage": USAGE})

    async def events():
        yield _event({"choices": [_choice(text, "stop")]})
        yield _event({"choices": [], "usage": USAGE})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _counting_app() -> FastAPI:
    app = FastAPI()
    app.state.calls = 0  # requests that reached the endpoint
    app.state.disconnects = 0  # clients that went away before the answer ended
    app.state.started = threading.Event()  # the server is working on a request
    return app


def answering_app(statuses: list[int], headers: dict[str, str] | None = None) -> FastAPI:
    """Answers its first requests with ``statuses`` in turn (with ``headers``), then ``ok``."""
    app = _counting_app()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        app.state.calls += 1
        if app.state.calls <= len(statuses):
            return JSONResponse({"error": {"message": "busy", "type": "server_error"}},
                                status_code=statuses[app.state.calls - 1], headers=headers)
        return _answer("ok", bool(body.get("stream")))

    return app


def generating_app(num_tokens: int, token_s: float = POLL_S) -> FastAPI:
    """Pretends to generate ``num_tokens`` tokens ``t``, one every ``token_s``: a chunk per token when asked to
    stream, else the whole text at the end, so a whole answer is silent for the generation's length.
    A client that goes away stops the generation and is counted."""
    app = _counting_app()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        app.state.calls += 1
        if body.get("stream"):
            return StreamingResponse(_tokens(request), media_type="text/event-stream")
        for _ in range(num_tokens):
            app.state.started.set()
            if await request.is_disconnected():
                app.state.disconnects += 1
                return Response(status_code=499)
            await asyncio.sleep(token_s)
        return _answer("t" * num_tokens, stream=False)

    async def _tokens(request: Request):
        ended = False
        try:
            for _ in range(num_tokens):
                app.state.started.set()
                if await request.is_disconnected():
                    return
                yield _event({"choices": [_choice("t")]})
                await asyncio.sleep(token_s)
            yield _event({"choices": [_choice("", "length")]})
            yield _event({"choices": [], "usage": USAGE})
            yield "data: [DONE]\n\n"
            ended = True
        finally:
            if not ended:
                app.state.disconnects += 1

    return app


def stalling_app(after_first_token: bool) -> FastAPI:
    """Sends nothing (or one token, then nothing) until its client goes away, streamed or not: a
    server busy with a long prefill, or hung."""
    app = _counting_app()

    async def until_the_client_leaves(request: Request) -> None:
        for _ in range(MAX_POLLS):
            if await request.is_disconnected():
                app.state.disconnects += 1
                return
            await asyncio.sleep(POLL_S)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        app.state.calls += 1
        if not (body.get("stream") and after_first_token):
            await until_the_client_leaves(request)
            return Response(status_code=499)

        async def events():
            yield _event({"choices": [_choice("t")]})
            await until_the_client_leaves(request)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def breaking_app() -> FastAPI:
    """Starts a streamed answer, then drops the connection mid-answer (a crashed worker)."""
    app = _counting_app()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        await request.json()
        app.state.calls += 1

        async def events():
            yield _event({"choices": [_choice("t")]})
            raise RuntimeError("the worker died")  # uvicorn drops the connection mid-body

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class CountingTransport(httpx.BaseTransport):
    """httpx's transport, counting each try to send; the first ``refusals`` tries fail to connect."""

    def __init__(self, refusals: int = 0) -> None:
        self.tries = 0
        self._refusals = refusals
        self._transport = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.tries += 1
        if self.tries <= self._refusals:
            raise httpx.ConnectError("connection refused", request=request)
        return self._transport.handle_request(request)

    def close(self) -> None:
        self._transport.close()


def remote_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("rksc-remote")}


def dead_url() -> str:
    with socket.socket() as sock:  # a port nothing listens on: bound, then closed
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


PARAMS = SamplingParams(max_new_tokens=2)


# -- never sent twice ------------------------------------------------------------------------------
def test_a_generation_longer_than_the_timeout_is_streamed_and_sent_once():
    # 150 tokens 10 ms apart: a whole answer is silent for at least 1.5 s, past the timeout; a
    # stream is silent for 10 ms at a time.
    app = generating_app(num_tokens=150)
    with serving(app) as url, RemoteEngine(f"{url}/v1", model="m", timeout=1.0, retry_backoff_s=0) as remote:
        completion = remote.generate("Hello", PARAMS)
    assert completion.text == "t" * 150 and completion.finish_reason == "length"
    assert app.state.calls == 1, f"the server saw the request {app.state.calls} times: it was sent again"


@pytest.mark.parametrize("after_first_token", [False, True], ids=["before-headers", "mid-stream"])
def test_a_server_that_stalls_is_a_timeout_and_is_not_sent_the_request_again(after_first_token):
    app = stalling_app(after_first_token)
    with serving(app) as url, RemoteEngine(f"{url}/v1", model="m", timeout=0.3, retry_backoff_s=0) as remote:
        with pytest.raises(TimeoutError) as raised:
            remote.generate("Hello", PARAMS)
    assert app.state.calls == 1, f"a read timeout was sent again: the server saw {app.state.calls} requests"
    assert "not sent again" in str(raised.value), "the error must say why the call was not tried again"


def test_a_connection_dropped_mid_answer_is_a_connection_error_and_is_not_sent_again():
    app = breaking_app()
    with serving(app) as url, RemoteEngine(f"{url}/v1", model="m", retry_backoff_s=0) as remote:
        with pytest.raises(ConnectionError) as raised:
            remote.generate("Hello", PARAMS)
    assert app.state.calls == 1, f"a dropped answer was sent again: the server saw {app.state.calls} requests"
    assert "broke off" in str(raised.value)


@pytest.mark.parametrize("status", [500, 502, 504])
def test_a_server_error_other_than_503_is_not_sent_again(status):
    app = answering_app([status])
    with serving(app) as url, RemoteEngine(f"{url}/v1", model="m", retry_backoff_s=0) as remote:
        with pytest.raises(RemoteServerError) as raised:
            remote.generate("Hello", PARAMS)
    assert app.state.calls == 1, f"a {status} was sent again: the server saw {app.state.calls} requests"
    assert raised.value.status_code == status and str(status) in str(raised.value)


# -- sent again: what cannot have started ----------------------------------------------------------
@pytest.mark.parametrize("status", [503, 429])
@pytest.mark.parametrize("retry_after", [
    {"Retry-After": "0"},
    {"retry-after-ms": "1"},
    {"Retry-After": email.utils.formatdate(0, usegmt=True)},  # a date long past: at once
], ids=["seconds", "ms", "http-date"])
def test_a_busy_server_is_sent_the_request_again_after_its_retry_after(status, retry_after):
    app = answering_app([status], headers=retry_after)
    # Backoff alone would wait its cap (30 s); the server's Retry-After says at once. The guard is
    # not a measure: the retry comes in milliseconds, or half a minute late.
    with serving(app) as url, RemoteEngine(f"{url}/v1", model="m", retry_backoff_s=3600) as remote:
        completion = remote.submit("Hello", 1, PARAMS).result(timeout=20)[0]
    assert completion.text == "ok" and completion.num_prompt_tokens == 3
    assert app.state.calls == 2, f"the {status} must be sent again exactly once, the server saw {app.state.calls}"


def test_a_busy_server_with_no_retry_after_is_retried_with_backoff_until_the_tries_run_out():
    app = answering_app([503] * 100)
    with serving(app) as url, RemoteEngine(f"{url}/v1", model="m", max_retries=2, retry_backoff_s=0.001) as remote:
        with pytest.raises(RemoteServerError, match="after 3 tries") as raised:
            remote.generate("Hello", PARAMS)
    assert raised.value.status_code == 503 and app.state.calls == 3


def test_a_retry_after_past_the_limit_fails_at_once():
    app = answering_app([503], headers={"Retry-After": "3600"})
    with serving(app) as url, RemoteEngine(f"{url}/v1", model="m", retry_backoff_s=0) as remote:
        with pytest.raises(RemoteServerError) as raised:
            remote.generate("Hello", PARAMS)
    assert app.state.calls == 1, "a server that asks for an hour is not waited for"
    assert "asks to wait 3600 s" in str(raised.value)


def test_a_failed_connect_is_tried_again():
    app = answering_app([])
    transport = CountingTransport(refusals=2)
    with serving(app) as url, RemoteEngine(f"{url}/v1", model="m", retry_backoff_s=0, transport=transport) as remote:
        assert remote.generate("Hello", PARAMS).text == "ok"
    assert (transport.tries, app.state.calls) == (3, 1), "two refused connects, then the one request"


def test_a_dead_url_is_tried_max_retries_times_then_a_connection_error_naming_it():
    url, transport = dead_url(), CountingTransport()
    with RemoteEngine(url, model="m", max_retries=2, retry_backoff_s=0, transport=transport) as remote:
        with pytest.raises(ConnectionError, match=url.removesuffix("/v1")):
            remote.generate("Hello", PARAMS)
    assert transport.tries == 3, f"a refused connect is safe to try again: 3 tries expected, {transport.tries} made"


# -- cancelling ------------------------------------------------------------------------------------
def _cancel_by_handle(remote, app):
    handle = remote.submit("Hello", 1, PARAMS)
    assert app.state.started.wait(30), "the request never reached the server"
    handle.cancel()
    with pytest.raises(RequestCancelled):
        handle.result()


def _cancel_by_task(remote, app):
    async def run():
        task = asyncio.ensure_future(remote.agenerate("Hello", PARAMS))
        assert await asyncio.to_thread(app.state.started.wait, 30), "the request never reached the server"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())


def _cancel_by_leaving_the_stream(remote, app):
    stream = remote.stream("Hello", PARAMS)
    assert next(stream).text == "t"
    stream.close()


def _cancel_by_closing_the_engine(remote, app):
    handle = remote.submit("Hello", 1, PARAMS)
    assert app.state.started.wait(30), "the request never reached the server"
    remote.close()
    with pytest.raises(RequestCancelled):
        handle.result()
    with pytest.raises(RuntimeError, match="closed"):
        remote.submit("Hello", 1, PARAMS)


@pytest.mark.parametrize("cancel", [_cancel_by_handle, _cancel_by_task, _cancel_by_leaving_the_stream,
                                    _cancel_by_closing_the_engine], ids=["handle", "task", "stream", "close"])
def test_cancelling_a_call_closes_its_connection_and_ends_its_worker(cancel):
    app = generating_app(num_tokens=MAX_POLLS)
    threads_before = remote_threads()
    with serving(app) as url, RemoteEngine(f"{url}/v1", model="m", retry_backoff_s=0) as remote:
        cancel(remote, app)
        assert wait_until(lambda: app.state.disconnects == 1), "the server never saw the client go: it generates on"
        assert wait_until(lambda: not remote_threads() - threads_before), (
            f"worker threads outlived the cancelled call: {remote_threads() - threads_before}")
    assert app.state.calls == 1


def test_no_worker_thread_outlives_the_calls_it_ran():
    app = answering_app([])
    threads_before = remote_threads()
    with serving(app) as url, RemoteEngine(f"{url}/v1", model="m", max_concurrency=4) as remote:
        assert [c.text for c in remote.generate_many(["a", "b", "c", "d", "e", "f"], PARAMS)] == ["ok"] * 6
        assert wait_until(lambda: not remote_threads() - threads_before), "idle worker threads were kept"
        assert remote.generate("Hello", PARAMS).text == "ok", "a new call after the workers left is served"


EXIT_WITHOUT_CLOSE = """
import sys
from rksc_engine import RemoteEngine, SamplingParams
remote = RemoteEngine(sys.argv[1], model="m")
handle = remote.submit("Hello", 1, SamplingParams(max_new_tokens=2))
sys.stdin.readline()  # the test says when the request is being generated
"""


def test_an_engine_never_closed_does_not_hold_up_the_interpreters_exit():
    app = generating_app(num_tokens=3 * MAX_POLLS)
    with serving(app) as url:
        process = subprocess.Popen([sys.executable, "-c", EXIT_WITHOUT_CLOSE, f"{url}/v1"], stdin=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            assert app.state.started.wait(120), "the request never reached the server"
            # A guard, not a measure: the exit takes well under a second; a worker that holds it
            # up waits out the whole generation (a minute).
            _, stderr = process.communicate("\n", timeout=15)
        finally:
            process.kill()
            process.wait()
        assert process.returncode == 0, stderr
        assert wait_until(lambda: app.state.disconnects == 1), "the server never saw the exited client go"
