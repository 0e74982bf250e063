"""``RemoteEngine``: the engine's generation and reasoning API over any OpenAI-compatible server
(``rksc serve``, vLLM, SGLang, llama.cpp's server, Ollama, ``transformers serve``), returning the
engine's own ``Completion``, ``StreamChunk`` and ``ReasoningResult``.

Contract:
    * ``submit`` / ``generate`` / ``generate_branches`` (one request with ``n``) / ``generate_many`` /
      ``stream`` and their async forms behave as ``RKSCEngine``'s: ``submit`` returns a
      ``RequestHandle`` at once (iterate it, ``result()``, ``await`` it, ``cancel()`` it), and many
      requests are in flight together, so the server batches them.
    * Prompts are text: a string goes to ``/v1/completions``, a list of chat messages to
      ``/v1/chat/completions`` (the server applies its chat template). Token ids raise ``TypeError``:
      the server tokenizes with its own tokenizer. ``model``, ``api_key`` and the URL are the one
      configuration: the adapters and ``rksc ask --server`` build a ``RemoteEngine`` from them.
    * A ``Completion`` holds what the server says: ``text``, ``logprobs`` (each generated token's,
      from ``logprobs.content[*].logprob``; empty from a server that sends none, whose
      ``confidence`` is then 1.0), ``finish_reason`` (``"length"``; ``"stop"`` when the
      server names a stop string in vLLM's ``stop_reason``, or when stop strings were asked for and
      it does not say; ``"eos"`` otherwise), ``num_prompt_tokens`` and ``num_cached_tokens`` (from
      ``usage.prompt_tokens_details.cached_tokens``). ``token_ids`` is ``()``: servers do not send ids;
      ``num_reported_tokens`` counts the tokens. A stream must end with ``data: [DONE]``, or with
      every choice finished (``transformers serve`` sends no marker); one that stops short of
      either raises ``ConnectionError``.
    * ``stats()`` is an ``EngineStats`` filled from the servers' ``usage``: requests, prompt tokens
      computed and reused (cached), decode tokens (a request closed early: the tokens it had
      received), cache hits and misses, and the requests in flight. Cache bytes and the batch are
      the server's and stay 0.
    * Transport: every request is streamed from the server (``stream: true``, assembled here when
      the caller did not ask for a stream), so bytes keep flowing while it generates and ``timeout``
      bounds only the silence between them. A request is sent again only when it cannot have
      started any work: a failed connect, a 429 or a 503 (after the server's ``Retry-After`` when
      it names one of at most 120 s, else exponential backoff; ``max_retries`` times; a longer
      ``Retry-After`` fails at once). Once it may have reached the server it is never sent again,
      since each resend of a generation could be one more generation there: a read timeout raises
      ``TimeoutError``, a connection dropped mid-answer ``ConnectionError``, another 5xx
      ``RemoteServerError``. A 400 is a ``ValueError`` with the server's message (401/403
      ``PermissionError``).
    * Cancelling a request (``handle.cancel()``, cancelling the task that awaits it, leaving its
      stream, ``close()``) shuts its connection at once, so the server sees the client go and
      stops generating (``rksc serve`` frees the request's KV), and its worker thread ends. A
      request cancelled before the server has sent its response headers is cut off when they
      arrive.
    * Requests run on daemon threads, at most ``max_concurrency`` at once, that exist only while
      requests are queued or in flight: an engine that is never closed does not hold up the
      interpreter's exit.
    * Reasoning runs here as on a local engine, through the same code (``reason``, ``areason``,
      ``tree_search``): ``submit(monitor=..., max_branches=...)`` runs a request's branches as
      requests of one choice each that an early-stop rule can end (``rksc_engine.remote_branches``);
      ``top_next_tokens`` gives the log-prob judge its Yes/No; ``capabilities()`` says what the
      server provides (``rksc_engine.remote_probe``), and reasoning names what it lacks.
    * What only a local engine can do raises ``NotImplementedError`` saying so: logits processors,
      prefill and cache control, CGEE's layer exit (hidden states), ASKS and RSBCM settings.

``httpx`` is imported when a ``RemoteEngine`` is built (it comes with the LangChain and LlamaIndex
extras, and with ``pip install httpx``); the rest of ``rksc_engine`` does not need it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from .config import SamplingParams, check_branch_hooks, check_request_shape
from .remote_branches import BranchFanOut, BranchListener
from .remote_probe import ProbeAnswer, probe_capabilities
from .remote_wire import (
    AnswerChoice,
    RemoteServerError,
    WorkerThreads,
    completions_from,
    error_message,
    json_or_text,
    prompt_body,
    retry_after_s,
    sampling_body,
    settle,
    status_error,
    usage_of_choices,
)
from .results import Completion, EngineStats, ServerCapabilities, StreamChunk
from .runtime.handle import (
    BranchMonitor,
    LogitsProcessor,
    RequestCancelled,
    RequestChannel,
    RequestHandle,
    astream_chunks,
    stream_chunks,
)

# Statuses that say the server turned the request away before working on it: rate limited, or
# unavailable. A 500, 502 or 504 may come after the generation started (a proxy's 504 certainly
# does), so sending again could run it twice.
RETRYABLE_STATUS = frozenset({429, 503})
# The longest ``Retry-After`` waited for (the OpenAI client's limit): a server that asks for more is
# not coming back soon, and a worker parked for minutes helps nobody.
MAX_RETRY_AFTER_S = 120.0
MAX_BACKOFF_S = 30.0
LOCAL_ONLY = ("it needs a local RKSCEngine: over an OpenAI-compatible API the model, its KV and its prefix cache "
              "are the server's")


class RemoteEngine:
    """The engine's generation API over an OpenAI-compatible server.

    Args:
        base_url: The API root as OpenAI clients take it, e.g. ``"http://127.0.0.1:8000/v1"``.
        model: The model id to ask for; None takes the first one ``GET /models`` lists.
        api_key: Sent as ``Authorization: Bearer <api_key>``.
        timeout: Seconds to wait to connect and between bytes of an answer (> 0). Answers are
            streamed, so this bounds the server's silence, not the length of a generation.
        max_retries: Retries of a request that cannot have started: a failed connect, a 429 or a
            503 (>= 0). Default 3.
        retry_backoff_s: First wait between tries when the server names none (``Retry-After``),
            doubling each retry (>= 0). Default 0.5.
        max_concurrency: Requests in flight at once (>= 1); more wait their turn. Default 64.
        transport: The ``httpx`` transport to send through (an ``httpx.HTTPTransport`` with its own
            proxy or TLS settings); None: httpx's, with ``max_concurrency`` connections.

    Example:
        >>> engine = RemoteEngine("http://127.0.0.1:8000/v1")
        >>> engine.generate_branches("Q: 2+3=?\\nA:", n=4, params=SamplingParams(temperature=0.7, seed=0))
    """

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, timeout: float = 60.0,
                 *, max_retries: int = 3, retry_backoff_s: float = 0.5, max_concurrency: int = 64,
                 transport: Any = None) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL like 'http://127.0.0.1:8000/v1', got {base_url!r}")
        for name, value in (("model", model), ("api_key", api_key)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        for name, value, least in (("max_retries", max_retries, 0), ("max_concurrency", max_concurrency, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if isinstance(retry_backoff_s, bool) or not isinstance(retry_backoff_s, (int, float)) or not retry_backoff_s >= 0:
            raise ValueError(f"retry_backoff_s must be >= 0, got {retry_backoff_s!r}")
        try:
            import httpx
        except ImportError:
            raise ImportError("RemoteEngine needs httpx: pip install httpx") from None
        self._httpx = httpx
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.max_retries = max_retries
        self.retry_backoff_s = float(retry_backoff_s)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=self.timeout, headers=headers, transport=transport,
                                    limits=httpx.Limits(max_connections=max_concurrency))
        self._workers = WorkerThreads(max_concurrency, "rksc-remote")
        self._calls: set[_Call] = set()  # queued or in flight, for ``close`` to cancel
        self._calls_lock = threading.Lock()
        self._model = model
        self._model_lock = threading.Lock()
        self._stats = EngineStats()
        self._stats_lock = threading.Lock()
        self._ids = itertools.count()
        self._capabilities: ServerCapabilities | None = None
        self._capabilities_lock = threading.Lock()

    # -- identity -------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        """The model id requests name: ``model``, or the first one the server lists."""
        with self._model_lock:
            if self._model is None:
                response = self._send("GET", "models", None, None)
                try:
                    response.read()
                finally:
                    response.close()
                data = response.json().get("data") or []
                if not data:
                    raise RemoteServerError(f"{self.base_url}/models lists no model; pass model=", response.status_code)
                self._model = str(data[0]["id"])
            return self._model

    def __repr__(self) -> str:
        return f"RemoteEngine({self.base_url!r}, model={self._model!r})"

    # -- the request API ------------------------------------------------------------------------
    def submit(self, prompt: Any, n: int = 1, params: SamplingParams | None = None, *, stream: bool = False,
               logits_processor: LogitsProcessor | None = None, monitor: BranchMonitor | None = None,
               max_branches: int | None = None) -> RequestHandle:
        """Send a request of ``n`` choices and return its handle at once (as ``RKSCEngine.submit``).

        ``handle.num_prompt_tokens`` is None: the server tokenizes; each ``Completion`` has the count.
        With a ``monitor`` (or when ``capabilities()`` found that the server ignores ``n``) the
        branches are ``n`` requests of one choice each, branch ``i`` seeded ``seed + i``, that the
        monitor watches token by token and may end or add to, up to ``max_branches``
        (``rksc_engine.remote_branches``). A ``logits_processor`` acts inside the server's decode
        loop, so it is refused (``NotImplementedError``) before anything is sent.
        """
        if logits_processor is not None:
            raise NotImplementedError(f"a logits processor runs inside the decode loop, so {LOCAL_ONLY}")
        path, body = prompt_body(prompt)
        params = check_request_shape(n, params)
        max_branches = check_branch_hooks(n, params, stream, monitor, max_branches)
        if max_branches > n:
            if monitor is None:
                raise ValueError("max_branches > n needs a monitor, which is what adds branches")
        if monitor is not None or (n > 1 and self._capabilities is not None and not self._capabilities.n):
            body.update(sampling_body(path, 1, params))
            fan_out = BranchFanOut(next(self._ids), n, max_branches, params, monitor, stream,
                                   lambda index, listener: self._start_branch(path, body, index, params, listener))
            return fan_out.launch()
        body.update(sampling_body(path, n, params))
        call = _Call(RequestChannel(), next(self._ids))
        self._queue_call(call, lambda: self._run(call, path, body, n, params, stream))
        return RequestHandle(call.request_id, None, n, call.channel, _Waiter(call))

    def _queue_call(self, call: _Call, job: Callable[[], None]) -> None:
        with self._calls_lock:
            self._calls.add(call)
        try:
            self._workers.submit(job)
        except RuntimeError:
            with self._calls_lock:
                self._calls.discard(call)
            raise

    def _start_branch(self, path: str, body: dict, index: int, params: SamplingParams,
                      listener: BranchListener) -> Callable[[], None]:
        """Queue branch ``index`` of a fanned-out request: one choice, seeded ``seed + index``.
        Returns what closes its connection."""
        branch_body = dict(body)
        if params.seed is not None:
            branch_body["seed"] = params.seed + index
        call = _Call(RequestChannel(), next(self._ids))
        self._queue_call(call, lambda: self._run_branch(call, path, branch_body, index, params, listener))
        return call.cancel

    def generate(self, prompt: Any, params: SamplingParams | None = None) -> Completion:
        """One completion of ``prompt``."""
        return self.submit(prompt, 1, params).result()[0]

    def generate_branches(self, prompt: Any, n: int, params: SamplingParams | None = None) -> list[Completion]:
        """``n`` completions of one prompt, in one request (``n``); one request per branch, branch i
        seeded ``seed + i``, once ``capabilities()`` has found that the server ignores ``n``. On
        ``rksc serve`` branch i is seeded ``seed + i``, as in a local engine; other servers seed a
        request of ``n`` choices as they do."""
        return self.submit(prompt, n, params).result()

    def generate_many(self, prompts: Sequence[Any], params: SamplingParams | None = None) -> list[Completion]:
        """One completion per prompt, all requests in flight at once."""
        return [h.result()[0] for h in self._submit_all(prompts, params)]

    def stream(self, prompt: Any, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """The text of one completion as the server streams it; the last chunk carries the
        ``Completion``. Closing the iterator closes the connection."""
        return stream_chunks(self.submit(prompt, 1, params, stream=True))

    async def agenerate(self, prompt: Any, params: SamplingParams | None = None) -> Completion:
        return (await self.submit(prompt, 1, params))[0]

    async def agenerate_branches(self, prompt: Any, n: int, params: SamplingParams | None = None) -> list[Completion]:
        return await self.submit(prompt, n, params)

    async def agenerate_many(self, prompts: Sequence[Any], params: SamplingParams | None = None) -> list[Completion]:
        return [(await h)[0] for h in self._submit_all(prompts, params)]

    async def astream(self, prompt: Any, params: SamplingParams | None = None) -> AsyncIterator[StreamChunk]:
        async for chunk in astream_chunks(self.submit(prompt, 1, params, stream=True)):
            yield chunk

    def _submit_all(self, prompts: Sequence[Any], params: SamplingParams | None) -> list[RequestHandle]:
        if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of prompts")
        for prompt in prompts:  # every prompt is checked before any is sent
            prompt_body(prompt)
        check_request_shape(1, params)
        return [self.submit(p, 1, params) for p in prompts]

    # -- stats ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Counters summed from the servers' ``usage`` since this object was built (or ``reset_stats``);
        ``running_requests`` is the requests queued or in flight now. A branch closed early counts
        the tokens it had received once its connection is down, which can be just after its request
        has answered: read the counters once ``running_requests`` is 0."""
        with self._calls_lock:
            running = len(self._calls)
        with self._stats_lock:
            return dataclasses.replace(self._stats, extra=dict(self._stats.extra), running_requests=running)

    def reset_stats(self) -> None:
        with self._stats_lock:
            self._stats = EngineStats()

    def _count(self, usage: dict | None) -> None:
        usage = usage or {}
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        with self._stats_lock:
            self._stats.requests += 1
            self._stats.prompt_tokens_computed += prompt_tokens - cached
            self._stats.prompt_tokens_reused += cached
            self._stats.decode_tokens += int(usage.get("completion_tokens") or 0)
            if cached:
                self._stats.cache_hits += 1
            else:
                self._stats.cache_misses += 1

    def _count_cancelled(self, choices: dict[int, AnswerChoice]) -> None:
        """A request ended by closing its connection has no usage: count the tokens that arrived."""
        with self._stats_lock:
            self._stats.requests += 1
            self._stats.decode_tokens += sum(len(c.logprobs) or c.num_deltas for c in choices.values())

    # -- reasoning over the server --------------------------------------------------------------
    def reason(self, question: str, **kwargs: Any) -> Any:
        """Verified self-consistency over the server (``rksc_engine.reasoning.reason``, the same code
        a local engine runs): the branches are requests the early-stop rules can end, the judge reads
        the judge prompt's next-token log-probs (CGEE level 1; level 2 needs hidden states and is
        refused), and ``ReasoningResult.server_limits`` names what the server did not provide."""
        from .reasoning.self_consistency import reason  # reasoning is built on the engine, not under it

        return reason(self, question, **kwargs)

    async def areason(self, question: str, **kwargs: Any) -> Any:
        """``reason`` for asyncio: the branches are awaited, the judge runs in a worker thread."""
        import asyncio

        from .reasoning.self_consistency import areason

        await asyncio.to_thread(self.capabilities)  # the probe's requests block: not on the event loop
        return await areason(self, question, **kwargs)

    def tree_search(self, question: str, **kwargs: Any) -> Any:
        """Beam search over reasoning steps on the server (``rksc_engine.reasoning.served_search``):
        each level's expansions are sent together, a child's request continues its path's text,
        children run under the early-stop rules, scores come from path confidence or the log-prob
        judge. The cache annotation of RSBCM is the server's business and is not done."""
        from .reasoning.served_search import tree_search_over_server

        return tree_search_over_server(self, question, **kwargs)

    def capabilities(self, refresh: bool = False) -> ServerCapabilities:
        """What the server provides (log-probs, top log-probs, ``n``, per-request seeds, cached-token
        counts, the ``[DONE]`` marker), probed once with a few requests of at most 16 tokens (not
        counted in ``stats()``) and remembered (``refresh=True`` probes again). Reasoning reads it
        before it sends anything."""
        with self._capabilities_lock:
            if self._capabilities is None or refresh:
                self._capabilities = probe_capabilities(self)
            return self._capabilities

    def top_next_tokens(self, prompts: Sequence[Any], num_top: int = 20) -> list[dict[str, float]]:
        """Per prompt, the most likely first tokens of the server's answer with their log-probs
        (``{token text: logprob}``, from one greedy token's ``top_logprobs``; empty when the server
        sends none). All prompts are in flight at once."""
        if isinstance(num_top, bool) or not isinstance(num_top, int) or not 1 <= num_top <= 20:
            raise ValueError(f"num_top must be an int in [1, 20], got {num_top!r}")
        prompts = list(prompts)
        for prompt in prompts:
            prompt_body(prompt)
        futures = [concurrent.futures.Future() for _ in prompts]
        for prompt, future in zip(prompts, futures):
            self._workers.submit(lambda p=prompt, f=future: settle(f, lambda: self.probe(p, num_top=num_top)))
        return [(future.result().top_logprobs or [{}])[0] for future in futures]

    def probe(self, prompt: Any, n: int = 1, params: SamplingParams | None = None, *,
              num_top: int = 0, count: bool = True) -> ProbeAnswer:
        """One small request sent from this thread, answered raw: its first choice as the server sent
        it (text, log-probs and ``top_logprobs`` per position), the number of choices, the usage and
        whether the stream ended with ``[DONE]``. What ``capabilities`` and the log-prob judge read.
        ``count=False`` leaves it out of ``stats()`` (the capability probe's requests are)."""
        path, body = prompt_body(prompt)
        params = check_request_shape(n, params or SamplingParams(max_new_tokens=1))
        body.update(sampling_body(path, n, params))
        if num_top:
            body["top_logprobs" if path == "chat/completions" else "logprobs"] = num_top
        body["model"] = self.model_name
        call = _Call(RequestChannel(), next(self._ids))
        response = self._send("POST", path, json.dumps(body).encode(), call)
        choices: dict[int, AnswerChoice] = {}
        try:
            usage, saw_done = self._read_choices(response, call, path, choices, None)
        finally:
            response.close()
        if count:
            self._count(usage)
        first = choices.get(0) or AnswerChoice(0)
        return ProbeAnswer(first.text, tuple(first.logprobs), tuple(first.top_logprobs), len(choices), usage or {},
                           saw_done)

    # -- what only a local engine does ----------------------------------------------------------
    def prefill(self, prompt: Any) -> Any:
        raise NotImplementedError(f"prefill hands out the prompt's KV, so {LOCAL_ONLY}")

    def warm_cache(self, prompt: Any) -> int:
        raise NotImplementedError(f"warm_cache fills the prefix cache, so {LOCAL_ONLY}")

    def annotate_cache(self, token_ids: Sequence[int], **kwargs: Any) -> int:
        raise NotImplementedError(f"annotate_cache sets RSBCM eviction scores, so {LOCAL_ONLY}")

    def clear_cache(self) -> None:
        raise NotImplementedError(f"clear_cache empties the prefix cache, so {LOCAL_ONLY}")

    def encode(self, prompt: Any) -> list[int]:
        raise NotImplementedError(f"token ids come from the model's tokenizer, so {LOCAL_ONLY}")

    def encode_chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        raise NotImplementedError(f"the chat template and token ids belong to the model's tokenizer, so {LOCAL_ONLY}")

    def __getattr__(self, name: str) -> Any:
        if name in ("config", "model", "tokenizer", "prefix_cache", "exclusive", "forward", "cached_prefix",
                    "cached_prefix_length", "context_window", "kv_bytes_per_token", "validate_request"):
            raise AttributeError(f"RemoteEngine has no {name}: {LOCAL_ONLY} (ASKS, RSBCM budgets and the "
                                 f"scheduler are configured on the server)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel every request queued or in flight (their handles raise ``RequestCancelled``, their
        connections are shut so the servers stop) and close the connections. Idempotent; later
        ``submit`` calls raise ``RuntimeError``."""
        self._workers.close()
        with self._calls_lock:
            calls, self._calls = list(self._calls), set()
        for call in calls:
            call.cancel()
        self._client.close()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- transport ------------------------------------------------------------------------------
    def _run(self, call: _Call, path: str, body: dict, n: int, params: SamplingParams, stream: bool) -> None:
        """Worker thread: send one request, fill its channel."""
        try:
            call.check()
            body["model"] = self.model_name
            response = self._send("POST", path, json.dumps(body).encode(), call)
            try:
                call.attach(response)
                completions, usage = self._read_answer(response, call, path, n, params, stream)
            finally:
                call.detach()  # before the connection can go back to the pool for another request
                response.close()
            self._count(usage)
            call.channel.finish(completions)
        except BaseException as error:  # whatever failed the request is its caller's to see
            # Once cancelled, the error (a connection shut under the reader) is the cancellation's doing.
            call.channel.fail(call.cancelled_error() if call.channel.cancelled.is_set() else error)
        finally:
            with self._calls_lock:
                self._calls.discard(call)

    def _run_branch(self, call: _Call, path: str, body: dict, index: int, params: SamplingParams,
                    listener: BranchListener) -> None:
        """Worker thread: send branch ``index`` of a fanned-out request, reporting to ``listener``."""
        choices: dict[int, AnswerChoice] = {}
        try:
            call.check()
            body["model"] = self.model_name
            response = self._send("POST", path, json.dumps(body).encode(), call)
            try:
                call.attach(response)
                usage, _ = self._read_choices(response, call, path, choices,
                                              lambda _choice, text, logprobs: listener.on_delta(index, text, logprobs))
            finally:
                call.detach()
                response.close()
            self._count(usage)
            [completion] = completions_from(choices, 1, params, usage)
            listener.on_end(index, dataclasses.replace(completion, branch_index=index))
        except BaseException as error:  # the request's to see (a cancellation: the branch was ended)
            cancelled = call.channel.cancelled.is_set()
            if cancelled:
                self._count_cancelled(choices)
            listener.on_error(index, call.cancelled_error() if cancelled else error)
        finally:
            with self._calls_lock:
                self._calls.discard(call)

    def _read_answer(self, response: Any, call: _Call, path: str, n: int, params: SamplingParams,
                     stream: bool) -> tuple[list[Completion], dict | None]:
        """Assemble the answer; when the caller streams, push each delta as a ``StreamChunk`` and then
        each branch's last chunk, with its ``Completion``, once the usage is known (an answer not
        streamed pushes no chunk, as a local engine's: ``handle.result()`` would spin on one)."""
        choices: dict[int, AnswerChoice] = {}

        def push(index: int, text: str, logprobs: list[float]) -> None:
            if text:
                call.channel.push(StreamChunk(text, branch_index=index, logprobs=tuple(logprobs)))

        usage, _ = self._read_choices(response, call, path, choices, push if stream else None)
        streamed = stream and response.headers.get("content-type", "").startswith("text/event-stream")
        completions = completions_from(choices, n, params, usage)
        if stream:
            for c in completions:
                call.channel.push(StreamChunk("" if streamed else c.text, completion=c, branch_index=c.branch_index))
        return completions, usage

    def _read_choices(self, response: Any, call: _Call, path: str, choices: dict[int, AnswerChoice],
                      on_delta: Callable[[int, str, list[float]], None] | None) -> tuple[dict | None, bool]:
        """Read an answer into ``choices`` (filled as it arrives, so a caller sees what came before an
        error), calling ``on_delta(index, text, logprobs)`` per streamed delta. Returns the usage and
        whether the answer ended with ``data: [DONE]`` (a whole answer counts as ended). A stream
        without it must have finished every choice: ``transformers serve`` never sends it. Several
        usage-only chunks (llama.cpp's server sends one per choice) are one usage
        (``usage_of_choices``)."""
        url = f"{self.base_url}/{path}"
        usage, ended = None, False
        usage_chunks: list[dict] = []  # the usage of chunks that carry nothing else
        try:
            if not response.headers.get("content-type", "").startswith("text/event-stream"):
                # A server that ignores ``stream`` answers whole.
                response.read()
                payload = response.json()
                usage, ended = payload.get("usage"), True
                for i, choice in enumerate(payload.get("choices") or []):
                    index = int(choice.get("index", i))
                    choices.setdefault(index, AnswerChoice(index)).add(choice, path, delta=False)
            else:
                for line in response.iter_lines():
                    call.check()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        ended = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        raise RemoteServerError(f"{url}: {error_message(event)}", 0)
                    if event.get("usage"):
                        usage = event["usage"]
                        if not event.get("choices"):
                            usage_chunks.append(event["usage"])
                    for choice in event.get("choices") or []:
                        index = int(choice.get("index", 0))
                        text, logprobs = choices.setdefault(index, AnswerChoice(index)).add(choice, path, delta=True)
                        if on_delta is not None and (text or logprobs):
                            on_delta(index, text, logprobs)
        except self._httpx.TimeoutException as error:
            raise TimeoutError(f"{url} sent nothing for {self.timeout} s; not sent again, since the server may "
                               f"still be generating: {error}") from error
        except self._httpx.TransportError as error:
            raise ConnectionError(f"the answer from {url} broke off: {error}") from error
        if not ended and not (choices and all(c.finish_reason for c in choices.values())):
            raise ConnectionError(f"the stream from {url} ended before 'data: [DONE]' with a choice unfinished")
        if len(usage_chunks) > 1:
            usage = usage_of_choices(usage_chunks)
        return usage, ended

    def _send(self, method: str, path: str, content: bytes | None, call: _Call | None) -> Any:
        """One HTTP exchange up to its response headers (the body is left to read). Sent again only
        when it cannot have reached the server's work: a failed connect, a 429 or a 503. Errors are
        mapped to Python's."""
        httpx, url = self._httpx, f"{self.base_url}/{path}"
        headers = {"Content-Type": "application/json"} if content else None
        for attempt in itertools.count(1):
            if call is not None:
                call.check()
            request = self._client.build_request(method, url, content=content, headers=headers)
            wait_s = None
            try:
                response = self._client.send(request, stream=True)
                if response.status_code >= 400:
                    try:
                        response.read()
                    finally:
                        response.close()
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as error:
                message, status = f"cannot connect to {url}: {error}", None
            except httpx.TimeoutException as error:
                raise TimeoutError(f"{url} did not answer within {self.timeout} s; not sent again, since the "
                                   f"server may be working on it: {error}") from error
            except httpx.TransportError as error:
                raise ConnectionError(f"lost the connection to {url}; not sent again, since the server may be "
                                      f"working on it: {error}") from error
            else:
                if response.status_code < 400:
                    return response
                message = f"{url} answered {response.status_code}: {error_message(json_or_text(response))}"
                if response.status_code not in RETRYABLE_STATUS:
                    raise status_error(message, response.status_code)
                status, wait_s = response.status_code, retry_after_s(response.headers)
                if wait_s is not None and wait_s > MAX_RETRY_AFTER_S:
                    raise RemoteServerError(f"{message} (it asks to wait {wait_s:.0f} s)", status)
            if attempt > self.max_retries:
                message = f"{message} (after {attempt} tries)"
                raise ConnectionError(message) if status is None else RemoteServerError(message, status)
            if wait_s is None:
                wait_s = min(self.retry_backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
            if call is None:
                time.sleep(wait_s)
            elif call.channel.cancelled.wait(wait_s):  # a cancel ends the wait at once
                raise call.cancelled_error()
        raise AssertionError("unreachable")


class _Call:
    """One request as its worker thread and whoever cancels it share it: its channel, and the socket
    of the response being read, which ``cancel`` shuts from the cancelling thread."""

    def __init__(self, channel: RequestChannel, request_id: int) -> None:
        self.channel = channel
        self.request_id = request_id
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None

    def cancelled_error(self) -> RequestCancelled:
        return RequestCancelled(f"request {self.request_id} was cancelled")

    def check(self) -> None:
        if self.channel.cancelled.is_set():
            raise self.cancelled_error()

    def attach(self, response: Any) -> None:
        """Make ``response``'s connection the one ``cancel`` shuts (raising at once if the request
        was cancelled while its headers were awaited)."""
        # httpx's documented ``network_stream`` extension; a transport without it (HTTP/2, a test
        # double) leaves the worker to notice the cancellation at the next line it reads.
        network_stream = response.extensions.get("network_stream")
        with self._lock:
            self._socket = network_stream.get_extra_info("socket") if network_stream is not None else None
        self.check()

    def detach(self) -> None:
        with self._lock:
            self._socket = None

    def cancel(self) -> None:
        """Release whoever waits on the request, and cut its connection. Never blocks for long."""
        self.channel.cancel()
        self.channel.fail(self.cancelled_error())
        with self._lock:
            if self._socket is None:
                return
            try:
                # A worker blocked reading the socket is not woken by closing it (the kernel keeps
                # the file open until the read returns); shutting it down is, and tells the server
                # the client has gone. The base class's method, so a TLS socket's state is left to
                # its own thread.
                socket.socket.shutdown(self._socket, socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the worker


class _Waiter:
    """The ``RequestDriver`` of a remote request: the worker thread fills the channel, there is
    nothing to step."""

    def __init__(self, call: _Call) -> None:
        self._call = call

    def holds_engine(self) -> bool:
        return False  # no engine lock here: an awaiting caller always waits for the worker

    def wait_for(self, channel: RequestChannel, timeout: float | None) -> None:
        channel.wait(timeout)

    def wake(self) -> None:
        # Called by ``handle.cancel()`` (and ``cancel_branches``, which a request of n choices cannot
        # honour: the server decides them together; a request submitted with a monitor has a branch
        # per request, which ``remote_branches`` ends one by one).
        if self._call.channel.cancelled.is_set():
            self._call.cancel()
