"""``RemoteEngine``: the engine's generation API over any OpenAI-compatible server (``rksc serve``,
vLLM, SGLang, llama.cpp's server), returning the engine's own ``Completion`` and ``StreamChunk``.

Contract:
    * ``submit`` / ``generate`` / ``generate_branches`` (one request with ``n``) / ``generate_many`` /
      ``stream`` and their async forms behave as ``RKSCEngine``'s: ``submit`` returns a
      ``RequestHandle`` at once (iterate it, ``result()``, ``await`` it, ``cancel()`` it), and many
      requests are in flight together, so the server batches them.
    * Prompts are text: a string goes to ``/v1/completions``, a list of chat messages to
      ``/v1/chat/completions`` (the server applies its chat template). Token ids raise ``TypeError``:
      the server tokenizes with its own tokenizer.
    * A ``Completion`` holds what the server says: ``text``, ``logprobs`` (each generated token's,
      from ``logprobs.content[*].logprob``), ``finish_reason`` (``"length"``; ``"stop"`` when the
      server names a stop string in vLLM's ``stop_reason``, or when stop strings were asked for and
      it does not say; ``"eos"`` otherwise), ``num_prompt_tokens`` and ``num_cached_tokens`` (from
      ``usage.prompt_tokens_details.cached_tokens``). ``token_ids`` is ``()``: servers do not send ids.
    * ``stats()`` is an ``EngineStats`` filled from the servers' ``usage``: requests, prompt tokens
      computed and reused (cached), decode tokens, cache hits and misses. Cache bytes and the batch
      are the server's and stay 0.
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
    * What only a local engine can do raises ``NotImplementedError`` saying so: logits processors,
      ``tree_search`` (it annotates the local radix cache), ``reason`` (its verifier reads the
      model's hidden states), prefill and cache control, ASKS and RSBCM settings.

``httpx`` is imported when a ``RemoteEngine`` is built (it comes with the LangChain and LlamaIndex
extras, and with ``pip install httpx``); the rest of ``rksc_engine`` does not need it.
"""

from __future__ import annotations

import collections
import dataclasses
import email.utils
import itertools
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from .config import SamplingParams, check_request_shape
from .results import Completion, EngineStats, FinishReason, StreamChunk
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


