"""``rksc serve`` against clients that misbehave, on tiny models over real loopback servers: prompts far
over the context window, a client gone in the middle of its upload, a tree search its client
abandoned, and Ctrl-C with such a search in flight. No client may stall or mislead the others.

Every check is about order and counts; timeouts only turn a broken server's hang into a failure.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import asyncio  # noqa: E402

import httpx  # noqa: E402
import torch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from rksc_engine import CancelToken, RequestCancelled, RKSCEngine, SamplingParams  # noqa: E402
from rksc_serve.app import create_app  # noqa: E402
from tests.conftest import (  # noqa: E402
    make_byte_tokenizer,
    make_tiny_engine,
    make_tiny_model,
    serving,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[3]
HANG_GUARD_S = 60  # only ever reached when the server is broken
WINDOW = 4096
EOS = 1


class WatchedTokenizer(PreTrainedTokenizerFast):
    """Calls ``while_encoding(text)`` (when set) before encoding each text, on whichever thread encodes."""

    while_encoding = None

    def _encode_plus(self, text, *args, **kwargs):
        if self.while_encoding is not None and isinstance(text, str):
            self.while_encoding(text)
        return super()._encode_plus(text, *args, **kwargs)


class StreamCounter:
    """Events one streaming client has received so far, for other threads to wait on."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.events = 0
        self.ended = False

    def add(self) -> None:
        with self.cv:
            self.events += 1
            self.cv.notify_all()

    def end(self) -> None:
        with self.cv:
            self.ended = True
            self.cv.notify_all()

    def wait_for(self, events: int) -> bool:
        """Whether the stream reached ``events`` events (False when it ended first, or on the guard)."""
        with self.cv:
            return self.cv.wait_for(lambda: self.events >= events or self.ended, HANG_GUARD_S) and self.events >= events


class Gate:
    """A logits processor that holds the scheduler's step on its first call until released."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, _ids, logits):
        self.entered.set()
        assert self.release.wait(HANG_GUARD_S), "the test never released the gate"
        return logits


def never_eos(_ids, logits):
    return logits.index_fill(-1, torch.tensor([EOS], device=logits.device), float("-inf"))


def http_requests(url: str, path: str) -> dict[str, float]:
    """``rksc_http_requests_total`` for ``path``, by status."""
    counts = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=HANG_GUARD_S).text):
        for sample in family.samples:
            if sample.name == "rksc_http_requests_total" and sample.labels["path"] == path:
                counts[sample.labels["status"]] = sample.value
    return counts


def open_request(url: str, path: str, body: dict) -> socket.socket:
    """A socket that has sent ``POST path`` with ``body``: closing it is its client going away."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


# -- oversized prompts ------------------------------------------------------------------------------
def test_oversized_prompts_are_refused_while_another_clients_stream_keeps_receiving_events(monkeypatch):
    tokenizer = make_byte_tokenizer(WatchedTokenizer)
    engine = RKSCEngine(make_tiny_model(vocab_size=len(tokenizer), max_positions=WINDOW), tokenizer)
    streamer_prompt = "The other client's story:"
    submit = engine.submit

    def submitting(prompt, *args, **kwargs):
        if prompt == streamer_prompt:  # the streaming client never stops on its own: it is closed at the end
            kwargs["logits_processor"] = never_eos
        return submit(prompt, *args, **kwargs)

    monkeypatch.setattr(engine, "submit", submitting)
    # Far over the character bound (a token of this tokenizer covers at most 5 characters): the
    # tokenizer must never see these. Within the bound but over the window: tokenized, then refused.
    over_bound, over_window = "a" * 900_000, "a" * (WINDOW + 100)
    stream = StreamCounter()
    encoded_lengths: list[int] = []
    arrived_while_encoding: list[int] = []  # the stream's new events while each long text was encoded

    def while_encoding(text: str) -> None:
        if len(text) < WINDOW:
            return
        encoded_lengths.append(len(text))
        before = stream.events
        # Encoding on the event loop would stop every stream: these events could never arrive.
        stream.wait_for(before + 2)
        arrived_while_encoding.append(stream.events - before)

    tokenizer.while_encoding = while_encoding
    stop_streaming = threading.Event()

    with serving(create_app(engine, max_tokens_limit=WINDOW)) as url:
        def streamer() -> None:
            body = {"prompt": streamer_prompt, "max_tokens": WINDOW - 64, "temperature": 0, "stream": True}
            try:
                with httpx.Client(base_url=url, timeout=HANG_GUARD_S) as http, \
                        http.stream("POST", "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            stream.add()
                        if stop_streaming.is_set():
                            break
            finally:
                stream.end()

        thread = threading.Thread(target=streamer, name="test-streamer")
        thread.start()
        try:
            assert stream.wait_for(3), "the streaming client never got going"
            answers = []
            with httpx.Client(base_url=url, timeout=HANG_GUARD_S) as http:
                for prompt in [over_bound, over_window, over_bound, over_window, over_bound]:
                    answers.append(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}))
            still_streaming = not stream.ended
        finally:
            stop_streaming.set()
            thread.join(HANG_GUARD_S)
    for answer in answers:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "prompt" and "context window" in error["message"], error
    assert still_streaming, "the streaming client finished before the oversized prompts were refused"
    assert encoded_lengths == [len(over_window)] * 2, \
        f"texts over the character bound reached the tokenizer: lengths {encoded_lengths}"
    assert len(arrived_while_encoding) == 2 and all(n >= 2 for n in arrived_while_encoding), \
        f"the other client's stream stalled while a long prompt was encoded: {arrived_while_encoding} new events"


