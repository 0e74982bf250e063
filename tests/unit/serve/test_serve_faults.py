"""``rksc serve`` under fault, on the tiny model over a real loopback server: clients that go away at
random points (streamed or not, free text or JSON answers) cancel their work and leave the others'
answers intact; ``/health`` and ``/metrics`` answer while the engine is held; blocking engine work
runs on the server's bounded pools and stops with its client; an unexpected error is a 500 that
names a request id and nothing else.

Every check is about order and counts: a test holds the engine (``engine.exclusive()``) or waits on
an event to fix what happens first, never on a duration. Timeouts are there only so that a broken
server fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from rksc_engine import SamplingParams  # noqa: E402
from rksc_serve.app import create_app  # noqa: E402
from tests.conftest import serving, wait_until  # noqa: E402

MESSAGES = [{"role": "user", "content": "Pick a colour and a size."}]
PICK_SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                                "size": {"type": "integer", "minimum": 1, "maximum": 9}},
               "required": ["colour", "size"], "additionalProperties": False}
PICK = {"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK_SCHEMA}}
HANG_GUARD_S = 60  # only ever reached when the server is broken
NUM_CLIENTS = 64


@pytest.fixture(scope="module")
def server_url(engine):
    with serving(create_app(engine)) as url:
        yield url


@pytest.fixture(scope="module")
def one_worker_url(engine):
    """A server whose pool for tool turns and JSON answers has one thread, so its calls run in order."""
    with serving(create_app(engine, worker_threads=1)) as url:
        yield url


@pytest.fixture
def loop_waits_for_engine(engine, monkeypatch):
    """The names of threads that waited for the engine lock while running an event loop (a server's):
    the test asserts it stays empty. ``stats()`` tries the lock without waiting, which is allowed."""
    lock = engine.exclusive()
    acquire = lock.acquire
    waits: list[str] = []

    def watched(blocking=True, timeout=-1):
        if blocking:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass
            else:
                waits.append(threading.current_thread().name)
        return acquire(blocking, timeout)

    monkeypatch.setattr(lock, "acquire", watched)
    return waits


@pytest.fixture
def submitted(engine, monkeypatch):
    """Every engine request submitted from here on, as ``(prompt text, handle, submitting thread)``."""
    record = []
    submit = engine.submit

    def recording(prompt, *args, **kwargs):
        handle = submit(prompt, *args, **kwargs)
        token_ids = isinstance(prompt, list) and isinstance(prompt[0], int)
        text = engine.tokenizer.decode(prompt) if token_ids else str(prompt)
        record.append((text, handle, threading.current_thread().name))
        return handle

    monkeypatch.setattr(engine, "submit", recording)
    return record


def open_request(url, path, body):
    """A socket that has sent ``POST path`` with ``body``: closing it is its client going away, at a
    moment the test picks."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def idle(engine):
    stats = engine.stats()
    return stats.running_requests == 0 and stats.waiting_requests == 0


def answer_of(path, body, http):
    """The text of every choice of ``body`` sent to ``path``, whole or streamed (deltas joined)."""
    if not body.get("stream"):
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        return [c["message"]["content"] if "message" in c else c["text"] for c in choices]
    texts: dict[int, str] = {}
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", "the stream was cut short"
    for line in lines[:-1]:
        for choice in json.loads(line[len("data: "):])["choices"]:
            piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    return [texts[i] for i in sorted(texts)]


def fault_workload(seed):
    """``NUM_CLIENTS`` requests (chat and completions, whole and streamed, some with ``n`` seeded
    choices, some JSON answers) and, per client, where it goes away: None (it stays), or the number
    of stream events or ``/metrics`` scrapes it waits for before closing its connection."""
    rng = random.Random(seed)
    workload = []
    for i in range(NUM_CLIENTS):
        max_tokens = rng.choice([4, 8, 12, 16])
        if i % 8 == 5:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Pick {i}."}],
                                                  "response_format": PICK}
        elif i % 4 == 0:
            path, body = "/v1/completions", {"prompt": f"Client {i} says"}
        else:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Client {i}: why?"}]}
        body.update(max_tokens=max_tokens, temperature=0, stream=rng.random() < 0.5)
        if i % 6 == 1:
            body.update(n=2, temperature=0.8, seed=i)
        leaves_after = rng.choice([0, 1, 2, 3]) if rng.random() < 0.3 else None
        workload.append((path, body, leaves_after))
    return workload


