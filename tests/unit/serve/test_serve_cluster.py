"""``rksc serve --replicas``: two replicas of the tiny model behind one Ray Serve endpoint on a local
Ray of two CPUs. The endpoint answers what one engine answers (whole and streamed), and Ray Serve
LLM's prefix-aware router keeps the prefix-cache hit rate high where round-robin does not.

The replicas' cache budget holds about two and a half of the four system prompts: affinity routing
puts two on each replica, so each replica's cache holds its share; round-robin sends all four to
both, which then evict each other's prompts. (With a budget that holds everything, round-robin
only misses once more per system prompt and replica, and the rates converge.)
"""

from __future__ import annotations

import json
import socket

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from ray import serve  # noqa: E402

from rksc_engine import RKSCEngine, SamplingParams  # noqa: E402
from rksc_engine.config import EngineConfig, RSBCMConfig  # noqa: E402
from rksc_serve.cluster import (  # noqa: E402
    ReplicaSpec,
    measure_hit_rate,
    routing_workload,
    start_cluster,
)
from tests.conftest import make_char_tokenizer, make_tiny_model, wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray of two CPUs and two replicas
API_KEY = "cluster-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
CHATS = routing_workload(num_system_prompts=4, num_questions=8, seed=0)
CACHED_SYSTEM_PROMPTS = 2.5  # the replicas' cache budget, in system prompts' KV


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    make_tiny_model(max_positions=4096).save_pretrained(path)
    make_char_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def local_engine(model_dir):
    """The replicas' engine, in this process: what they must answer, and their KV size per token."""
    return RKSCEngine.from_pretrained(model_dir, progress=False)


@pytest.fixture(scope="module")
def spec(model_dir, local_engine):
    prompt_tokens = max(local_engine.generate(c, SamplingParams(max_new_tokens=1)).num_prompt_tokens for c in CHATS[:8])
    stats = local_engine.stats()
    budget_mb = CACHED_SYSTEM_PROMPTS * prompt_tokens * stats.cache_bytes / stats.cache_tokens / 2**20
    local_engine.clear_cache()
    return ReplicaSpec(model=model_dir, api_key=API_KEY,
                       engine_config=EngineConfig(rsbcm=RSBCMConfig(cache_budget_mb=budget_mb)))


@pytest.fixture(scope="module")
def serve_port():
    """A local Ray of two CPUs for the module, and a free port for Serve's HTTP proxy."""
    # "local": a Ray of its own even where RAY_ADDRESS or a `ray start` cluster would be joined.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    try:
        yield free
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def prefix_url(spec, serve_port):
    """Two replicas with prefix-aware routing (the default), deployed once for the module."""
    return start_cluster(spec, 2, port=serve_port, routing="prefix", app_name="rksc-prefix", replica_cpus=0.5)


def post(url, path, **body):
    return httpx.post(url + path, json=body, headers=AUTH, timeout=60)