# -- a client gone mid-upload -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server_url(engine):
    with serving(create_app(engine)) as url:
        yield url


def test_a_client_gone_mid_upload_is_a_499_and_one_info_line_not_an_internal_error(server_url, caplog):
    caplog.set_level(logging.INFO, logger="rksc_serve.app")
    path = "/v1/completions"
    before = http_requests(server_url, path)
    host, port = server_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     "Content-Length: 1000\r\n\r\n".encode() + b'{"prompt": "only half of the bo')
    # The socket is closed: the server reads the rest of the body and finds the client gone.
    assert wait_until(lambda: sum(http_requests(server_url, path).values()) > sum(before.values()),
                      timeout_s=HANG_GUARD_S), "the abandoned upload was never answered"
    after = http_requests(server_url, path)
    assert after.get("499", 0) - before.get("499", 0) == 1, after
    assert after.get("500", 0) == before.get("500", 0), f"a client's disconnect was counted as a server error: {after}"
    records = [r for r in caplog.records if r.name == "rksc_serve.app"]
    assert not [r for r in records if r.levelno >= logging.WARNING], \
        f"a client's disconnect was logged as an error: {[r.getMessage() for r in records]}"
    gone = [r for r in records if "went away while sending its request" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO and gone[0].exc_info is None


# -- abandoned tree searches ------------------------------------------------------------------------
SEARCH_BODY = {"question": "What is 2+3?", "messages": [{"role": "user", "content": "What is 2+3?"}],
               "breadth": 2, "depth": 16, "max_tokens": 24, "temperature": 0.9, "seed": 0, "step_delimiter": "@@@"}


@pytest.fixture
def gated_engine(monkeypatch):
    """A fresh tiny engine whose first submitted request holds the scheduler's step (``engine.gate``),
    and which records every request submitted (``engine.submits``)."""
    engine = make_tiny_engine(max_positions=WINDOW)
    engine_submit = engine.submit
    gate, submits = Gate(), []

    def submit(prompt, *args, **kwargs):
        if not submits:
            kwargs["logits_processor"] = gate
        handle = engine_submit(prompt, *args, **kwargs)
        submits.append(handle)
        return handle

    monkeypatch.setattr(engine, "submit", submit)
    engine.gate, engine.submits = gate, submits
    yield engine
    gate.release.set()


def test_a_tree_search_whose_client_goes_away_is_cancelled_and_submits_no_more_levels(gated_engine):
    engine = gated_engine
    app = create_app(engine)
    pool = app.state.rksc.search_pool
    with serving(app) as url:
        sock = open_request(url, "/v1/rksc/tree_search", SEARCH_BODY)
        try:
            assert engine.gate.entered.wait(HANG_GUARD_S), "the search never started"
        finally:
            sock.close()
        # The server sees the client go and cancels the search's token, which cancels its level's requests.
        assert wait_until(lambda: engine.submits[0].cancelled, timeout_s=HANG_GUARD_S), \
            "the client went away but the search's requests were not cancelled"
        engine.gate.release.set()
        assert wait_until(lambda: pool.num_running == 0, timeout_s=HANG_GUARD_S), "the abandoned search kept running"
        assert http_requests(url, "/v1/rksc/tree_search") == {"499": 1.0}
    assert len(engine.submits) == 1, f"the abandoned search went on to {len(engine.submits)} levels"
    assert wait_until(lambda: engine.stats().running_requests == 0, timeout_s=HANG_GUARD_S)
    engine.prefix_cache.check_consistency()


def test_shutting_the_server_down_cancels_a_running_search_and_waits_for_its_thread(gated_engine):
    engine = gated_engine
    server = create_app(engine).state.rksc
    token = CancelToken()

    def search():
        return engine.tree_search("What is 2+3?", breadth=2, depth=16, prompt="Q: 2+3?\nA:", cancel=token,
                                  params=SamplingParams(temperature=0.9, max_new_tokens=24, seed=0))

    async def scenario() -> bool:
        running = asyncio.ensure_future(server.search_pool.run(search, on_cancel=token.cancel))
        assert await asyncio.to_thread(engine.gate.entered.wait, HANG_GUARD_S), "the search never started"
        closing = asyncio.ensure_future(asyncio.to_thread(server.close, HANG_GUARD_S))
        assert await asyncio.to_thread(wait_until, lambda: token.cancelled, HANG_GUARD_S), "close() cancelled nothing"
        engine.gate.release.set()  # the step held since the search began may end now
        ended = await closing
        with pytest.raises(RequestCancelled, match="tree search cancelled"):
            await running
        return ended

    assert asyncio.run(scenario()) is True, "close() returned with a pool thread still running"
    assert server.search_pool.num_running == 0
    assert len(engine.submits) == 1, "the cancelled search submitted another level"
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(server.search_pool.run(search))


SIGINT_SERVER = """
import socket, sys, time

import torch
import uvicorn

from rksc_engine import RKSCEngine
from rksc_serve.app import create_app
from tests.conftest import make_char_tokenizer, make_tiny_model

model = make_tiny_model(max_positions=4096)
# A slow model that never ends a path: each forward waits a little and EOS is never picked, so a
# search of 16 levels of 96 tokens runs for minutes unless it is cancelled.
model.model.layers[0].register_forward_hook(lambda *args: time.sleep(0.1))
model.lm_head.register_forward_hook(
    lambda module, args, output: output.index_fill(-1, torch.tensor([1]), float("-inf")))
engine = RKSCEngine(model, make_char_tokenizer())
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
print(sock.getsockname()[1], flush=True)
try:
    uvicorn.Server(uvicorn.Config(create_app(engine), log_level="info")).run(sockets=[sock])
except KeyboardInterrupt:  # uvicorn raises the signal again once it has stopped (uvicorn.run ignores it)
    pass
print("server process exited", flush=True)
"""


@pytest.mark.slow
def test_ctrl_c_stops_the_server_with_an_abandoned_tree_search_in_flight(tmp_path):
    script = tmp_path / "serve_tiny.py"
    script.write_text(SIGINT_SERVER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([process.stdout], [], [], 180)
        assert ready, "the server process did not start"
        url = f"http://127.0.0.1:{int(process.stdout.readline())}"
        assert wait_until(lambda: _answers(url), timeout_s=HANG_GUARD_S)
        body = {**SEARCH_BODY, "max_tokens": 96}
        sock = open_request(url, "/v1/rksc/tree_search", body)
        try:
            assert wait_until(lambda: _engine_gauge(url, "rksc_running_requests") >= 1, timeout_s=HANG_GUARD_S)
        finally:
            sock.close()  # the search is abandoned in flight
        assert wait_until(lambda: http_requests(url, "/v1/rksc/tree_search").get("499") == 1,
                          timeout_s=HANG_GUARD_S)
        process.send_signal(signal.SIGINT)
        try:
            out, err = process.communicate(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            pytest.fail("after Ctrl-C the server process stayed alive with the abandoned search")
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert "server process exited" in out, err
    assert process.returncode == 0, err
    assert "Traceback" not in err, err


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _engine_gauge(url: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=HANG_GUARD_S).text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return 0.0