# -- the server under fault ------------------------------------------------------------------------
def test_clients_that_go_away_at_random_leave_every_other_answer_whole_while_metrics_are_scraped(
        engine, server_url, loop_waits_for_engine):
    workload = fault_workload(seed=1234)
    staying = [(path, body) for path, body, leaves_after in workload if leaves_after is None]
    assert 0 < len(staying) < NUM_CLIENTS, "the seeded workload must have clients that stay and clients that leave"
    with httpx.Client(base_url=server_url, timeout=HANG_GUARD_S) as http:
        alone = [answer_of(path, {**body, "stream": False}, http) for path, body in staying]

    scrapes: list[int | str] = []  # each scrape's status, or the error it met
    scraped = threading.Condition()
    clients_done = threading.Event()

    def scrape():
        with httpx.Client(base_url=server_url, timeout=HANG_GUARD_S) as http:
            while not clients_done.is_set() and len(scrapes) < 10_000:
                try:
                    response = http.get("/metrics")
                    list(text_string_to_metric_families(response.text))  # it must parse
                    outcome = response.status_code
                except Exception as error:  # noqa: BLE001 - recorded, and the test fails naming it
                    outcome = repr(error)
                with scraped:
                    scrapes.append(outcome)
                    scraped.notify_all()
                clients_done.wait(0.05)  # the scrape interval, not a measurement

    def wait_for_scrapes(count):
        with scraped:
            target = len(scrapes) + count
            assert scraped.wait_for(lambda: len(scrapes) >= target, HANG_GUARD_S), "the scraper stalled"

    def client(path, body, leaves_after):
        if leaves_after is None:
            with httpx.Client(base_url=server_url, timeout=HANG_GUARD_S) as http:
                return answer_of(path, body, http)
        if body["stream"]:  # read some events, then hang up
            with httpx.Client(base_url=server_url, timeout=HANG_GUARD_S) as http, \
                    http.stream("POST", path, json=body) as response:
                for _, _line in zip(range(leaves_after), response.iter_lines()):
                    pass
            return None
        sock = open_request(server_url, path, body)
        try:
            wait_for_scrapes(leaves_after)
        finally:
            sock.close()
        return None

    scraper = threading.Thread(target=scrape, name="test-scraper", daemon=True)
    scraper.start()
    try:
        with ThreadPoolExecutor(NUM_CLIENTS) as pool:
            answers = list(pool.map(lambda job: client(*job), workload))
    finally:
        clients_done.set()
        scraper.join(HANG_GUARD_S)
    served = [answer for answer, (_, _, leaves_after) in zip(answers, workload) if leaves_after is None]
    for (path, body), got, expected in zip(staying, served, alone):
        assert got == expected, f"{path} {body}: a client beside the faults got another answer than alone"
    assert wait_until(lambda: idle(engine), timeout_s=HANG_GUARD_S), "requests of clients that left still run"
    assert scrapes and set(scrapes) == {200}, f"a /metrics scrape failed: {sorted(set(map(str, scrapes)))}"
    assert not loop_waits_for_engine, f"the server's event loop waited for the engine lock: {loop_waits_for_engine}"


def test_health_and_metrics_answer_while_an_exclusive_block_holds_the_engine(engine, server_url, submitted):
    expected = engine.generate("Held", SamplingParams(max_new_tokens=4)).text
    submitted.clear()
    held, release = threading.Event(), threading.Event()

    def hold():
        with engine.exclusive():
            held.set()
            release.wait(2 * HANG_GUARD_S)

    holder = threading.Thread(target=hold, name="test-holder", daemon=True)
    holder.start()
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server_url, timeout=HANG_GUARD_S) as http:
        try:
            assert held.wait(HANG_GUARD_S), "the holder never got the engine"
            queued = pool.submit(answer_of, "/v1/completions", {"prompt": "Held", "max_tokens": 4, "temperature": 0},
                                 http)
            assert wait_until(lambda: len(submitted) == 1, timeout_s=HANG_GUARD_S), \
                "the completion never reached the engine"
            health = http.get("/health")
            metrics = http.get("/metrics")
            answered_while_held = not release.is_set() and holder.is_alive()
        finally:
            release.set()
            holder.join(HANG_GUARD_S)
        assert answered_while_held, "/health and /metrics only answered once the engine was released"
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert metrics.status_code == 200 and "rksc_running_requests" in metrics.text, metrics.text[:300]
        assert queued.result(HANG_GUARD_S) == [expected], "the completion queued behind the block was not answered"


