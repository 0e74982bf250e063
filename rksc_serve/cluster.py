"""``rksc serve --replicas N``: N engine replicas behind one OpenAI-compatible endpoint, on Ray Serve.

Why this shape:
    * Every replica runs the very app ``rksc serve`` runs (``create_app`` over its own engine), so the
      API, its checks, errors, streams and metrics are the same with one replica or many. A replica
      drives that app in-process through ASGI (``ReplicaServer.forward``) and streams the response
      back: headers first, then each body piece as the app sends it, so server-sent events stay live.
    * One light ingress deployment (``ClusterIngress``, no engine, no CPU reserved) receives HTTP from
      Ray Serve's proxy, reads the body once to find the text the prompt starts with, and calls the
      replicas' deployment handle with it. A request router only sees the arguments of a handle call,
      never a raw HTTP body: that is why the ingress exists.
    * Routing is Ray Serve's request-router API (``RequestRouterConfig`` on the replicas' deployment):
      ``"prefix"`` is Ray Serve LLM's ``PrefixCacheAffinityRouter`` (a prefix tree of the prompts each
      replica was sent; a request goes to the replica with the longest match, to the replica holding
      the least text when the match is under a tenth of the prompt, and by power-of-two choices when
      the replicas' queues differ by more than ``imbalanced_threshold``, which Ray leaves unbounded and
      ``build_app`` sets to a quarter of a replica's ``max_ongoing_requests``, so one hot system prompt
      cannot pile every request onto one replica while the others idle). ``build_app`` also turns on
      the tree's least-recently-used eviction (off in Ray), so a long-running router's memory stays
      bounded.
      It reads the prompt from a handle argument's ``prompt`` attribute, which ``ForwardedRequest``
      carries. ``"pow2"`` is Ray Serve's default router; ``"round_robin"`` (``RoundRobinRouter``) turns
      through the replicas in a fixed order, the baseline that shows what prefix affinity buys.
    * ``GET /v1/rksc/replicas`` on the endpoint lists each replica's engine counters (``EngineStats``)
      as of the last response it sent, so the cluster's prefix-cache hit rate can be read from outside.
      ``GET /metrics`` is forwarded like any request, so it is one replica's metrics, not the sum.

This module imports Ray (``pip install "rksc[cluster]"``); nothing imports it until ``rksc serve
--replicas`` with more than one replica runs, so ``import rksc_serve`` and ``rksc --help`` never load Ray.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from rksc_serve.workers import DEFAULT_WORKER_THREADS

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

    from rksc_engine.config import EngineConfig

ROUTINGS = ("prefix", "round_robin", "pow2")
REPLICAS_PATH = "/v1/rksc/replicas"
# A replica admits this many requests at once by default (Ray Serve's own default is 5): its
# scheduler batches concurrent requests, so it should see them rather than have them queued upstream.
DEFAULT_MAX_ONGOING_REQUESTS = 64
# Counters summed over replicas in ``GET /v1/rksc/replicas``'s ``total``.
SUMMED_STATS = ("requests", "prompt_tokens_computed", "prompt_tokens_reused", "decode_tokens", "prefills",
                "cache_hits", "cache_misses", "cache_evicted_tokens", "cache_window_freed_tokens")

log = logging.getLogger("rksc_serve.cluster")


# -- what travels from the ingress to a replica ---------------------------------------------------
@dataclass
class ForwardedRequest:
    """One HTTP request as the ingress hands it to a replica.

    ``prompt`` is what ``PrefixCacheAffinityRouter`` matches on (it reads a ``prompt`` or ``messages``
    attribute of the call's arguments, so this class must have no ``messages`` attribute).
    """

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt: str = ""


def routing_text(body: bytes) -> str:
    """The text a request's prompt starts with, as prefix routing compares it; ``""`` when it has none.

    Chat messages and a reasoning request's messages are their contents joined, as Ray Serve LLM joins
    them; a completions prompt is its text (its first, for a list); token ids are written as digits,
    so prompts sharing leading ids share leading text. Nothing here validates: the replica does.
    """
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    if isinstance(data.get("messages"), list):
        return "".join(_content_text(m.get("content")) for m in data["messages"] if isinstance(m, dict))
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        return "".join(f"{p}," for p in prompt)
    question = data.get("question")
    return question if isinstance(question, str) else ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


# -- a replica: one engine and its app ------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaSpec:
    """How every replica builds its engine and app; pickled to each replica, so only plain values.

    ``model`` must be a directory every node can read (or None for the embedded default model, which
    each node converts once into its own cache).
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    engine_config: EngineConfig | None = None
    api_key: str | None = None
    served_model_name: str | None = None
    max_tokens_limit: int = 4096
    max_n: int = 64
    max_body_bytes: int = 1 << 20
    worker_threads: int = DEFAULT_WORKER_THREADS


class ReplicaServer:
    """The body of one engine replica (made a Ray Serve deployment by ``build_app``)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        from rksc_engine import RKSCEngine
        from rksc_serve.app import create_app

        self.engine = RKSCEngine.from_pretrained(spec.model, device=spec.device, dtype=spec.dtype,
                                                 config=spec.engine_config, progress=False)
        self.app = create_app(self.engine, api_key=spec.api_key, model_name=spec.served_model_name,
                              max_tokens_limit=spec.max_tokens_limit, max_n=spec.max_n,
                              max_body_bytes=spec.max_body_bytes, worker_threads=spec.worker_threads)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[dict[str, Any] | bytes]:
        """Answer ``request`` with this replica's app: yields ``{"replica", "status", "headers"}``,
        then the body in the pieces the app sent, the last one inside ``{"replica", "stats", "tail"}``
        with the engine's counters: the ingress can then end its response with that piece instead of
        waiting on a stream whose client may already have read every byte and gone. Closing the
        stream early (the client left) disconnects the app, which cancels the engine requests."""
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
            "query_string": request.query_string, "root_path": "", "headers": request.headers,
            "client": None, "server": None, "state": {},
        }
        last = b""
        async for message in asgi_exchange(self.app, scope, request.body):
            if message["type"] == "http.response.start":
                headers = [(bytes(k).decode("latin-1"), bytes(v).decode("latin-1"))
                           for k, v in message.get("headers", [])]
                yield {"replica": self.replica_id, "status": message["status"], "headers": headers}
            elif message["type"] == "http.response.body":
                if message.get("more_body", False):
                    if message.get("body"):
                        yield bytes(message["body"])
                else:
                    last = bytes(message.get("body", b""))
        # stats() never waits for the engine (it answers from the snapshot published after the last
        # step while a step holds it), so this read does not hold up the replica's event loop.
        yield {"replica": self.replica_id, "stats": self.engine.stats().as_dict(), "tail": last}


async def asgi_exchange(app: Any, scope: dict[str, Any], body: bytes) -> AsyncIterator[dict[str, Any]]:
    """Run one request through the ASGI ``app``; yields the messages it sends, up to the last body piece.

    The body is received whole; after it, ``receive`` waits for the consumer to go away and then
    reports ``http.disconnect`` (the app polls it to cancel abandoned requests).
    """
    sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await sent.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    finished = False
    try:
        while (message := await sent.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
                break
    finally:
        gone.set()
        if not finished:
            task.cancel()
        outcome = (await asyncio.gather(task, return_exceptions=True))[0]
        if isinstance(outcome, Exception):  # the app answered (a 500) before raising; note it only
            log.warning("request %s %s raised after its answer: %r", scope["method"], scope["path"], outcome)


# -- the ingress ----------------------------------------------------------------------------------
class ClusterIngress:
    """The HTTP entry point (made a Ray Serve deployment by ``build_app``): forwards each request to
    the replica the router picks and streams the answer back."""

    def __init__(self, replicas: DeploymentHandle, api_key: str | None = None, max_body_bytes: int = 1 << 20) -> None:
        self.replicas = replicas  # the replicas' DeploymentHandle
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.replica_stats: dict[str, dict[str, Any]] = {}

    async def __call__(self, request: Request) -> Response:
        if request.url.path == REPLICAS_PATH and request.method == "GET":
            if not self._authorized(request):
                return JSONResponse(_error(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                                           code="invalid_api_key"), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
            return JSONResponse(self.replicas_body())
        body = await self._body(request)
        if body is None:
            return JSONResponse(_error(400, f"request body is over the limit of {self.max_body_bytes} bytes"),
                                status_code=400)
        forwarded = ForwardedRequest(request.method, request.url.path, request.scope.get("query_string", b""),
                                     list(request.scope.get("headers", [])), body, routing_text(body))
        handle = self.replicas.options(stream=True)
        # A call without positional arguments is routed by load alone (Ray's router reads the prompt
        # from positional arguments, and an empty prompt would give it nothing to match).
        stream = handle.forward.remote(forwarded) if forwarded.prompt else handle.forward.remote(request=forwarded)
        try:
            start = await stream.__anext__()
        except BaseException:
            stream.cancel()
            raise
        if not isinstance(start, dict) or "status" not in start:  # the app ended without answering
            stream.cancel()
            return JSONResponse({"error": {"message": "the replica sent no response", "type": "server_error",
                                           "param": None, "code": None}}, status_code=502)
        headers = dict(start["headers"])
        headers["x-rksc-replica"] = start["replica"]
        return StreamingResponse(self._relay(stream), status_code=start["status"], headers=headers)

    async def _relay(self, stream: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
        done = False
        try:
            async for item in stream:
                if isinstance(item, bytes):
                    yield item
                    continue
                self.replica_stats[item["replica"]] = item["stats"]
                done = True
                if item["tail"]:
                    yield item["tail"]
                break
        finally:
            if not done:
                stream.cancel()

    async def _body(self, request: Request) -> bytes | None:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return None
        data = bytearray()
        async for piece in request.stream():
            data += piece
            if len(data) > self.max_body_bytes:
                return None
        return bytes(data)

    def _authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def replicas_body(self) -> dict[str, Any]:
        """Each replica's last reported engine counters, and their sums with the pooled reuse rate."""
        data = [{"replica": replica, **stats} for replica, stats in sorted(self.replica_stats.items())]
        total: dict[str, Any] = {name: sum(int(s.get(name, 0)) for s in data) for name in SUMMED_STATS}
        prompt_tokens = total["prompt_tokens_computed"] + total["prompt_tokens_reused"]
        total["prompt_reuse_rate"] = total["prompt_tokens_reused"] / prompt_tokens if prompt_tokens else 0.0
        return {"object": "list", "data": data, "total": total}


def _error(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


# -- routers --------------------------------------------------------------------------------------
def prefix_router_class() -> type:
    """Ray Serve LLM's ``PrefixCacheAffinityRouter``.

    Its public path (``ray.serve.llm.request_router``) imports Ray Serve LLM's model-loading code,
    which needs ``ray[llm]`` (vLLM, pyarrow). The router itself needs none of that, so without them
    it is taken from the module that defines it.
    """
    try:
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter
    except ImportError:
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
            PrefixCacheAffinityRouter,
        )
    return PrefixCacheAffinityRouter


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Sends request k to replica k mod N (replicas in a fixed order), whatever its prompt.

    Built on Ray Serve's request-router API. The turn advances when a request is actually routed, so
    retries do not skip replicas; a full replica falls back to the next ones, in order.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self.turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        first = self.turn % len(ordered)
        return [[ordered[first]], ordered[first + 1:] + ordered[:first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.turn += 1


def request_router_config(routing: str, router_kwargs: dict[str, Any] | None = None) -> RequestRouterConfig:
    """Ray Serve's ``RequestRouterConfig`` for ``routing`` (one of ``ROUTINGS``)."""
    if routing == "prefix":
        return RequestRouterConfig(request_router_class=prefix_router_class(),
                                   request_router_kwargs=dict(router_kwargs or {}))
    if routing == "round_robin":
        return RequestRouterConfig(request_router_class=RoundRobinRouter,
                                   request_router_kwargs=dict(router_kwargs or {}))
    if routing == "pow2":
        return RequestRouterConfig(request_router_kwargs=dict(router_kwargs or {}))
    raise ValueError(f"routing must be one of {list(ROUTINGS)}, got {routing!r}")


# -- the application ------------------------------------------------------------------------------
def build_app(spec: ReplicaSpec, replicas: int, routing: str = "prefix", *, replica_cpus: float = 1.0,
              replica_gpus: float = 0.0, max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS,
              router_kwargs: dict[str, Any] | None = None) -> serve.Application:
    """The Ray Serve application: ``replicas`` engine replicas routed by ``routing``, behind the ingress.

    ``replica_cpus``/``replica_gpus`` are what Ray reserves for each replica (it places replicas on
    nodes that have them; a replica sees GPUs only if it reserves some). ``router_kwargs`` go to the
    router's ``initialize_state`` (for ``"prefix"``: ``imbalanced_threshold``, ``match_rate_threshold``,
    eviction of its prefix tree).
    """
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {list(ROUTINGS)}, got {routing!r}")
    if routing == "prefix":
        router_kwargs = {"imbalanced_threshold": max(1, max_ongoing_requests // 4), "do_eviction": True,
                         **(router_kwargs or {})}
    engine_deployment = serve.deployment(ReplicaServer).options(
        name="rksc-engine", num_replicas=replicas, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        request_router_config=request_router_config(routing, router_kwargs),
    )
    ingress = serve.deployment(ClusterIngress).options(
        name="rksc-ingress", num_replicas=1, max_ongoing_requests=max(1024, 4 * max_ongoing_requests * replicas),
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(engine_deployment.bind(spec), spec.api_key, spec.max_body_bytes)


def start_cluster(spec: ReplicaSpec, replicas: int, host: str = "127.0.0.1", port: int = 8000, *,
                  routing: str = "prefix", app_name: str = "rksc", log_level: str = "warning", **options: Any) -> str:
    """Deploy ``build_app(spec, replicas, routing, **options)`` and return its base URL (``.../v1``).

    Joins the Ray cluster at ``RAY_ADDRESS`` (or one started on this machine with ``ray start``), else
    starts a local one (``ray.init``'s own rules). Serve's HTTP proxy listens on ``host:port`` on the
    head node and each node running a replica; those options only take effect when Serve is first
    started on the cluster. ``log_level`` is the application's
    (``"info"`` logs every request).
    """
    from rksc_serve.app import warn_if_exposed

    warn_if_exposed(host, spec.api_key)
    app = build_app(spec, replicas, routing, **options)
    if not ray.is_initialized():
        ray.init()
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=app_name, route_prefix="/", logging_config={"log_level": log_level.upper()})
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/v1"


def run_cluster(spec: ReplicaSpec, replicas: int, host: str = "127.0.0.1", port: int = 8000, *,
                routing: str = "prefix", app_name: str = "rksc", **options: Any) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM), then take the application down and leave Ray
    (which stops a Ray that ``start_cluster`` started here; a cluster's own nodes keep running)."""
    url = start_cluster(spec, replicas, host, port, routing=routing, app_name=app_name, **options)
    print(f"rksc serve: {replicas} replicas ({routing} routing) at {url}", file=sys.stderr, flush=True)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())  # `docker stop`, systemd, kill
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        serve.delete(app_name)
        ray.shutdown()


# -- measuring routing ----------------------------------------------------------------------------
@dataclass
class HitRate:
    """What a workload measured through the endpoint."""

    routing: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    per_replica: dict[str, int] = field(default_factory=dict)  # requests each replica answered
    routes: list[str] = field(default_factory=list)  # the replica that answered each request, in order
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


# Four assistants whose instructions differ from their first words on, as different products'
# system prompts do; a request is one of them and a short question.
PERSONAS = (
    ("Marlow, the travel desk of a small railway company",
     "Answer questions about timetables, tickets, seat reservations, luggage, bicycles and pets on board. "
     "Quote prices in euros, give platform numbers only when you are sure, and suggest the next train when "
     "a connection is missed."),
    ("Quill, a copy editor for a science magazine",
     "Tighten the reader's sentences, keep their meaning, prefer the active voice, spell out numbers below "
     "ten, use SI units with a thin space, and flag any claim that needs a citation instead of inventing one."),
    ("Basil, the kitchen assistant of a vegetarian restaurant",
     "Help cooks scale recipes, substitute ingredients for allergies, plan the prep list for a service of "
     "eighty covers, and keep to the house rules on knife safety, labelling and cold storage temperatures."),
    ("Orbit, a tutor for first-year physics students",
     "Explain mechanics, waves and electricity step by step, ask the student for their attempt first, check "
     "units at every step, and never give the final number before the student has tried the last step."),
)
QUESTION_TOPICS = ("the first step", "a common mistake", "the rule for beginners", "what to check twice",
                   "a quick example", "the usual exception", "what takes longest", "a safe default")


def routing_workload(num_system_prompts: int = 4, num_questions: int = 32, seed: int = 0
                     ) -> list[list[dict[str, str]]]:
    """Every (system prompt, question) chat, ``num_system_prompts`` x ``num_questions`` of them, in a
    seeded shuffled order (a fixed interleaving could line up with a round-robin turn by chance).

    System prompts are a few hundred characters and differ from their first words; questions are
    short, so most of each prompt is its system prompt, as in an assistant product.
    """
    system_prompts = []
    for i in range(num_system_prompts):
        name, duties = PERSONAS[i % len(PERSONAS)]
        edition = f" (desk {i // len(PERSONAS) + 1})" if i >= len(PERSONAS) else ""
        system_prompts.append(f"You are {name}{edition}. {duties} Be brief and friendly.")
    questions = [f"Question {j + 1}: what is {QUESTION_TOPICS[j % len(QUESTION_TOPICS)]}?"
                 for j in range(num_questions)]
    chats = [[{"role": "system", "content": s}, {"role": "user", "content": q}]
             for s in system_prompts for q in questions]
    random.Random(seed).shuffle(chats)
    return chats


def measure_hit_rate(base_url: str, chats: Iterable[list[dict[str, str]]], routing: str, *, max_tokens: int = 1,
                     api_key: str | None = None, timeout_s: float = 120.0) -> HitRate:
    """Send ``chats`` one after another and pool ``usage.prompt_tokens_details.cached_tokens`` over
    ``usage.prompt_tokens``: the share of prompt tokens served from some replica's prefix cache."""
    import httpx

    result = HitRate(routing, 0, 0, 0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    started = time.perf_counter()
    with httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s) as client:
        for messages in chats:
            response = client.post("/chat/completions", json={"model": "rksc", "messages": messages,
                                                              "max_tokens": max_tokens, "temperature": 0})
            response.raise_for_status()
            usage = response.json()["usage"]
            result.requests += 1
            result.prompt_tokens += usage["prompt_tokens"]
            result.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            replica = response.headers.get("x-rksc-replica", "?")
            result.per_replica[replica] = result.per_replica.get(replica, 0) + 1
            result.routes.append(replica)
    result.seconds = time.perf_counter() - started
    return result


def compare_routing(spec: ReplicaSpec, chats: Sequence[list[dict[str, str]]], routings: Sequence[str] = ("prefix", "round_robin"),
                    replicas: int = 2, *, host: str = "127.0.0.1", port: int = 8000, max_tokens: int = 1,
                    **options: Any) -> list[HitRate]:
    """``measure_hit_rate`` of the same ``chats`` under each routing, each on fresh replicas (deployed,
    measured, deleted in turn, so no arm inherits another's caches)."""
    results = []
    for routing in routings:
        name = f"rksc-{routing}"
        url = start_cluster(spec, replicas, host, port, routing=routing, app_name=name, **options)
        try:
            results.append(measure_hit_rate(url, chats, routing, max_tokens=max_tokens, api_key=spec.api_key))
        finally:
            serve.delete(name)
    return results


def markdown_table(results: Sequence[HitRate], note: str = "") -> str:
    """The results as a markdown table."""
    lines = ["| routing | requests | prompt tokens | cached tokens | hit rate | requests per replica | seconds |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for r in results:
        spread = " / ".join(str(n) for _, n in sorted(r.per_replica.items()))
        lines.append(f"| {r.routing} | {r.requests} | {r.prompt_tokens} | {r.cached_tokens} | {r.rate:.1%} | "
                     f"{spread} | {r.seconds:.1f} |")
    return "\n".join(lines) + (f"\n\n{note}" if note else "")
