"""``rksc serve``'s app on the tiny model: OpenAI's endpoints answer what the engine answers, streams
concatenate to the whole text, bad requests are 400s naming the field, and clients that go away
cancel their requests. In-process (``TestClient``) where the wire does not matter, a real uvicorn
server on a loopback port where it does (concurrency, disconnects, the official ``openai`` client)."""

from __future__ import annotations

import json
import logging
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from rksc_engine import RKSCEngine, SamplingParams  # noqa: E402
from rksc_serve.app import create_app  # noqa: E402
from tests.conftest import make_tiny_engine, serving, wait_until  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def client(engine):
    return TestClient(create_app(engine))


@pytest.fixture(scope="module")
def server_url(engine):
    with serving(create_app(engine)) as url:
        yield url


def chat(client, **fields):
    return client.post("/v1/chat/completions", json={"model": "rksc", "messages": MESSAGES, **fields})


def open_request(url, path, body):
    """A socket that has sent ``POST path`` with ``body`` and reads nothing: closing it is a client
    going away, at a moment the test picks (not after a client timeout)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def sse_events(lines):
    """The JSON payloads of a server-sent event stream, and whether it ended with ``[DONE]``."""
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    done = bool(data) and data[-1] == "[DONE]"
    return [json.loads(d) for d in data if d != "[DONE]"], done


# -- answers -------------------------------------------------------------------------------------
def test_a_greedy_chat_completion_is_the_engines_own_answer(client, engine):
    expected = engine.generate(MESSAGES, SamplingParams(max_new_tokens=24))
    response = chat(client, temperature=0, max_tokens=24)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": expected.text}, "served text differs from the engine's"
    assert choice["finish_reason"] == {"eos": "stop", "stop": "stop", "length": "length"}[expected.finish_reason]
    usage = body["usage"]
    assert usage["prompt_tokens"] == expected.num_prompt_tokens
    assert usage["completion_tokens"] == expected.num_generated_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0, "the same prompt a second time must hit the prefix cache"


def test_a_completion_cut_at_a_stop_string_names_it_in_stop_reason(client, engine):
    whole = engine.generate("Once upon a time", SamplingParams(max_new_tokens=20)).text
    stop = whole[6:8]
    expected = engine.generate("Once upon a time", SamplingParams(max_new_tokens=20, stop=(stop,)))
    assert expected.finish_reason == "stop", f"{stop!r} should stop {whole!r}"
    response = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 20,
                                                    "temperature": 0, "stop": [stop, "never-seen"]})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == expected.text
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)


def test_n_seeded_choices_with_logprobs_are_the_engines_branches(client, engine):
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=7)
    branches = engine.generate_branches(MESSAGES, 3, params)
    plain = chat(client, n=3, temperature=0.8, seed=7, max_tokens=12).json()
    response = chat(client, n=3, temperature=0.8, seed=7, max_tokens=12, logprobs=True, top_logprobs=3)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["message"]["content"] for c in choices] == [b.text for b in branches]
    assert [c["message"]["content"] for c in plain["choices"]] == [b.text for b in branches], \
        "recording top_logprobs must not change the answer"
    for choice, branch in zip(choices, branches):
        content = choice["logprobs"]["content"]
        assert len(content) == branch.num_generated_tokens
        assert [e["logprob"] for e in content] == pytest.approx(list(branch.logprobs), abs=1e-4)
        for entry in content:
            tops = [t["logprob"] for t in entry["top_logprobs"]]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True), "top_logprobs must be the 3 best, best first"
            assert tops[0] >= entry["logprob"] - 1e-5, "no token may be likelier than the first top_logprob"
            assert entry["bytes"] == list(entry["token"].encode())


def test_completions_give_legacy_logprobs_per_prompt_and_choice(client, engine):
    response = client.post("/v1/completions", json={"prompt": ["Hello", "Goodbye"], "n": 2, "max_tokens": 6,
                                                    "temperature": 0, "logprobs": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for choice, prompt in zip(body["choices"], ["Hello", "Hello", "Goodbye", "Goodbye"]):
        assert choice["text"] == engine.generate(prompt, SamplingParams(max_new_tokens=6)).text
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 6
        assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    assert body["usage"]["completion_tokens"] == 24


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_streamed_chunks_concatenate_to_the_greedy_text_and_end_with_usage(client, endpoint):
    prompt = {"messages": MESSAGES} if endpoint.endswith("chat/completions") else {"prompt": "Tell me a story"}
    fields = {**prompt, "max_tokens": 20, "temperature": 0}
    whole = client.post(endpoint, json=fields).json()
    with client.stream("POST", endpoint, json={**fields, "stream": True, "stream_options": {"include_usage": True}}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events, done = sse_events(list(s.iter_lines()))
    assert done, "a stream must end with data: [DONE]"
    chat_like = endpoint.endswith("chat/completions")
    text = "".join((c["delta"].get("content") or "") if chat_like else c["text"]
                   for e in events for c in e["choices"])
    expected = whole["choices"][0]["message"]["content"] if chat_like else whole["choices"][0]["text"]
    assert text == expected, "streamed chunks must concatenate to the non-streamed text"
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == \
        [whole["choices"][0]["finish_reason"]]
    usage_event = events[-1]
    assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == 20
    assert usage_event["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "the repeated prompt was cached"
    if chat_like:
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_a_streamed_choices_logprobs_arrive_with_the_tokens_of_each_chunk(client, engine):
    params = SamplingParams(max_new_tokens=10, temperature=0.9, seed=5)
    branches = engine.generate_branches(MESSAGES, 2, params)
    fields = {"messages": MESSAGES, "n": 2, "max_tokens": 10, "temperature": 0.9, "seed": 5, "logprobs": True,
              "top_logprobs": 1, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=fields) as s:
        events, done = sse_events(list(s.iter_lines()))
    assert done
    for branch in branches:
        mine = [c for e in events for c in e["choices"] if c["index"] == branch.branch_index and "logprobs" in c]
        assert "".join(c["delta"].get("content") or "" for c in mine) == branch.text
        carrying = [c for c in mine if c["logprobs"] is not None]
        assert len(carrying) > 1, "the log-probs must stream with their tokens, not only in the last chunk"
        content = [e for c in carrying for e in c["logprobs"]["content"]]
        assert [e["logprob"] for e in content] == pytest.approx(list(branch.logprobs), abs=1e-4)
        assert "".join(e["token"] for e in content).startswith(branch.text)
        assert all(len(e["top_logprobs"]) == 1 for e in content)


# -- bad requests ----------------------------------------------------------------------------------
BAD_CHAT = [
    ({"messages": MESSAGES, "n": 0}, "n"),
    ({"messages": MESSAGES, "n": 65}, "n"),
    ({"messages": MESSAGES, "n": "2"}, "n"),
    ({"messages": MESSAGES, "max_tokens": 4097}, "max_tokens"),
    ({"messages": MESSAGES, "max_completion_tokens": 10**6}, "max_completion_tokens"),
    ({"messages": MESSAGES, "temperature": -1}, "temperature"),
    ({"messages": MESSAGES, "top_p": 0}, "top_p"),
    ({"messages": MESSAGES, "seed": -1}, "seed"),
    ({"messages": MESSAGES, "stop": 5}, "stop"),
    ({"messages": MESSAGES, "stop": [""]}, "stop"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"messages": []}, "messages"),
    ({"model": "rksc"}, "messages"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$"}}}}}]},
     "tools[0].function.parameters.properties.code.pattern"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters.type"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools[1].function.name"),
    ({"messages": MESSAGES, "tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}], "logprobs": True}, "logprobs"),
    ({"messages": MESSAGES, "functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                       "function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name"),
    ({"messages": MESSAGES, "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}},
     "response_format.json_schema.schema.anyOf"),
    ({"messages": MESSAGES, "response_format": {"type": "json_object"},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "response_format"),
    ({"messages": MESSAGES, "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),  # longer than the context window
]


@pytest.mark.parametrize(("body", "param"), BAD_CHAT, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_CHAT)])
def test_a_bad_chat_request_is_a_400_naming_the_field(client, engine, body, param):
    before = engine.stats().requests
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] is None
    assert error["param"] == param, error
    assert param.split("[")[0] in error["message"], f"the message must name the field: {error['message']!r}"
    assert engine.stats().requests == before, "a refused request must not reach the engine"


BAD_COMPLETIONS = [
    ({"max_tokens": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": ["a"] * 33, "n": 2}, "n"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_a_bad_completions_request_is_a_400_naming_the_field(client, body, param):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


@pytest.mark.parametrize(("content", "needle"), [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b" " * ((1 << 20) + 1), "limit"),
])
def test_a_body_that_is_not_a_json_object_or_too_big_is_a_400(client, content, needle):
    response = client.post("/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["param"] is None and error["type"] == "invalid_request_error"


def test_an_unknown_route_is_an_openai_style_404(client):
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["type"] == "invalid_request_error"


# -- the rest of the API ------------------------------------------------------------------------
def test_an_api_key_is_required_everywhere_but_health(engine):
    client = TestClient(create_app(engine, api_key="sekrit"))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        response = client.get("/v1/models", headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert chat(client, max_tokens=2).status_code == 401
    assert client.get("/metrics").status_code == 401
    assert client.get("/health").status_code == 200
    good = {"Authorization": "Bearer sekrit"}
    assert client.get("/v1/models", headers=good).status_code == 200
    assert client.post("/v1/chat/completions", headers=good,
                       json={"messages": MESSAGES, "max_tokens": 2}).status_code == 200


def test_models_lists_the_one_model_and_health_is_ok(engine):
    client = TestClient(create_app(engine, model_name="tiny"))
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == engine.context_window
    assert client.get("/health").json() == {"status": "ok"}
    assert chat(client, max_tokens=2).json()["model"] == "tiny"


def test_metrics_count_requests_tokens_and_the_engines_cache():
    engine = make_tiny_engine()
    client = TestClient(create_app(engine))
    usages = [chat(client, max_tokens=8, temperature=0).json()["usage"] for _ in range(2)]
    client.post("/v1/chat/completions", json={"n": 0})
    samples = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    stats = engine.stats()
    assert samples[("rksc_http_requests_total", (("path", "/v1/chat/completions"), ("status", "200")))] == 2
    assert samples[("rksc_http_requests_total", (("path", "/v1/chat/completions"), ("status", "400")))] == 1
    assert samples[("rksc_prompt_tokens_total", ())] == sum(u["prompt_tokens"] for u in usages)
    assert samples[("rksc_generation_tokens_total", ())] == sum(u["completion_tokens"] for u in usages) == 16
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert samples[("rksc_prompt_cached_tokens_total", ())] == cached > 0
    assert samples[("rksc_engine_prompt_tokens_reused_total", ())] == stats.prompt_tokens_reused
    assert samples[("rksc_engine_decode_tokens_total", ())] == stats.decode_tokens
    assert samples[("rksc_prefix_cache_bytes", ())] == stats.cache_bytes > 0
    assert samples[("rksc_prefix_cache_budget_bytes", ())] == stats.cache_budget_bytes > 0
    assert samples[("rksc_running_requests", ())] == 0 and samples[("rksc_waiting_requests", ())] == 0


# -- over the wire --------------------------------------------------------------------------------
@pytest.mark.slow
def test_eight_concurrent_clients_share_a_batch_and_each_gets_its_answer_alone(engine, server_url):
    prompts = [[{"role": "user", "content": "Question " + "?" * i}] for i in range(8)]
    params = SamplingParams(max_new_tokens=16)
    alone = [engine.generate(p, params).text for p in prompts]

    def ask(messages):
        response = httpx.post(f"{server_url}/v1/chat/completions", timeout=60,
                              json={"messages": messages, "max_tokens": 16, "temperature": 0})
        return response.json()["choices"][0]["message"]["content"]

    engine.reset_stats()
    with ThreadPoolExecutor(8) as pool:
        with engine.exclusive():  # hold the scheduler until all eight are queued, so they share a step
            futures = [pool.submit(ask, p) for p in prompts]
            assert wait_until(lambda: engine.stats().waiting_requests == 8), "the clients' requests never queued"
        answers = [f.result() for f in futures]
    assert answers == alone, "an answer served beside other clients differs from the answer alone"
    assert engine.stats().peak_batch_rows == 8, "concurrent clients must be decoded in one batch"


def test_a_stream_closed_mid_way_cancels_its_request(engine, server_url):
    before = engine.stats().decode_tokens
    body = {"messages": MESSAGES, "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server_url}/v1/chat/completions", json=body) as s:
        lines = s.iter_lines()
        # The first chunk (the role, empty content) is sent before the request is admitted: wait for text.
        assert any(line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line
                   for line in lines)
        # stats() may answer from the snapshot of the step before the one that sent the text.
        assert wait_until(lambda: engine.stats().running_requests == 1), "the streamed request is not running"
    assert wait_until(lambda: engine.stats().running_requests == 0), "the closed stream's request kept running"
    assert engine.stats().decode_tokens - before < 4000, "the request ran to the end instead of being cancelled"


def test_a_client_that_gives_up_on_a_whole_response_cancels_its_request(engine, server_url):
    before = engine.stats().decode_tokens
    sock = open_request(server_url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4000, "temperature": 0})
    try:
        assert wait_until(lambda: engine.stats().running_requests == 1), "the request never started decoding"
    finally:
        sock.close()  # the client goes away while its request decodes
    assert wait_until(lambda: engine.stats().running_requests == 0), "the abandoned request kept running"
    assert engine.stats().decode_tokens - before < 4000, "the request ran to the end instead of being cancelled"


def test_the_official_openai_client_gets_choices_logprobs_and_a_stream(engine, server_url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0)
    branches = engine.generate_branches(MESSAGES, 2, SamplingParams(max_new_tokens=10, temperature=0.7, seed=3))
    response = client.chat.completions.create(model="rksc", messages=MESSAGES, n=2, temperature=0.7, seed=3,
                                              max_tokens=10, logprobs=True, top_logprobs=2)
    assert [c.message.content for c in response.choices] == [b.text for b in branches]
    for choice, branch in zip(response.choices, branches):
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(list(branch.logprobs), abs=1e-4)
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    greedy = engine.generate(MESSAGES, SamplingParams(max_new_tokens=16)).text
    stream = client.chat.completions.create(model="rksc", messages=MESSAGES, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    legacy = client.completions.create(model="rksc", prompt="Hello", max_tokens=5, temperature=0)
    assert legacy.choices[0].text == engine.generate("Hello", SamplingParams(max_new_tokens=5)).text


# -- the command ----------------------------------------------------------------------------------
def test_rksc_serve_binds_to_loopback_by_default_and_warns_when_exposed_without_a_key(engine, monkeypatch, caplog):
    import uvicorn

    from rksc_cli import build_parser

    served = {}
    monkeypatch.setattr(RKSCEngine, "from_pretrained", classmethod(lambda cls, *a, **k: engine))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: served.update(app=app, **kwargs))
    caplog.set_level(logging.WARNING, logger="rksc_serve")
    args = build_parser().parse_args(["serve", "--max-n", "2"])
    assert args.func(args) == 0
    assert (served["host"], served["port"]) == ("127.0.0.1", 8000)
    assert not caplog.records, "a loopback server must not warn"
    client = TestClient(served["app"])
    assert chat(client, n=3, max_tokens=2).json()["error"]["param"] == "n", "--max-n must bound n"

    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--port", "9001"])
    assert args.func(args) == 0 and (served["host"], served["port"]) == ("0.0.0.0", 9001)
    assert [r.getMessage() for r in caplog.records if "without an API key" in r.getMessage()], caplog.text
    caplog.clear()
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--api-key", "k"])
    assert args.func(args) == 0 and not caplog.records, "a server with a key must not warn"


def test_an_app_built_without_the_host_warns_once_when_reached_on_a_network_address(engine, caplog):
    app = create_app(engine)
    caplog.set_level(logging.WARNING, logger="rksc_serve")
    for address in ("127.0.0.1", "::1", "10.1.2.3", "10.1.2.3", "192.168.0.9"):
        # What a server bound to 0.0.0.0 reports: the local address each connection came in on.
        client = TestClient(app, base_url=f"http://{address}:8000" if ":" not in address else "http://[::1]:8000")
        assert client.get("/v1/models").status_code == 200
        warned = [r.getMessage() for r in caplog.records]
        assert warned == ([] if address in ("127.0.0.1", "::1") else [warned[0]]), warned
    assert "10.1.2.3 without an API key" in warned[0]
    caplog.clear()
    keyed = TestClient(create_app(engine, api_key="k"), base_url="http://10.1.2.3:8000")
    assert keyed.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert not caplog.records, "a server with a key must not warn"
