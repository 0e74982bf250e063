"""The OpenAI-compatible FastAPI app over one engine: ``create_app(engine, ...)``.

Endpoints:
    ``POST /v1/chat/completions``, ``POST /v1/completions``: see ``rksc_serve.protocol`` for the fields.
        Each prompt becomes one ``engine.submit(prompt, n, params)``: its ``n`` choices are sibling
        branches over one prefill, and every request shares the scheduler's decode batches and the
        radix prefix cache with whatever else the engine is running.
    ``POST /v1/rksc/reason``, ``POST /v1/rksc/tree_search``: what OpenAI's API cannot say
        (``rksc_serve.reasoning``): ``engine.areason`` (verified self-consistency with the vote and the
        CGEE report) and ``engine.tree_search`` (run on the server's tree-search pool; it submits each
        level to the scheduler itself). An engine without them, or whose methods raise
        ``NotImplementedError``, answers 501.
    ``GET /v1/models``: the one model served. ``GET /health``: ``{"status": "ok"}``, never behind the
        key. ``GET /metrics``: Prometheus text (``rksc_serve.metrics``).

Promises:
    * Only the engine's public API is used (``submit``, ``areason``, ``tree_search``, ``stats``,
      ``tokenizer``, ``model_name``, ``context_window``, ``config.cgee``; for tools and JSON answers
      ``encode_chat``, ``validate_request`` and what ``rksc_engine.structured.tools`` uses); the engine knows
      nothing of HTTP.
    * With ``api_key``, every endpoint but ``/health`` needs ``Authorization: Bearer <api_key>``
      (401 otherwise, compared in constant time).
    * A bad request is HTTP 400 with OpenAI's error JSON ``{"error": {"message", "type":
      "invalid_request_error", "param", "code": null}}``, ``param`` naming the field (None when the
      body as a whole is wrong: not JSON, not an object, larger than ``max_body_bytes``). The
      engine's own ``ValueError``/``TypeError`` (a prompt longer than the context window, ``n``
      branches that cannot fit the cache budget) are 400s too.
    * A client that goes away cancels its request, streamed or not: a stream's generator cancels its
      handles when it is closed, and a non-streamed request (a reasoning request, a tool turn and a
      JSON answer too) is cancelled as soon as the server reports the connection gone. The scheduler
      drops the rows and frees their KV. Blocking engine work (tool turns, JSON answers, tree
      searches) runs on the server's own bounded pools (``rksc_serve.workers``): the request stops
      waiting at once, a queued call never runs, a tool turn or JSON answer has its engine requests
      cancelled and submits no more, and a tree search or a reasoning call has its ``CancelToken``
      cancelled: its requests in flight end at the next step, and it stops before its next level
      or verifier pass.
    * A client that goes away while still sending its body is answered 499 (counted so in
      ``/metrics``) and logged as one line at info level: its disconnect is not a server error.
    * Shutdown is bounded: when the app stops (its lifespan ends), every pool drops its queue and
      cancels its running calls, and waits for them a few seconds at most; the pools' threads are
      daemons, so an abandoned call never keeps the process alive after Ctrl-C.
    * The event loop never waits for the engine, nor for a tokenizer: requests are encoded and
      submitted on a pool of their own (a text the context window certainly cannot hold is refused
      by its length before it is tokenized, ``RKSCEngine.submit``), their handles are awaited, and
      ``engine.stats()`` (which answers from the last published snapshot while a step or an
      ``exclusive()`` block holds the engine) is read; every call that takes the engine lock is left
      to a worker thread. ``/health`` and ``/metrics`` answer while the engine is busy.
    * An unexpected error is a 500 whose body says only ``internal server error`` and a request id;
      the exception is logged here (logger ``rksc_serve.app``) with that id.
    * Served beyond loopback without an API key, the app logs a warning (``warn_if_exposed``): at
      build time when given the ``host``, otherwise when the first request arrives on a non-loopback
      address.
    * Streams follow OpenAI's chunk format and end with ``data: [DONE]``; with
      ``stream_options.include_usage`` a last chunk with empty ``choices`` carries the usage. Each
      chunk's ``logprobs`` are those of the tokens it carries, so a client (an early-stop rule
      over ``RemoteEngine``) reads them as they are generated.
    * Tools and JSON answers (``tools``, ``tool_choice``, ``response_format``) are decided by
      ``rksc_engine.structured.tools``, as the adapters decide them (``rksc_serve.tool_turns``): calls and JSON
      are decoded under their schema, a call comes back as ``message.tool_calls`` with
      ``finish_reason: "tool_calls"``. Their streams deliver a decided turn's calls (and a JSON
      answer) in one delta each rather than token by token: the call is decoded a value at a time
      under the schema, not as one stream of tokens. The free text of a turn with tools offered is
      streamed as it is generated, so where a whole response drops the text a small model writes
      before its call (``tools.tool_turn_content``, for a template without tool support), the
      stream has already sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from rksc_engine import CancelToken, Completion, RequestCancelled, RequestHandle, SamplingParams, StreamChunk
from rksc_engine.protocol import LocalEngine
from rksc_engine.reasoning.self_consistency import default_cgee
from rksc_engine.structured import tools as tool_protocol
from rksc_engine.structured.constrained import value_params
from rksc_serve.logprobs import TokenText, TopLogprobsRecorder
from rksc_serve.metrics import CountRequests, ServeMetrics
from rksc_serve.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    ChatPlan,
    CompletionRequest,
    InvalidRequest,
    ServeLimits,
    engine_error_param,
    error_param,
)
from rksc_serve.reasoning import ReasonRequest, TreeSearchRequest, engine_error_field, reasoning_body, search_body
from rksc_serve.responses import ChatShape, Shape, TextShape, Turn, envelope, stop_reason, turns_usage, usage
from rksc_serve.tool_turns import choice_seed, constrained_turn, finish_turn
from rksc_serve.workers import DEFAULT_WORKER_THREADS, WorkerPool, check_worker_threads

T = TypeVar("T")
ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/rksc/reason", "/v1/rksc/tree_search",
                    "/v1/models", "/health", "/metrics"})

log = logging.getLogger("rksc_serve.app")
# Seconds the app's shutdown waits, over all its pools, for the calls it cancelled to end.
SHUTDOWN_WAIT_S = 10.0


class APIError(Exception):
    """An error answered with OpenAI's error JSON (and, for a 500, the request id in ``X-Request-Id``)."""

    def __init__(self, status: int, message: str, param: str | None = None, *,
                 error_type: str = "invalid_request_error", code: str | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.error_type, self.code = status, message, param, error_type, code
        self.request_id = request_id

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.request_id is not None:
            headers["X-Request-Id"] = self.request_id
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def internal_error(error: BaseException) -> APIError:
    """The 500 for an unexpected ``error``: logged here with a fresh request id, and answered with
    that id alone, since the exception's text may hold prompts, paths or other clients' data."""
    request_id = "req-" + secrets.token_hex(8)
    log.error("request %s failed: %s", request_id, type(error).__name__, exc_info=error)
    return APIError(500, f"internal server error (request id {request_id}); the server log has the details",
                    error_type="server_error", request_id=request_id)


class _GuardedRoute(APIRoute):
    """A route whose unexpected exceptions are answered as ``internal_error`` here, as an ordinary
    response (Starlette's catch-all handler would re-raise them to the server after answering).
    A client that went away while sending its body (``ClientDisconnect``) is no error of the
    server's: it is answered 499, which nobody reads but ``/metrics`` counts, and logged as one
    line (nginx's "client closed request", which the app's cancelled requests answer too)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (APIError, StarletteHTTPException, RequestValidationError):
                raise
            except ClientDisconnect:
                log.info("client %s went away while sending its request to %s; nothing was run",
                         _client_address(request), request.url.path)
                return _client_closed().response()
            except Exception as error:
                return internal_error(error).response()

        return guarded


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only answers this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, api_key: str | None) -> bool:
    """Log a warning when a server listening on ``host`` answers anyone who can reach it: ``host`` is
    not loopback and there is no API key. Returns whether it warned. The one copy of this check:
    ``create_app`` (and through it ``rksc serve``) and ``rksc_serve.cluster.start_cluster`` call it."""
    if api_key is not None or is_loopback(host):
        return False
    log.warning("rksc serve: listening on %s without an API key (--api-key, create_app(api_key=...)); anyone "
                "who can reach this address can use the model", host)
    return True


def create_app(engine: LocalEngine, api_key: str | None = None, *, model_name: str | None = None,
               max_tokens_limit: int = 4096, max_n: int = 64, max_body_bytes: int = 1 << 20,
               worker_threads: int = DEFAULT_WORKER_THREADS, host: str | None = None) -> FastAPI:
    """The OpenAI-compatible app serving ``engine`` (an ``RKSCEngine``).

    Args:
        engine: The engine every request is submitted to. The rksc routes need its ``areason`` and
            ``tree_search``; where it has none that work, they answer 501 and the rest is served.
        api_key: When set, requests need ``Authorization: Bearer <api_key>`` (all but ``/health``).
        model_name: The model id ``/v1/models`` lists and responses name (default ``engine.model_name``).
            Requests may name any model: there is one.
        max_tokens_limit: Most ``max_tokens`` a request may ask for, and chat's default.
        max_n: Most choices one request may ask for (``n`` times its prompts; a reasoning request's
            ``n``; a tree search's ``breadth * beam``).
        max_body_bytes: Largest request body accepted.
        worker_threads: Threads of each pool for blocking engine work, in [1, 1024]: tool turns and
            JSON answers have one pool of this size, tree searches another. Calls beyond them queue.
        host: The address the app will listen on, when the caller knows it: without ``api_key``, a
            non-loopback one is warned about at once (otherwise at the first request that arrives
            on a non-loopback address).

    Example:
        >>> app = create_app(RKSCEngine.from_pretrained(), api_key="secret")
        >>> uvicorn.run(app, host="127.0.0.1", port=8000)
    """
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty string or None")
    check_worker_threads(worker_threads)
    server = _Server(engine, api_key, model_name or engine.model_name,
                     ServeLimits(max_tokens=max_tokens_limit, max_n=max_n, max_body_bytes=max_body_bytes),
                     worker_threads)
    if host is not None:
        server.exposure_warned = warn_if_exposed(host, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        server.close()

    app = FastAPI(title="rksc", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.router.route_class = _GuardedRoute
    app.state.rksc = server
    app.add_middleware(CountRequests, metrics=server.metrics, paths=ROUTES)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return APIError(error.status_code, str(error.detail)).response()

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        # Only what fails outside a route reaches here (a route answers its own, ``_GuardedRoute``).
        return internal_error(error).response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        server.authorize(request)
        body = await server.parse(request, ChatCompletionRequest)
        plan: ChatPlan = _check(body.check)
        messages = [m.to_engine() for m in body.messages]
        shape = ChatShape(server.token_text)
        if not plan.free_text:
            return await server.generate_turns(request, shape, body, plan, messages)
        # Calls in the history are written into their turns' text, as the adapters render them.
        messages, _ = tool_protocol.offer_tools(messages, None, engine.tokenizer)
        return await server.generate(request, shape, body, [messages], server.limits.max_tokens, "messages")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        server.authorize(request)
        body = await server.parse(request, CompletionRequest)
        _check(lambda: body.check(server.limits))
        return await server.generate(request, TextShape(server.token_text), body, body.prompt,
                                     COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt")

    @app.post("/v1/rksc/reason")
    async def rksc_reason(request: Request) -> Response:
        server.authorize(request)
        areason = server.local_method("areason", "/v1/rksc/reason")
        body = await server.parse(request, ReasonRequest)
        _check(lambda: body.check(server.limits))
        kwargs = _check(lambda: body.engine_kwargs(default_cgee(engine)))
        result = await server.call_engine(
            "/v1/rksc/reason", body.prompt_field, "n",
            lambda: _until_disconnect(request, areason(body.question, **kwargs)))
        server.metrics.count_tokens([result.completions])
        return JSONResponse(reasoning_body(result, server.model_name))

    @app.post("/v1/rksc/tree_search")
    async def rksc_tree_search(request: Request) -> Response:
        server.authorize(request)
        tree_search = server.local_method("tree_search", "/v1/rksc/tree_search")
        body = await server.parse(request, TreeSearchRequest)
        _check(lambda: body.check(server.limits))
        kwargs = _check(body.engine_kwargs)

        async def search() -> Any:
            # Synchronous: it submits each level to the scheduler and waits, so it runs on a pool
            # thread; its token stops it when the client goes away or the server shuts down.
            token = CancelToken()
            run = server.search_pool.run(lambda: tree_search(body.question, cancel=token, **kwargs),
                                         on_cancel=token.cancel)
            return await _until_disconnect(request, run)

        result = await server.call_engine("/v1/rksc/tree_search", body.prompt_field, "breadth", search)
        return JSONResponse(search_body(result, server.model_name))

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        server.authorize(request)
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.started, "owned_by": "rksc",
            "max_model_len": engine.context_window,
        }]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        server.authorize(request)
        # Reads engine.stats(), which never waits for the engine, so this is safe on the event loop.
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _check(check: Callable[[], Any]) -> Any:
    """``check()``'s result; its ``InvalidRequest`` as a 400."""
    try:
        return check()
    except InvalidRequest as error:
        raise APIError(400, str(error), error.param) from None


class _Server:
    """What the routes share: the engine, the limits, the metrics, the worker pools, and the
    request plumbing."""

    def __init__(self, engine: LocalEngine, api_key: str | None, model_name: str, limits: ServeLimits,
                 worker_threads: int) -> None:
        self.engine = engine
        self.api_key = api_key
        self.model_name = model_name
        self.limits = limits
        self.metrics = ServeMetrics(engine)
        self.token_text = TokenText(engine.tokenizer)
        self.started = int(time.time())
        self.prompt_pool = WorkerPool("rksc-prompts", worker_threads)
        self.turn_pool = WorkerPool("rksc-turns", worker_threads)
        self.search_pool = WorkerPool("rksc-search", worker_threads)
        self.exposure_warned = False
        self._addresses_seen: set[str] = set()

    def close(self, wait_s: float = SHUTDOWN_WAIT_S) -> bool:
        """Stop the worker pools (at the server's shutdown): queued calls are dropped, running ones
        cancelled, and waited for ``wait_s`` seconds at most over all pools. Returns whether every
        pool thread ended in that time (those that did not are daemons: they never block the exit)."""
        deadline = time.monotonic() + wait_s
        pools = (self.prompt_pool, self.turn_pool, self.search_pool)
        for pool in pools:
            pool.shutdown()  # cancel everything first, so the pools' calls stop together
        return all([pool.shutdown(wait_s=max(0.0, deadline - time.monotonic())) for pool in pools])

    # -- requests in ----------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            self._note_address(request)
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def _note_address(self, request: Request) -> None:
        """Warn (once) when a keyless server is first reached on a non-loopback address."""
        server = request.scope.get("server")
        if self.exposure_warned or not server or server[0] in self._addresses_seen:
            return
        address = str(server[0])
        self._addresses_seen.add(address)
        try:
            ipaddress.ip_address(address)
        except ValueError:  # a Unix socket's path or a host name a test client made up
            return
        self.exposure_warned = warn_if_exposed(address, None)

    async def parse(self, request: Request, model: type[Any]) -> Any:
        """The body validated as ``model``; 400 for a body over the limit, not JSON, or a bad field."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise APIError(400, f"request body is {declared} bytes; the limit is {limit} bytes")
        data = bytearray()
        async for piece in request.stream():
            data += piece
            if len(data) > limit:
                raise APIError(400, f"request body is over the limit of {limit} bytes")
        try:
            return model.model_validate_json(bytes(data), context={"limits": self.limits})
        except ValidationError as error:
            raise _validation_error(error) from None

    def local_method(self, name: str, route: str) -> Callable[..., Any]:
        """The engine's method ``name`` that ``route`` needs; 501 when the engine has none."""
        method = getattr(self.engine, name, None)
        if not callable(method):
            raise APIError(501, f"{route} needs a local RKSCEngine: this server's engine "
                           f"({type(self.engine).__name__}) has no {name}", error_type="not_implemented_error")
        return method

    async def call_engine(self, route: str, prompt_param: str, n_param: str, call: Callable[[], Awaitable[Any]]
                          ) -> Any:
        """Run an rksc route's engine call: its ``ValueError``/``TypeError`` are 400s naming the field
        (``prompt_param`` for the prompt, ``n_param`` for the engine's ``n``), its
        ``NotImplementedError`` a 501."""
        try:
            return await call()
        except NotImplementedError as error:
            raise APIError(501, f"{route} is not available on this server: {error}",
                           error_type="not_implemented_error") from None
        except (ValueError, TypeError) as error:
            param = engine_error_field(str(error), prompt_param, n_param)
            raise APIError(400, f"{param}: {error}", param) from None

    async def submit(self, prompts: Sequence[Any], body: Any, default_max_tokens: int, prompt_param: str, *,
                     stop_at_tool_call: bool = False
                     ) -> tuple[SamplingParams, list[RequestHandle], list[TopLogprobsRecorder | None]]:
        """``submit_now`` on the prompt pool: encoding a long prompt takes the tokenizer seconds,
        which the event loop must not wait for."""
        return await self.prompt_pool.run(lambda: self.submit_now(prompts, body, default_max_tokens, prompt_param,
                                                                  stop_at_tool_call=stop_at_tool_call))

    def submit_now(self, prompts: Sequence[Any], body: Any, default_max_tokens: int, prompt_param: str, *,
                   stop_at_tool_call: bool = False
                   ) -> tuple[SamplingParams, list[RequestHandle], list[TopLogprobsRecorder | None]]:
        """One engine request per prompt, all queued before any is awaited; the engine's own checks
        are 400s (and cancel what was already queued). Returns the request's own sampling
        parameters; with ``stop_at_tool_call`` the engine also stops at the tool-call opener."""
        handles: list[RequestHandle] = []
        top_k, n, stream = body.num_top_logprobs, body.n, body.stream
        recorders = [TopLogprobsRecorder(top_k) if top_k else None for _ in prompts]
        try:
            params = body.sampling_params(default_max_tokens)
            submitted = tool_protocol.with_tool_call_stop(params) if stop_at_tool_call else params
            for prompt, recorder in zip(prompts, recorders):
                handles.append(self.engine.submit(prompt, n, submitted, stream=stream, logits_processor=recorder))
        except (ValueError, TypeError) as error:
            for handle in handles:
                handle.cancel()
            raise _engine_400(error, prompt_param) from None
        return params, handles, recorders

    def turn_prompt(self, body: ChatCompletionRequest, plan: ChatPlan, messages: list[dict[str, Any]]
                    ) -> tuple[list[int], SamplingParams]:
        """The prompt with the plan's tools offered (and JSON asked for), and the request's sampling
        parameters, both checked by the engine before anything runs: 400 naming the field, 501 for
        an engine that cannot render tools (it has no tokenizer of its own)."""
        try:
            prompt_ids = tool_protocol.encode_with_tools(self.engine, messages, plan.tools,
                                                         json_answer=plan.json_answer, schema=plan.schema)
            params = body.sampling_params(self.limits.max_tokens)
            if plan.constrained_from_start:  # its value calls are single short requests on this prompt
                self.engine.validate_request(prompt_ids, 1, value_params(params, params.seed))
        except NotImplementedError as error:
            raise APIError(501, f"tools and response_format need a local RKSCEngine: {error}",
                           error_type="not_implemented_error") from None
        except (ValueError, TypeError) as error:
            raise _engine_400(error, "messages") from None
        return prompt_ids, params

    # -- answers out ----------------------------------------------------------------------------
    async def generate(self, request: Request, shape: Shape, body: Any, prompts: Sequence[Any],
                       default_max_tokens: int, prompt_param: str) -> Response:
        params, handles, recorders = await self.submit(prompts, body, default_max_tokens, prompt_param)
        reply = _Reply(self, shape, body, params, recorders)
        if body.stream:
            return _event_stream(reply.events(handles))
        per_prompt = await _until_disconnect(request, _completions(handles))
        self.metrics.count_tokens(per_prompt)
        return JSONResponse(reply.whole(per_prompt))

    async def generate_turns(self, request: Request, shape: ChatShape, body: ChatCompletionRequest,
                             plan: ChatPlan, messages: list[dict[str, Any]]) -> Response:
        """A chat request with tools offered or a JSON answer asked for (``rksc_serve.tool_turns``).
        Each choice's blocking engine work runs on the turn pool and is cancelled with its request."""
        prompt_ids, params = await self.prompt_pool.run(self.turn_prompt, body, plan, messages)
        if plan.constrained_from_start:
            reply = _Reply(self, shape, body, params, [None])

            async def decide_one(i: int) -> Turn:
                seed = choice_seed(params.seed, i)
                return await self.turn_pool.run_cancellable(
                    self.engine, lambda engine: constrained_turn(engine, prompt_ids, params, plan, seed))

            async def decide() -> list[Turn]:
                return await _all(decide_one(i) for i in range(body.n))

            if body.stream:
                return _event_stream(reply.turn_events(decide))
            turns = await _until_disconnect(request, decide())
        else:
            assert plan.tools is not None
            tools = plan.tools

            async def finish(completion: Completion) -> Turn:
                return await self.turn_pool.run_cancellable(
                    self.engine, lambda engine: finish_turn(engine, prompt_ids, tools, completion, params))

            params, handles, recorders = await self.submit([prompt_ids], body, self.limits.max_tokens, "messages",
                                                           stop_at_tool_call=True)
            reply = _Reply(self, shape, body, params, recorders)
            if body.stream:
                return _event_stream(reply.events(handles, finish))

            async def generate_then_finish() -> list[Turn]:
                [completions] = await _completions(handles)
                return await _all(finish(c) for c in completions)

            turns = await _until_disconnect(request, generate_then_finish())
        answer = reply.whole_turns(turns)
        self.metrics.count_usage(answer["usage"])
        return JSONResponse(answer)


class _Reply:
    """One request's answer in ``shape``: a whole body or a stream of server-sent events."""

    def __init__(self, server: _Server, shape: Shape, body: Any, params: SamplingParams,
                 recorders: list[TopLogprobsRecorder | None]) -> None:
        self.server, self.shape, self.body, self.params, self.recorders = server, shape, body, params, recorders
        self.id = shape.id_prefix + secrets.token_hex(12)
        self.created = int(time.time())

    def _logprobs(self, completion: Completion, prompt_index: int) -> dict | None:
        if not self.body.wants_logprobs:
            return None
        recorder = self.recorders[prompt_index]
        top = recorder.top(completion.token_ids) if recorder is not None else None
        return self.shape.logprobs(completion, top)

    def _chunk_logprobs(self, chunk: StreamChunk, before: tuple[int, ...], prompt_index: int) -> dict | None:
        """The log-probs of the tokens one streamed chunk carries (``before``: its choice's tokens in
        earlier chunks), so a client reads each token's as it arrives, as from OpenAI and vLLM."""
        if not self.body.wants_logprobs:
            return None
        recorder = self.recorders[prompt_index]
        top = recorder.top(before + chunk.token_ids)[len(before):] if recorder is not None else None
        return self.shape.logprobs(chunk, top)

    def _stop(self, completion: Completion) -> str | None:
        return stop_reason(completion, self.params.stop, self.server.engine.tokenizer)

    def whole(self, per_prompt: list[list[Completion]]) -> dict[str, Any]:
        n = self.body.n
        choices = [self.shape.choice(p * n + c.branch_index, c, self._logprobs(c, p), self._stop(c))
                   for p, completions in enumerate(per_prompt) for c in completions]
        return envelope(self.shape, self.id, self.created, self.server.model_name, choices, chunk=False,
                        usage_body=usage(per_prompt))

    def whole_turns(self, turns: list[Turn]) -> dict[str, Any]:
        """The body of one prompt's decided turns (choice ``i`` is turn ``i``)."""
        assert isinstance(self.shape, ChatShape)
        choices = [self.shape.turn_choice(i, turn) for i, turn in enumerate(turns)]
        return envelope(self.shape, self.id, self.created, self.server.model_name, choices, chunk=False,
                        usage_body=turns_usage(turns))

    def _event(self, choices: list[dict], usage_body: dict | None = None) -> str:
        body = envelope(self.shape, self.id, self.created, self.server.model_name, choices, chunk=True,
                        usage_body=usage_body)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _openings(self, count: int) -> list[str]:
        openings = [self.shape.opening_choice(i) for i in range(count)]
        return [self._event([o for o in openings if o])] if any(openings) else []

    def _closing(self, usage_body: dict[str, Any]) -> list[str]:
        """The usage chunk (when asked for) and ``[DONE]``; the request's tokens are counted."""
        self.server.metrics.count_usage(usage_body)
        return ([self._event([], usage_body)] if self.body.include_usage else []) + ["data: [DONE]\n\n"]

    async def events(self, handles: list[RequestHandle],
                     finish: Callable[[Completion], Awaitable[Turn]] | None = None) -> AsyncIterator[str]:
        """The stream: opening chunks, a chunk per step and choice, the usage chunk, ``[DONE]``.

        Prompts are read one after another; they decode concurrently all the same (their chunks wait
        in their handles). Closing this generator (the client went away) cancels every handle.
        With ``finish`` (tools offered) each finished choice becomes a turn, whose calls follow its
        text (``ChatShape.turn_chunks``).
        """
        n = self.body.n
        try:
            for opening in self._openings(n * len(handles)):
                yield opening
            per_prompt: list[list[Completion]] = []
            turns: list[Turn] = []
            for p, handle in enumerate(handles):
                finished: list[Completion] = []
                streamed_ids: dict[int, tuple[int, ...]] = {}  # per choice, the tokens its chunks carried
                async for chunk in handle:
                    index = p * n + chunk.branch_index
                    before = streamed_ids.get(index, ())
                    streamed_ids[index] = before + chunk.token_ids
                    if chunk.completion is None:
                        if chunk.text:
                            yield self._event([self.shape.delta_choice(index, chunk.text,
                                                                       self._chunk_logprobs(chunk, before, p))])
                        continue
                    completion = chunk.completion
                    finished.append(completion)
                    if finish is None:
                        yield self._event([self.shape.final_choice(
                            index, chunk.text, completion, self._chunk_logprobs(chunk, before, p),
                            self._stop(completion))])
                        continue
                    assert isinstance(self.shape, ChatShape)
                    turn = await finish(completion)
                    turns.append(turn)
                    for choice in self.shape.turn_chunks(index, chunk.text, turn):
                        yield self._event([choice])
                per_prompt.append(sorted(finished, key=lambda c: c.branch_index))
            for event in self._closing(usage(per_prompt) if finish is None else turns_usage(turns)):
                yield event
        except RequestCancelled:
            return
        except Exception as error:  # the headers are gone: report in the stream, as OpenAI does
            yield _stream_error(error)
        finally:
            for handle in handles:
                if not handle.done():
                    handle.cancel()

    async def turn_events(self, decide: Callable[[], Awaitable[list[Turn]]]) -> AsyncIterator[str]:
        """The stream of constrained answers: the opening chunk at once, then each choice's answer
        (its JSON text, its calls) once ``decide()`` has decoded them all, the usage chunk, ``[DONE]``."""
        assert isinstance(self.shape, ChatShape)
        try:
            for opening in self._openings(self.body.n):
                yield opening
            turns = await decide()
            for index, turn in enumerate(turns):
                for choice in self.shape.turn_chunks(index, turn.content, turn):
                    yield self._event([choice])
            for event in self._closing(turns_usage(turns)):
                yield event
        except Exception as error:
            yield _stream_error(error)


def _engine_400(error: Exception, prompt_param: str) -> APIError:
    """An engine ``ValueError``/``TypeError`` as a 400 naming the request field it is about."""
    param = engine_error_param(str(error), prompt_param)
    return APIError(400, f"{param}: {error}", param)


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _stream_error(error: Exception) -> str:
    """An error once a stream's headers are gone: reported in the stream, as OpenAI does."""
    return f"data: {json.dumps(internal_error(error).body())}\n\n"


async def _completions(handles: list[RequestHandle]) -> list[list[Completion]]:
    """Each handle's completions; when this is cancelled or one fails, the rest are cancelled too."""
    try:
        return [await handle for handle in handles]
    finally:
        for handle in handles:
            if not handle.done():
                handle.cancel()


async def _all(calls: Iterable[Awaitable[T]]) -> list[T]:
    """Every call's result, in order; when one fails or this is cancelled, the others are cancelled
    (``asyncio.gather`` alone would leave them running after the first failure)."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # a no-op for the finished ones


async def _client_gone(request: Request) -> None:
    """Return once the client of ``request`` has gone away.

    Its body has been read, so the server's ``receive()`` answers only when the connection closes
    (Starlette's ``StreamingResponse`` watches a stream's client the same way).
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _client_closed() -> APIError:
    """The answer to a request whose client went away (nginx's 499, "client closed request")."""
    return APIError(499, "the client closed the request", error_type="cancelled")


def _client_address(request: Request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client is not None else "(unknown)"


async def _until_disconnect(request: Request, call: Awaitable[T]) -> T:
    """``call``'s result, awaited as a task that is cancelled (with the requests and pool calls it
    awaits) as soon as the client goes away: then, or when the request was cancelled, a 499."""
    task = asyncio.ensure_future(call)

    async def cancel_when_gone() -> None:
        await _client_gone(request)
        task.cancel()

    watcher = asyncio.create_task(cancel_when_gone())
    try:
        return await task
    except asyncio.CancelledError:
        if not watcher.done():  # this handler itself was cancelled, not the call
            raise
        raise _client_closed() from None
    except RequestCancelled:
        raise _client_closed() from None
    finally:
        watcher.cancel()


def _validation_error(error: ValidationError) -> APIError:
    first = error.errors(include_url=False)[0]
    kind, loc, message = first["type"], tuple(first["loc"]), first["msg"]
    message = message.removeprefix("Value error, ")
    if kind == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {message}")
    param = error_param(loc)
    if param is None:
        return APIError(400, f"request body must be a JSON object: {message}")
    if kind == "missing":
        return APIError(400, f"{param} is required", param)
    return APIError(400, f"{param}: {message}", param)
