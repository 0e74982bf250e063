"""``rksc serve``'s own endpoints on the tiny model: ``/v1/rksc/reason`` and ``/v1/rksc/tree_search``
answer what ``engine.reason`` / ``engine.tree_search`` answer for the same arguments, bad bodies are
400s naming the field, the key guards them, ``/metrics`` counts them, and an engine that cannot
reason answers 501."""

from __future__ import annotations

import json
import socket
from dataclasses import replace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from rksc_engine import CGEEConfig, EngineConfig  # noqa: E402
from rksc_engine.config import MAX_SEED  # noqa: E402
from rksc_engine.reasoning.early_stop import ConfidenceConfig, EarlyStopConfig, LengthConfig  # noqa: E402
from rksc_engine.reasoning.few_shot import (
    Problem,
    few_shot_messages,  # noqa: E402
)
from rksc_engine.reasoning.self_consistency import DEFAULT_REASON_PARAMS  # noqa: E402
from rksc_engine.reasoning.tree_search import DEFAULT_SEARCH_PARAMS  # noqa: E402
from rksc_serve.app import create_app  # noqa: E402
from tests.conftest import make_tiny_engine, serving, wait_until  # noqa: E402

QUESTION = "Tom has 3 bags of 4 apples. How many apples?"
SHOT = {"question": "Ann has 2 cats and 1 dog. How many pets?", "reasoning": "2 + 1 = 3\n#### 3", "answer": "3"}
MESSAGES = [{"role": "system", "content": "Answer with '#### <number>'."}, {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def client(engine):
    assert engine.tokenizer.chat_template, "the prompts are chat messages: the tokenizer needs a chat template"
    return TestClient(create_app(engine))


def reason(client, **fields):
    return client.post("/v1/rksc/reason", json={"question": QUESTION, **fields})


def search(client, **fields):
    return client.post("/v1/rksc/tree_search", json={"question": QUESTION, **fields})


# -- answers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["few_shot", "messages"])
def test_a_seeded_reason_request_answers_what_engine_reason_answers(client, engine, prompt):
    if prompt == "few_shot":
        fields, engine_prompt = {"few_shot": [SHOT]}, {"few_shot": [Problem(SHOT["question"], SHOT["reasoning"], "3")]}
    else:
        fields, engine_prompt = {"messages": MESSAGES}, {"prompt": MESSAGES}
    params = replace(DEFAULT_REASON_PARAMS, temperature=1.0, max_new_tokens=40, seed=0)  # top_p left to the default
    expected = engine.reason(QUESTION, n=6, params=params, answer_extractor="gsm8k", cgee=CGEEConfig.off(),
                             **engine_prompt)
    assert expected.votes and expected.verification.scores, "the case must have votes and run the verifier"

    response = reason(client, n=6, temperature=1.0, max_tokens=40, seed=0, answer_extractor="gsm8k",
                      cgee={"skip_enabled": False}, **fields)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "rksc.reason" and body["id"].startswith("rksc-reason-")
    assert body["answer"] == expected.answer
    assert body["votes"] == dict(expected.votes)
    assert body["vote_shares"] == pytest.approx(dict(expected.vote_summary.shares), abs=1e-6)
    assert [b["text"] for b in body["branches"]] == [b.text for b in expected.branches], "served branches differ"
    assert [b["answer"] for b in body["branches"]] == [b.answer for b in expected.branches]
    assert [b["confidence"] for b in body["branches"]] == pytest.approx([b.confidence for b in expected.branches],
                                                                         abs=1e-5)
    assert [b["finish_reason"] for b in body["branches"]] == [c.finish_reason for c in expected.completions]

    report, served = expected.verification, body["verification"]
    assert (served["skipped"], served["reason"]) == (report.skipped, report.reason)
    assert (served["p"], served["lead"]) == pytest.approx((report.p, report.lead), abs=1e-6)
    assert served["scores"] == pytest.approx({s.answer: s.score for s in report.scores}, abs=1e-4)
    assert served["exit_layers"] == {s.answer: s.exit_layer for s in report.scores}
    assert served["num_layers"] == report.num_layers and served["verify_s"] > 0

    usage = body["usage"]
    assert usage["prompt_tokens"] == expected.completions[0].num_prompt_tokens
    assert usage["completion_tokens"] == sum(c.num_generated_tokens for c in expected.completions)
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0, "the same prompt a second time must hit the prefix cache"


def test_cgee_fields_left_out_keep_the_engines_own_cgee_config():
    always_skip = CGEEConfig(tau_conf=0.0, margin=0.0)
    engine = make_tiny_engine(EngineConfig(cgee=always_skip))
    client = TestClient(create_app(engine))
    fields = {"n": 4, "temperature": 1.0, "max_tokens": 24, "seed": 0}
    reports = {name: reason(client, **fields, **extra).json()["verification"] for name, extra in (
        ("none", {}), ("partial", {"cgee": {"exit_enabled": False}}), ("override", {"cgee": {"skip_enabled": False}}))}
    assert reports["none"]["skipped"], f"the engine's cgee skips any vote: {reports['none']}"
    assert reports["partial"]["skipped"], "cgee fields left out must keep the engine's values, not CGEEConfig()'s"
    assert not reports["override"]["skipped"] and reports["override"]["scores"], "a given cgee field must win"


def test_a_tree_search_request_answers_what_engine_tree_search_answers(client, engine):
    params = replace(DEFAULT_SEARCH_PARAMS, temperature=0.9, max_new_tokens=8, seed=1)  # top_p left to the default
    expected = engine.tree_search(QUESTION, breadth=2, depth=3, beam=2, params=params, few_shot=[
        Problem(SHOT["question"], SHOT["reasoning"], "3")])
    response = search(client, breadth=2, depth=3, beam=2, temperature=0.9, max_tokens=8, seed=1, few_shot=[SHOT])
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "rksc.tree_search"
    assert body["answer"] == expected.answer
    assert body["best_score"] == pytest.approx(expected.best_score, abs=1e-5)
    assert body["best_path"] == [n.text for n in expected.best_path[1:]]
    assert body["best_node"] == expected.best_path[-1].index and body["text"] == expected.text
    assert body["num_expansions"] == expected.num_expansions and body["wall_s"] > 0
    assert [(n["index"], n["parent"], n["depth"], n["text"], n["status"], n["is_final"]) for n in body["nodes"]] == \
        [(n.index, n.parent, n.depth, n.text, n.status, n.is_final) for n in expected.nodes], "served tree differs"
    assert [n["branch_score"] for n in body["nodes"]] == pytest.approx([n.branch_score for n in expected.nodes],
                                                                        abs=1e-5)
    assert expected.early_stop is None and body["early_stop"] is None, "early_stop left out must stay off"


# -- early stop ------------------------------------------------------------------------------------
# The threshold is the best of two warm-up branches, so the other branches falling below it are stopped.
STRICT_CONFIDENCE = {"window_tokens": 4, "warmup_branches": 2, "percentile": 100}
EARLY_STOP_CASES = [
    (None, None),
    ("left out", "decided"),
    ("answered", "answered"),
    ("length", "length"),
    ({"decided": False, "confidence": STRICT_CONFIDENCE},
     EarlyStopConfig(decided=False, confidence=ConfidenceConfig(**STRICT_CONFIDENCE))),
]


@pytest.mark.parametrize(("served", "engine_early_stop"), EARLY_STOP_CASES,
                         ids=["null", "left-out", "rule-name", "length", "object"])
def test_early_stop_reaches_the_engine_and_the_answer_carries_its_report(client, engine, served, engine_early_stop):
    params = replace(DEFAULT_REASON_PARAMS, temperature=1.0, max_new_tokens=48, seed=2)
    expected = engine.reason(QUESTION, n=6, params=params, cgee=CGEEConfig.off(), early_stop=engine_early_stop)
    fields = {} if served == "left out" else {"early_stop": served}
    response = reason(client, n=6, temperature=1.0, max_tokens=48, seed=2, cgee={"skip_enabled": False}, **fields)
    assert response.status_code == 200, response.text
    body = response.json()
    branches = body["branches"]
    assert [b["voted"] for b in branches] == [b.voted for b in expected.branches]
    assert [b["finish_reason"] for b in branches] == [c.finish_reason for c in expected.completions]
    if engine_early_stop is None:
        assert body["early_stop"] is None, "early_stop null must run without a monitor"
        assert all(b["voted"] and b["finish_reason"] != "cancelled" for b in branches)
    else:
        assert body["early_stop"] == expected.early_stop.as_dict()
        assert body["early_stop"]["branches_launched"] == 6
    if isinstance(served, dict):
        stopped = body["early_stop"]["stopped_by"]
        assert stopped and {s["rule"] for s in stopped} == {"confidence"}, f"'confidence' stopped no branch: {stopped}"
        assert all(branches[s["branch_index"]]["finish_reason"] == "cancelled" for s in stopped)
        assert not any(branches[s["branch_index"]]["voted"] for s in stopped), "a branch below the threshold voted"
        assert body["early_stop"]["confidence_threshold"] is not None


# The tiny model rarely writes a newline, so with "\n" every step runs to max_tokens and all are the
# same length; "3" is one of its common characters, so steps end at different lengths and the length
# rule has something to cut.
STEPS = {"breadth": 4, "depth": 2, "beam": 2, "temperature": 1.0, "max_tokens": 24, "seed": 0,
         "step_delimiter": "3"}
TIGHT_LENGTH = {"finished_fraction": 0.25, "factor": 1.01}
SEARCH_EARLY_STOP_CASES = [
    (None, None),
    ("length", "length"),
    pytest.param("confidence", "confidence", marks=pytest.mark.slow),
    ({"decided": True, "length": TIGHT_LENGTH},  # decided is ignored, as the engine ignores it
     EarlyStopConfig(decided=False, length=LengthConfig(**TIGHT_LENGTH))),
]


@pytest.mark.parametrize(("served", "engine_early_stop"), SEARCH_EARLY_STOP_CASES,
                         ids=["null", "length", "confidence", "object"])
def test_a_tree_searchs_early_stop_reaches_the_engine_and_the_answer_carries_its_totals(
        client, engine, served, engine_early_stop):
    params = replace(DEFAULT_SEARCH_PARAMS, temperature=1.0, max_new_tokens=24, seed=0)
    expected = engine.tree_search(QUESTION, breadth=4, depth=2, beam=2, step_delimiter="3", params=params,
                                  early_stop=engine_early_stop)
    response = search(client, **STEPS, early_stop=served)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [(n["index"], n["parent"], n["text"], n["status"]) for n in body["nodes"]] == \
        [(n.index, n.parent, n.text, n.status) for n in expected.nodes], "served tree differs"
    assert body["answer"] == expected.answer and body["text"] == expected.text
    if engine_early_stop is None:
        assert body["early_stop"] is None, "early_stop null must search without a monitor"
        assert all(n["status"] != "stopped" for n in body["nodes"])
        return
    assert body["early_stop"] == expected.early_stop, "the served totals differ from the engine's"
    assert isinstance(body["early_stop"], dict) and body["early_stop"]["children_launched"] == 8
    rules = ["confidence"] if served == "confidence" else ["length"]
    assert body["early_stop"]["rules"] == rules
    stopped = [n for n in body["nodes"] if n["status"] == "stopped"]
    assert stopped and len(stopped) == body["early_stop"]["children_stopped"], body["early_stop"]
    best = body["best_node"]
    assert all(n["index"] != best and not any(m["parent"] == n["index"] for m in body["nodes"]) for n in stopped), \
        "a stopped child was chosen or expanded"


# -- bad requests ----------------------------------------------------------------------------------
BAD_REASON = [
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),
    ({"n": "2"}, "n"),
    ({"question": ""}, "question"),
    ({"question": None}, "question"),
    ({"few_shot": [SHOT], "messages": MESSAGES}, "messages"),
    ({"few_shot": [{"question": "q"}]}, "few_shot[0].reasoning"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"answer_extractor": "roman"}, "answer_extractor"),
    ({"cgee": {"tau_conf": 2}}, "cgee.tau_conf"),
    ({"cgee": {"min_layer": -1}}, "cgee.min_layer"),
    ({"cgee": {"skip_enabled": "yes"}}, "cgee.skip_enabled"),
    ({"cgee": {"tau": 0.5}}, "cgee.tau"),
    ({"early_stop": "sometimes"}, "early_stop"),
    ({"early_stop": 3}, "early_stop"),
    ({"early_stop": {"decide": True}}, "early_stop.decide"),
    ({"early_stop": {"decided": "yes"}}, "early_stop.decided"),
    ({"early_stop": {"adaptive": {"wave_size": 0}}}, "early_stop.adaptive.wave_size"),
    ({"early_stop": {"adaptive": {"wave_size": "2"}}}, "early_stop.adaptive.wave_size"),
    ({"early_stop": {"adaptive": {"method": "vote"}}}, "early_stop.adaptive.method"),
    ({"early_stop": {"answered": {"pattern": "("}}}, "early_stop.answered.pattern"),
    ({"early_stop": {"confidence": {"percentile": 101}}}, "early_stop.confidence.percentile"),
    ({"early_stop": {"length": {"factor": 1}}}, "early_stop.length.factor"),
    ({"max_tokens": 4097}, "max_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"seed": -1}, "seed"),
    ({"temprature": 0.5}, "temprature"),
    ({"question": "x" * 5000}, "question"),  # longer than the context window: the engine's own check
    ({"messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_REASON, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_REASON)])
def test_a_bad_reason_request_is_a_400_naming_the_field(client, engine, fields, param):
    before = engine.stats().requests
    response = reason(client, **{"max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param.split("[")[0].split(".")[-1] in error["message"], f"the message must name the field: {error}"
    assert engine.stats().requests == before, "a refused request must not reach the engine"


BAD_SEARCH = [
    ({"breadth": 0}, "breadth"),
    ({"breadth": 65, "beam": 1}, "breadth"),
    ({"breadth": 9}, "breadth"),  # beam defaults to breadth: 81 generations per level
    ({"breadth": 9, "beam": 8}, "beam"),
    ({"beam": 0}, "beam"),
    ({"depth": 17}, "depth"),
    ({"step_delimiter": ""}, "step_delimiter"),
    ({"scorer": "oracle"}, "scorer"),
    ({"answer_extractor": "roman"}, "answer_extractor"),
    ({"few_shot": [SHOT], "messages": MESSAGES}, "messages"),
    ({"max_tokens": 4097}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"breadth": 2, "temperature": 0}, "breadth"),  # the engine's own check: greedy siblings are all alike
    ({"breadth": 2, "depth": 1, "seed": MAX_SEED}, "seed"),  # the engine's own check: child seeds overflow
    ({"early_stop": "sometimes"}, "early_stop"),
    ({"early_stop": "answered"}, "early_stop"),  # a vote rule: children are scored, not voted
    ({"early_stop": "decided"}, "early_stop"),
    ({"early_stop": 3}, "early_stop"),
    ({"early_stop": {"decided": True}}, "early_stop"),  # no rule that applies to a tree's children
    ({"early_stop": {}}, "early_stop"),
    ({"early_stop": {"adaptive": {}}}, "early_stop.adaptive"),
    ({"early_stop": {"length": {}, "answered": {}}}, "early_stop.answered"),
    ({"early_stop": {"lenght": {}}}, "early_stop.lenght"),
    ({"early_stop": {"length": {"factor": 1}}}, "early_stop.length.factor"),
    ({"early_stop": {"confidence": {"percentile": 101}}}, "early_stop.confidence.percentile"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_SEARCH, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_SEARCH)])
def test_a_bad_tree_search_request_is_a_400_naming_the_field(client, engine, fields, param):
    before = engine.stats().requests
    response = search(client, **{"max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param in error["message"], f"the message must name the field: {error}"
    assert engine.stats().requests == before, "a refused request must not reach the engine"


def test_a_body_over_the_limit_is_a_400(engine):
    client = TestClient(create_app(engine, max_body_bytes=256))
    response = reason(client, few_shot=[SHOT] * 4)
    assert response.status_code == 400 and "limit" in response.json()["error"]["message"], response.text


# -- the rest of the contract ----------------------------------------------------------------------
def test_the_rksc_endpoints_need_the_api_key(engine):
    client = TestClient(create_app(engine, api_key="sekrit"))
    for path in ("/v1/rksc/reason", "/v1/rksc/tree_search"):
        response = client.post(path, json={"question": QUESTION, "max_tokens": 2})
        assert response.status_code == 401, f"{path} answered without the key"
        assert response.json()["error"]["code"] == "invalid_api_key"
    good = {"Authorization": "Bearer sekrit"}
    assert client.post("/v1/rksc/reason", headers=good, json={"question": QUESTION, "n": 1, "max_tokens": 2}
                       ).status_code == 200
    assert client.post("/v1/rksc/tree_search", headers=good, json={"question": QUESTION, "breadth": 1, "depth": 1,
                                                                    "max_tokens": 2}).status_code == 200


class GenerationOnly:
    """The tiny engine's generation API without ``reason`` or ``tree_search``."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        if name in ("reason", "areason", "tree_search"):
            raise AttributeError(name)
        return getattr(self._engine, name)


class CannotReason(GenerationOnly):
    """The tiny engine's generation API with ``reason`` and ``tree_search`` that raise
    ``NotImplementedError``, as an engine that cannot reason does."""

    def reason(self, question, **kwargs):
        raise NotImplementedError("reason needs a local RKSCEngine here")

    async def areason(self, question, **kwargs):
        return self.reason(question, **kwargs)

    def tree_search(self, question, **kwargs):
        raise NotImplementedError("tree_search needs a local RKSCEngine here")


@pytest.mark.parametrize("wrapper", [GenerationOnly, CannotReason])
def test_an_engine_that_cannot_reason_answers_501_and_still_serves_chat(engine, wrapper):
    client = TestClient(create_app(wrapper(engine)))
    for path, fields in (("/v1/rksc/reason", {"n": 2}), ("/v1/rksc/tree_search", {"breadth": 2})):
        response = client.post(path, json={"question": QUESTION, "max_tokens": 4, **fields})
        assert response.status_code == 501, response.text
        error = response.json()["error"]
        assert error["type"] == "not_implemented_error" and "local RKSCEngine" in error["message"], error
    chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert chat.status_code == 200, chat.text


def test_metrics_count_the_rksc_endpoints_and_the_tokens_reasoning_generated(engine):
    client = TestClient(create_app(engine))
    usage = reason(client, n=2, temperature=0.8, max_tokens=6, seed=0).json()["usage"]
    reason(client, n=0)
    assert search(client, breadth=2, depth=1, max_tokens=4).status_code == 200
    samples = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    requests = "rksc_http_requests_total"
    assert samples[(requests, (("path", "/v1/rksc/reason"), ("status", "200")))] == 1
    assert samples[(requests, (("path", "/v1/rksc/reason"), ("status", "400")))] == 1
    assert samples[(requests, (("path", "/v1/rksc/tree_search"), ("status", "200")))] == 1
    assert samples[("rksc_generation_tokens_total", ())] == usage["completion_tokens"] > 0
    assert samples[("rksc_prompt_tokens_total", ())] == usage["prompt_tokens"]


def test_a_client_that_gives_up_on_a_reason_request_cancels_its_branches(engine):
    num_prompt_tokens = len(engine.encode(few_shot_messages(QUESTION, [])))
    full_run = 2 * min(4000, engine.context_window - num_prompt_tokens)  # greedy "ffff..." never stops early
    with serving(create_app(engine)) as url:
        before = engine.stats().decode_tokens
        host, port = url.removeprefix("http://").split(":")
        payload = json.dumps({"question": QUESTION, "n": 2, "max_tokens": 4000, "temperature": 0}).encode()
        with socket.create_connection((host, int(port))) as sock:  # leaving the block is the client going away
            sock.sendall(f"POST /v1/rksc/reason HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            assert wait_until(lambda: engine.stats().running_requests == 1), "the branches never started decoding"
        assert wait_until(lambda: engine.stats().running_requests == 0), "the abandoned branches kept running"
    decoded = engine.stats().decode_tokens - before
    assert decoded < full_run, f"the branches ran to the end ({decoded} tokens) instead of being cancelled"