class RemoteServerError(RuntimeError):
    """The server answered with an error that retrying did not fix.

    Attributes:
        status_code: The HTTP status (0 for an error reported inside a stream).
    """

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


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
        self._workers = _Workers(max_concurrency, "rksc-remote")
        self._calls: set[_Call] = set()  # queued or in flight, for ``close`` to cancel
        self._calls_lock = threading.Lock()
        self._model = model
        self._model_lock = threading.Lock()
        self._stats = EngineStats()
        self._stats_lock = threading.Lock()
        self._ids = itertools.count()

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
        ``logits_processor``, ``monitor`` and ``max_branches`` act inside the server's decode loop, so
        they are refused (``NotImplementedError``) before anything is sent.
        """
        if logits_processor is not None:
            raise NotImplementedError(f"a logits processor runs inside the decode loop, so {LOCAL_ONLY}")
        if monitor is not None:
            raise NotImplementedError(f"monitor sees each token as it is decoded, so {LOCAL_ONLY}")
        if max_branches is not None:
            raise NotImplementedError(f"max_branches adds branches to a running request, so {LOCAL_ONLY}")
        if not isinstance(stream, bool):
            raise TypeError(f"stream must be a bool, got {type(stream).__name__}")
        path, body = _prompt_body(prompt)
        params = check_request_shape(n, params)
        body.update(_sampling_body(path, n, params))
        call = _Call(RequestChannel(), next(self._ids))
        with self._calls_lock:
            self._calls.add(call)
        try:
            self._workers.submit(lambda: self._run(call, path, body, n, params, stream))
        except RuntimeError:
            with self._calls_lock:
                self._calls.discard(call)
            raise
        return RequestHandle(call.request_id, None, n, call.channel, _Waiter(call))

    def generate(self, prompt: Any, params: SamplingParams | None = None) -> Completion:
        """One completion of ``prompt``."""
        return self.submit(prompt, 1, params).result()[0]

    def generate_branches(self, prompt: Any, n: int, params: SamplingParams | None = None) -> list[Completion]:
        """``n`` completions of one prompt, in one request (``n``). On ``rksc serve`` branch i is seeded
        ``seed + i``, as in a local engine; other servers seed the request as they do."""
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
            _prompt_body(prompt)
        check_request_shape(1, params)
        return [self.submit(p, 1, params) for p in prompts]

    # -- stats ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Counters summed from the servers' ``usage`` since this object was built (or ``reset_stats``)."""
        with self._stats_lock:
            return dataclasses.replace(self._stats, extra=dict(self._stats.extra))

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

    # -- what only a local engine does ----------------------------------------------------------
    def tree_search(self, question: str, **kwargs: Any) -> Any:
        raise NotImplementedError(f"tree_search annotates the radix cache with branch scores (RSBCM), so {LOCAL_ONLY}")

    def reason(self, question: str, **kwargs: Any) -> Any:
        raise NotImplementedError(f"reason's verifier and CGEE read the model's hidden states, so {LOCAL_ONLY}")

    async def areason(self, question: str, **kwargs: Any) -> Any:
        return self.reason(question, **kwargs)

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

    def _read_answer(self, response: Any, call: _Call, path: str, n: int, params: SamplingParams,
                     stream: bool) -> tuple[list[Completion], dict | None]:
        """Assemble the answer, pushing each delta as a ``StreamChunk`` when the caller streams; then
        each branch's last chunk, with its ``Completion``, once the usage is known."""
        url = f"{self.base_url}/{path}"
        choices: dict[int, _Choice] = {}
        usage, streamed, ended = None, False, False
        try:
            if not response.headers.get("content-type", "").startswith("text/event-stream"):
                # A server that ignores ``stream`` answers whole.
                response.read()
                payload = response.json()
                usage, ended = payload.get("usage"), True
                for i, choice in enumerate(payload.get("choices") or []):
                    index = int(choice.get("index", i))
                    choices.setdefault(index, _Choice(index)).add(choice, path, delta=False)
            else:
                streamed = stream
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
                        raise RemoteServerError(f"{url}: {_message(event)}", 0)
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or []:
                        index = int(choice.get("index", 0))
                        text = choices.setdefault(index, _Choice(index)).add(choice, path, delta=True)
                        if text and stream:
                            call.channel.push(StreamChunk(text, branch_index=index))
        except self._httpx.TimeoutException as error:
            raise TimeoutError(f"{url} sent nothing for {self.timeout} s; not sent again, since the server may "
                               f"still be generating: {error}") from error
        except self._httpx.TransportError as error:
            raise ConnectionError(f"the answer from {url} broke off: {error}") from error
        if not ended:
            raise ConnectionError(f"the stream from {url} ended before 'data: [DONE]'")
        completions = _completions(choices, n, params, usage)
        for c in completions:
            call.channel.push(StreamChunk("" if streamed else c.text, completion=c, branch_index=c.branch_index))
        return completions, usage

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
                message = f"{url} answered {response.status_code}: {_message(_json_or_text(response))}"
                if response.status_code not in RETRYABLE_STATUS:
                    raise _status_error(message, response.status_code)
                status, wait_s = response.status_code, _retry_after_s(response.headers)
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


class _Workers:
    """Daemon threads for queued jobs, at most ``max_threads`` at once. A thread ends as soon as it
    finds the queue empty, so none outlives the work; being daemons, none holds up the interpreter's
    exit (``ThreadPoolExecutor`` joins its threads at exit, however long their requests take)."""

    def __init__(self, max_threads: int, name: str) -> None:
        self._max_threads = max_threads
        self._name = name
        self._lock = threading.Lock()
        self._queue: collections.deque[Callable[[], None]] = collections.deque()
        self._num_threads = 0
        self._closed = False
        self._thread_ids = itertools.count()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("this RemoteEngine is closed")
            self._queue.append(job)
            if self._num_threads == self._max_threads:
                return
            self._num_threads += 1
        try:
            threading.Thread(target=self._work, name=f"{self._name}-{next(self._thread_ids)}", daemon=True).start()
        except BaseException:  # no thread (the interpreter is exiting): the job is not taken either
            with self._lock:
                self._num_threads -= 1
                if job in self._queue:
                    self._queue.remove(job)
            raise

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._num_threads -= 1
                    return
                job = self._queue.popleft()
            job()

    def close(self) -> None:
        """Take no more jobs and drop those not started (their owner cancels them)."""
        with self._lock:
            self._closed = True
            self._queue.clear()


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
        self.channel.cancelled.set()
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
        # Called by ``handle.cancel()`` (and ``cancel_branches``, which a remote request cannot honour:
        # the server decides its branches).
        if self._call.channel.cancelled.is_set():
            self._call.cancel()