def test_the_endpoint_answers_a_chat_completion_whole_and_streamed_as_one_engine_does(prefix_url, local_engine):
    expected = local_engine.generate(MESSAGES, SamplingParams(max_new_tokens=12)).text
    response = post(prefix_url, "/chat/completions", model="rksc", messages=MESSAGES, max_tokens=12, temperature=0)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == expected
    assert response.headers["x-rksc-replica"], "the ingress names the replica that answered"

    body = {"model": "rksc", "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", prefix_url + "/chat/completions", json=body, headers=AUTH, timeout=60) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", "a stream through Ray Serve still ends with [DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == expected, "the streamed deltas concatenate to the engine's answer"
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, \
        "the same prompt again lands on the replica that cached it"


def test_the_replicas_own_checks_answer_through_the_ingress(prefix_url):
    assert httpx.get(prefix_url + "/models", timeout=60).status_code == 401, "the API key is checked"
    models = httpx.get(prefix_url + "/models", headers=AUTH, timeout=60)
    assert models.status_code == 200 and models.json()["data"][0]["max_model_len"] == 4096
    bad = post(prefix_url, "/chat/completions", model="rksc", messages=MESSAGES, n=0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n", bad.text
    assert httpx.get(prefix_url + "/rksc/replicas", timeout=60).status_code == 401


def test_a_client_that_goes_away_cancels_its_request_on_the_replica(prefix_url):
    messages = [{"role": "user", "content": "Tell me a very long story about a cat."}]  # greedy: no EOS early
    # As many new tokens as the replicas' small cache budget lets one request reserve: a few seconds' work.
    long = {"model": "rksc", "messages": messages, "max_tokens": 800, "temperature": 0}

    def counters():  # the same prompt lands on the same replica, whose counters come back with it
        replica = post(prefix_url, "/chat/completions", model="rksc", messages=messages, max_tokens=1)
        data = httpx.get(prefix_url + "/rksc/replicas", headers=AUTH, timeout=60).json()["data"]
        return next(d for d in data if d["replica"] == replica.headers["x-rksc-replica"])

    decoded_before = counters()["decode_tokens"]
    with httpx.stream("POST", prefix_url + "/chat/completions", json={**long, "stream": True}, headers=AUTH,
                      timeout=60) as stream:
        for _, _line in zip(range(4), stream.iter_lines()):
            pass
    assert wait_until(lambda: counters()["running_requests"] == 0, timeout_s=60), "the closed stream still runs"
    # A whole (non-streamed) answer's client goes away once its request decodes on the replica.
    host, port = prefix_url.removeprefix("http://").removesuffix("/v1").split(":")
    payload = json.dumps(long).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        assert wait_until(lambda: counters()["running_requests"] == 1, timeout_s=60), "the request never started"
    assert wait_until(lambda: counters()["running_requests"] == 0, timeout_s=60), "the abandoned request still runs"
    decoded = counters()["decode_tokens"] - decoded_before
    assert decoded < long["max_tokens"], \
        f"{decoded} tokens decoded for both: an abandoned request ran to its end instead of being cancelled"


def test_prefix_aware_routing_keeps_the_hit_rate_high_where_round_robin_does_not(spec, serve_port, prefix_url):
    before = httpx.get(prefix_url + "/rksc/replicas", headers=AUTH, timeout=60).json()["total"]
    prefix = measure_hit_rate(prefix_url, CHATS, "prefix", api_key=API_KEY)
    after = httpx.get(prefix_url + "/rksc/replicas", headers=AUTH, timeout=60).json()
    serve.delete("rksc-prefix")
    round_robin_url = start_cluster(spec, 2, port=serve_port, routing="round_robin", app_name="rksc-round-robin",
                                    replica_cpus=0.5)
    try:
        round_robin = measure_hit_rate(round_robin_url, CHATS, "round_robin", api_key=API_KEY)
    finally:
        serve.delete("rksc-round-robin")

    assert len(after["data"]) == 2, "both replicas report their engine counters"
    reused = after["total"]["prompt_tokens_reused"] - before["prompt_tokens_reused"]
    computed = after["total"]["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert reused == prefix.cached_tokens and reused + computed == prefix.prompt_tokens, \
        "the replicas' engine counters agree with the usage the clients were sent"
    assert prefix.requests == round_robin.requests == len(CHATS)
    assert sorted(round_robin.per_replica.values()) == [len(CHATS) // 2] * 2, "round-robin alternates replicas"
    homes = {}
    for chat, replica in zip(CHATS, prefix.routes):
        homes.setdefault(chat[0]["content"], set()).add(replica)
    assert all(len(replicas) == 1 for replicas in homes.values()), f"a system prompt moved between replicas: {homes}"
    assert len(set(prefix.routes)) == 2, "prefix-aware routing still uses both replicas"
    # Each system prompt's first request misses; questions are about a tenth of a prompt.
    assert prefix.rate > 0.65, f"prefix-aware routing hit rate {prefix.rate:.1%}"
    assert prefix.rate > round_robin.rate + 0.2, \
        f"prefix-aware {prefix.rate:.1%} should clearly beat round-robin {round_robin.rate:.1%}"


# -- the command and the pieces that need no cluster ----------------------------------------------
def test_rksc_serve_replicas_deploys_on_ray_serve_and_one_replica_does_not(monkeypatch):
    import rksc_serve.cli
    import rksc_serve.cluster
    from rksc_cli import build_parser

    calls = []
    monkeypatch.setattr(rksc_serve.cluster, "run_cluster", lambda *a, **k: calls.append((a, k)))
    args = build_parser().parse_args(["serve", "--replicas", "3", "--routing", "round_robin", "--model", "/m",
                                      "--api-key", "k", "--replica-gpus", "1"])
    assert args.func(args) == 0
    (spec, replicas, host, port), options = calls[0]
    assert (spec.model, spec.api_key, replicas, host, port) == ("/m", "k", 3, "127.0.0.1", 8000)
    assert options["routing"] == "round_robin" and options["replica_gpus"] == 1.0
    assert build_parser().parse_args(["serve"]).replicas == 1, "one replica (no Ray) stays the default"
    with pytest.raises(ValueError, match="--replicas"):
        rksc_serve.cli.run(build_parser().parse_args(["serve", "--replicas", "0"]))


def test_without_ray_replicas_name_the_extra_and_nothing_else_imports_ray():
    import subprocess
    import sys

    blocked = ("import sys; sys.modules['ray'] = None; from rksc_serve.cli import main; "
               "main(['--replicas', '2'])")
    out = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and 'pip install "rksc[cluster]"' in out.stderr, out.stderr[-500:]
    lazy = ("import sys, rksc_serve, rksc_serve.cli, rksc_cli; rksc_cli.build_parser(); "
            "sys.exit('ray imported' if 'ray' in sys.modules else 0)")
    out = subprocess.run([sys.executable, "-c", lazy], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-500:]


def test_routing_text_is_what_the_prompt_starts_with():
    from rksc_serve.cluster import routing_text

    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert routing_text(json.dumps(chat).encode()) == "Be brief.Hi"
    assert routing_text(json.dumps({"prompt": ["Once", "Twice"]}).encode()) == "Once"
    assert routing_text(json.dumps({"prompt": [5, 6]}).encode()) == "5,6,"
    assert routing_text(json.dumps({"question": "Why?"}).encode()) == "Why?"
    assert routing_text(b"not json") == routing_text(b"[1]") == routing_text(b"{}") == ""