# -- blocking work on the server's own pools ----------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_answer_whose_client_goes_away_cancels_its_engine_call_and_submits_no_more(
        engine, one_worker_url, submitted, stream):
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "response_format": PICK, "stream": stream}
    requests_before = engine.stats().requests
    with engine.exclusive():  # nothing decodes: the answer's first value call waits in the queue
        sock = open_request(one_worker_url, "/v1/chat/completions", body)
        try:
            assert wait_until(lambda: len(submitted) == 1, timeout_s=HANG_GUARD_S), "no value call was submitted"
        finally:
            sock.close()
        _, first_call, _ = submitted[0]
        assert wait_until(lambda: first_call.cancelled, timeout_s=HANG_GUARD_S), \
            "the client went away but its engine call was not cancelled"
    assert wait_until(lambda: idle(engine), timeout_s=HANG_GUARD_S)
    # The pool has one thread and runs calls in order: once this answer is out, the first call has ended.
    with httpx.Client(base_url=one_worker_url, timeout=HANG_GUARD_S) as http:
        other = {"messages": [{"role": "user", "content": "Another pick."}], "max_tokens": 8, "temperature": 0,
                 "response_format": PICK}
        json.loads(answer_of("/v1/chat/completions", other, http)[0])
    gone = [text for text, _, _ in submitted if "Another pick." not in text]
    assert len(gone) == 1, f"the abandoned answer went on submitting value calls: {len(gone)}"
    assert engine.stats().requests - requests_before == len(submitted) - 1, \
        "the cancelled call was admitted, or calls ran that were never submitted"


def test_a_burst_of_json_choices_queues_behind_the_pools_threads_and_answers_as_alone(engine, submitted):
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0.8, "seed": 11, "n": 6, "response_format": PICK}
    with serving(create_app(engine)) as url, httpx.Client(base_url=url, timeout=HANG_GUARD_S) as http:
        alone = answer_of("/v1/chat/completions", body, http)
    submitted.clear()
    with serving(create_app(engine, worker_threads=2)) as url, \
            httpx.Client(base_url=url, timeout=HANG_GUARD_S) as http, ThreadPoolExecutor(1) as pool:
        with engine.exclusive():  # no call can finish, so each of the pool's two threads must submit one
            answer = pool.submit(answer_of, "/v1/chat/completions", body, http)
            assert wait_until(lambda: len(submitted) >= 2, timeout_s=HANG_GUARD_S), \
                "the pool's two threads did not start"
            submitted_while_held = len(submitted)
        choices = answer.result(HANG_GUARD_S)
    assert choices == alone, "a bounded pool changed the answers"
    assert submitted_while_held == 2, f"{submitted_while_held} value calls ran at once on a pool of two threads"
    threads = {thread for _, _, thread in submitted}
    assert len(threads) == 2 and all(t.startswith("rksc-turns") for t in threads), \
        f"the value calls ran on other threads than the pool's two: {sorted(threads)}"


def test_worker_threads_must_be_a_positive_int(engine):
    for bad in (0, -1, True, 2.0, 5000):
        with pytest.raises(ValueError, match="worker_threads"):
            create_app(engine, worker_threads=bad)


# -- errors ------------------------------------------------------------------------------------------
def failing_submit(engine, monkeypatch, secret):
    """Make every request the engine runs fail with ``RuntimeError(secret)`` in its first step."""
    submit = engine.submit

    def boom(rows, logits):
        raise RuntimeError(secret)

    monkeypatch.setattr(engine, "submit", lambda prompt, n=1, params=None, **kw: submit(
        prompt, n, params, **{**kw, "logits_processor": boom}))


def test_a_failed_generation_is_a_500_naming_a_request_id_and_logging_the_error(engine, monkeypatch, caplog):
    secret = "secret detail: /home/alice/private-prompts.txt"
    failing_submit(engine, monkeypatch, secret)
    caplog.set_level(logging.ERROR, logger="rksc_serve")
    client = TestClient(create_app(engine), raise_server_exceptions=False)
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    request_id = response.headers["x-request-id"]
    assert error["type"] == "server_error" and request_id in error["message"], error
    assert "secret" not in response.text and "RuntimeError" not in response.text, "the 500 leaked the exception"
    [record] = [r for r in caplog.records if request_id in r.getMessage()]
    assert record.exc_info and secret in str(record.exc_info[1]), "the server log must hold the exception"

    caplog.clear()
    streamed = {"messages": MESSAGES, "max_tokens": 4, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=streamed) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    error = json.loads(lines[-1][len("data: "):])["error"]
    assert error["type"] == "server_error" and "secret" not in lines[-1], lines[-1]
    assert any(r.exc_info and secret in str(r.exc_info[1]) and r.getMessage().split()[1] in error["message"]
               for r in caplog.records), "the stream's error must name the request id the log has"


def test_an_error_outside_the_engine_is_a_500_without_its_text(engine, monkeypatch):
    def broken_submit(*args, **kwargs):
        raise KeyError("/etc/secret-path")

    monkeypatch.setattr(engine, "submit", broken_submit)
    client = TestClient(create_app(engine), raise_server_exceptions=False)
    response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 500, response.text
    assert "secret-path" not in response.text and "KeyError" not in response.text, "the 500 leaked the exception"
    assert response.headers["x-request-id"] in response.json()["error"]["message"]