def _prompt_body(prompt: Any) -> tuple[str, dict]:
    """The endpoint and the prompt part of the body: a string is a completion, messages a chat."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise TypeError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}; "
                        f"decode bytes first")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must be a non-empty string or list of chat messages")
        return "completions", {"prompt": prompt}
    if isinstance(prompt, Sequence) and not prompt:
        raise ValueError("prompt must not be empty")
    if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        raise TypeError("a remote engine takes text (a string or chat messages), not token ids: the server "
                        "tokenizes with its own tokenizer")
    if isinstance(prompt, Sequence) and all(isinstance(m, dict) for m in prompt):
        messages = [dict(m) for m in prompt]
        for i, message in enumerate(messages):
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), (str, list)):
                raise TypeError(f"messages[{i}] must have a string 'role' and a string 'content'")
        try:
            json.dumps(messages)
        except (TypeError, ValueError) as error:
            raise TypeError(f"chat messages must be JSON-serialisable: {error}") from None
        return "chat/completions", {"messages": messages}
    raise TypeError(f"prompt must be a string or a list of chat messages ({{'role', 'content'}} dicts), "
                    f"got {type(prompt).__name__}")


def _sampling_body(path: str, n: int, params: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {"n": n, "max_tokens": params.max_new_tokens, "temperature": params.temperature,
                            "top_p": params.top_p, "logprobs": True if path == "chat/completions" else 0}
    if params.top_k:
        body["top_k"] = params.top_k  # an extension vLLM, SGLang, llama.cpp and rksc serve accept
    if params.stop:
        body["stop"] = list(params.stop)
    if params.seed is not None:
        body["seed"] = params.seed
    # Always a stream, whether or not the caller streams: a whole answer sends nothing until the
    # generation ends, so a long one would read as a timeout however healthy the server.
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return body


@dataclasses.dataclass
class _Choice:
    """One choice as the server sent it (whole, or assembled from a stream's deltas)."""

    index: int
    text: str = ""
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    says_stop_reason: bool = False  # the server sent ``stop_reason`` (vLLM, rksc serve), even as null

    def add(self, choice: dict, path: str, *, delta: bool) -> str:
        """Take in a (delta) choice of the server's; returns its new text."""
        if path == "completions":
            text = choice.get("text") or ""
        else:
            text = (choice.get("delta" if delta else "message") or {}).get("content") or ""
        self.text += text
        logprobs = choice.get("logprobs") or {}
        if "content" in logprobs:  # chat
            self.logprobs += [float(entry["logprob"]) for entry in logprobs.get("content") or []]
        else:  # legacy completions
            self.logprobs += [float(lp) for lp in logprobs.get("token_logprobs") or [] if lp is not None]
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
            if "stop_reason" in choice:
                self.stop_reason, self.says_stop_reason = choice["stop_reason"], True
        return text

    def engine_finish_reason(self, params: SamplingParams) -> FinishReason:
        """OpenAI's ``stop`` covers both the model's end and a stop string; ``stop_reason`` tells them
        apart (a string: the stop string). A server that does not send it ended on a stop string
        only if some were asked for, as far as can be told."""
        if self.finish_reason == "length":
            return "length"
        if isinstance(self.stop_reason, str):
            return "stop"
        if self.says_stop_reason:
            return "eos"
        return "stop" if params.stop else "eos"


def _completions(choices: dict[int, _Choice], n: int, params: SamplingParams, usage: dict | None) -> list[Completion]:
    usage = usage or {}
    prompt_tokens = int(usage.get("prompt_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if sorted(choices) != list(range(n)):
        raise RemoteServerError(f"the server answered choices {sorted(choices)} for n={n}", 0)
    return [
        Completion(text=choice.text, token_ids=(), logprobs=tuple(choice.logprobs),
                   finish_reason=choice.engine_finish_reason(params), num_prompt_tokens=prompt_tokens,
                   num_cached_tokens=cached, branch_index=index, seed=params.seed)
        for index, choice in sorted(choices.items())
    ]


def _retry_after_s(headers: Any) -> float | None:
    """The seconds a 429 or 503 asks to wait: ``retry-after-ms`` (OpenAI's), or ``Retry-After`` in
    seconds or as an HTTP date (a date passed is 0). None when it names none that can be read."""
    try:
        seconds = float(headers["retry-after-ms"]) / 1000
    except (KeyError, TypeError, ValueError):
        value = headers.get("retry-after")
        if value is None:
            return None
        try:
            seconds = float(value)
        except ValueError:
            try:
                seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
            except (TypeError, ValueError):
                return None
    return max(seconds, 0.0) if seconds == seconds else None  # NaN reads as none


def _json_or_text(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text[:500]


def _message(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        error = payload["error"]
        param = f" (param: {error['param']})" if error.get("param") else ""
        return f"{error.get('message')}{param}"
    if isinstance(payload, dict) and "detail" in payload:
        return str(payload["detail"])
    return str(payload)


def _status_error(message: str, status: int) -> Exception:
    if status in (401, 403):
        return PermissionError(message)
    if status in (400, 404, 413, 422):
        return ValueError(message)
    return RemoteServerError(message, status)
