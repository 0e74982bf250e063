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
    * Transport: 429, 502, 503, 504 and timeouts are retried with exponential backoff (``tenacity``,
      ``max_retries`` times); a refused connection raises ``ConnectionError`` naming the URL at once;
      a 400 is a ``ValueError`` with the server's message (401/403 ``PermissionError``).
    * Cancelling a streamed request closes its connection (``rksc serve`` then frees the request's
      KV); cancelling a request that is not streamed stops waiting for it at once, but the server
      finishes it.
    * What only a local engine can do raises ``NotImplementedError`` saying so: logits processors,
      ``tree_search`` (it annotates the local radix cache), ``reason`` (its verifier reads the
      model's hidden states), prefill and cache control, ASKS and RSBCM settings.

``httpx`` is imported when a ``RemoteEngine`` is built (it comes with the LangChain and LlamaIndex
extras, and with ``pip install httpx``); the rest of ``rksc_engine`` does not need it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import tenacity

from .config import SamplingParams, check_request_shape
from .requests import LogitsProcessor, RequestCancelled, RequestChannel, RequestHandle, astream_chunks, stream_chunks
from .types import Completion, EngineStats, FinishReason, StreamChunk

# Statuses worth retrying: rate limited, or a server (or its proxy) briefly unavailable.
TRANSIENT_STATUS = frozenset({429, 502, 503, 504})
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


class _Transient(Exception):
    """A retryable status (429/502/503/504); becomes ``RemoteServerError`` when the retries run out."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class RemoteEngine:
    """The engine's generation API over an OpenAI-compatible server.

    Args:
        base_url: The API root as OpenAI clients take it, e.g. ``"http://127.0.0.1:8000/v1"``.
        model: The model id to ask for; None takes the first one ``GET /models`` lists.
        api_key: Sent as ``Authorization: Bearer <api_key>``.
        timeout: Seconds to wait to connect and between bytes of an answer (> 0).
        max_retries: Retries of a 429/502/503/504 or a timeout (>= 0). Default 3.
        retry_backoff_s: First wait between tries, doubling each retry (>= 0). Default 0.5.
        max_concurrency: Requests in flight at once (>= 1); more wait their turn. Default 64.

    Example:
        >>> engine = RemoteEngine("http://127.0.0.1:8000/v1")
        >>> engine.generate_branches("Q: 2+3=?\\nA:", n=4, params=SamplingParams(temperature=0.7, seed=0))
    """

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, timeout: float = 60.0,
                 *, max_retries: int = 3, retry_backoff_s: float = 0.5, max_concurrency: int = 64) -> None:
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
        self._client = httpx.Client(timeout=self.timeout, headers=headers,
                                    limits=httpx.Limits(max_connections=max_concurrency))
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="rksc-remote")
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
                response = self._send("GET", "models", None, stream=False)
                data = response.json().get("data") or []
                if not data:
                    raise RemoteServerError(f"{self.base_url}/models lists no model; pass model=", response.status_code)
                self._model = str(data[0]["id"])
            return self._model

    def __repr__(self) -> str:
        return f"RemoteEngine({self.base_url!r}, model={self._model!r})"

    # -- the request API ------------------------------------------------------------------------
    def submit(self, prompt: Any, n: int = 1, params: SamplingParams | None = None, *, stream: bool = False,
               logits_processor: LogitsProcessor | None = None) -> RequestHandle:
        """Send a request of ``n`` choices and return its handle at once (as ``RKSCEngine.submit``).

        ``handle.num_prompt_tokens`` is None: the server tokenizes; each ``Completion`` has the count.
        """
        if logits_processor is not None:
            raise NotImplementedError(f"a logits processor runs inside the decode loop, so {LOCAL_ONLY}")
        if not isinstance(stream, bool):
            raise TypeError(f"stream must be a bool, got {type(stream).__name__}")
        path, body = _prompt_body(prompt)
        params = check_request_shape(n, params)
        body.update(_sampling_body(path, n, params, stream))
        channel = RequestChannel()
        request_id = next(self._ids)
        handle = RequestHandle(request_id, None, n, channel, _Waiter(channel, request_id))
        self._pool.submit(self._run, channel, request_id, path, body, n, params, stream)
        return handle

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

    encode_chat = encode

    def __getattr__(self, name: str) -> Any:
        if name in ("config", "model", "tokenizer", "prefix_cache", "exclusive", "forward", "cached_prefix",
                    "cached_prefix_length", "context_window", "kv_bytes_per_token", "validate_request"):
            raise AttributeError(f"RemoteEngine has no {name}: {LOCAL_ONLY} (ASKS, RSBCM budgets and the "
                                 f"scheduler are configured on the server)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop sending: requests not yet sent are dropped, the connections closed."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- transport ------------------------------------------------------------------------------
    def _run(self, channel: RequestChannel, request_id: int, path: str, body: dict, n: int,
             params: SamplingParams, stream: bool) -> None:
        """Worker thread: send one request, fill its channel."""
        try:
            if channel.cancelled.is_set():
                raise RequestCancelled(f"request {request_id} was cancelled")
            body["model"] = self.model_name
            response = self._send("POST", path, json.dumps(body).encode(), stream=stream)
            if stream:
                completions, usage = self._read_stream(response, channel, request_id, path, n, params)
            else:
                payload = response.json()
                usage = payload.get("usage")
                choices: dict[int, _Choice] = {}
                for i, choice in enumerate(payload.get("choices") or []):
                    index = int(choice.get("index", i))
                    choices.setdefault(index, _Choice(index)).add(choice, path, delta=False)
                completions = _completions(choices, n, params, usage)
                for c in completions:
                    channel.push(StreamChunk(c.text, completion=c, branch_index=c.branch_index))
            self._count(usage)
            channel.finish(completions)
        except BaseException as error:  # whatever failed the request is its caller's to see
            channel.fail(error)

    def _read_stream(self, response: Any, channel: RequestChannel, request_id: int, path: str, n: int,
                     params: SamplingParams) -> tuple[list[Completion], dict | None]:
        """Push each streamed delta as a ``StreamChunk``; the branches' last chunks (with their
        ``Completion``) once the stream has ended and the usage is known."""
        choices: dict[int, _Choice] = {}
        usage, ended = None, False
        try:
            for line in response.iter_lines():
                if channel.cancelled.is_set():
                    raise RequestCancelled(f"request {request_id} was cancelled")
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    ended = True
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RemoteServerError(f"{self.base_url}/{path}: {_message(event)}", 0)
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    index = int(choice.get("index", 0))
                    text = choices.setdefault(index, _Choice(index)).add(choice, path, delta=True)
                    if text:
                        channel.push(StreamChunk(text, branch_index=index))
        except self._httpx.TransportError as error:
            raise ConnectionError(f"the stream from {self.base_url}/{path} broke off: {error}") from error
        finally:
            response.close()
        if not ended:
            raise ConnectionError(f"the stream from {self.base_url}/{path} ended before 'data: [DONE]'")
        completions = _completions(choices, n, params, usage)
        for c in completions:
            channel.push(StreamChunk("", completion=c, branch_index=c.branch_index))
        return completions, usage

    def _send(self, method: str, path: str, content: bytes | None, *, stream: bool) -> Any:
        """One HTTP exchange, retried on 429/502/503/504 and timeouts; errors mapped to Python's."""
        httpx, url = self._httpx, f"{self.base_url}/{path}"
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type((_Transient, httpx.TimeoutException)),
            stop=tenacity.stop_after_attempt(self.max_retries + 1),
            wait=tenacity.wait_exponential(multiplier=self.retry_backoff_s, max=30.0),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    request = self._client.build_request(method, url, content=content,
                                                         headers={"Content-Type": "application/json"} if content else None)
                    try:
                        response = self._client.send(request, stream=stream)
                    except httpx.ConnectError as error:
                        raise ConnectionError(f"cannot connect to {url}: {error}") from error
                    if response.status_code < 400:
                        return response
                    response.read()
                    response.close()
                    message = f"{url} answered {response.status_code}: {_message(_json_or_text(response))}"
                    if response.status_code in TRANSIENT_STATUS:
                        raise _Transient(message, response.status_code)
                    raise _status_error(message, response.status_code)
        except _Transient as error:
            raise RemoteServerError(f"{error} (after {self.max_retries + 1} tries)", error.status_code) from None
        except httpx.TimeoutException as error:
            raise TimeoutError(f"{url} did not answer within {self.timeout} s ({self.max_retries + 1} tries): "
                               f"{error}") from error
        except httpx.TransportError as error:
            raise ConnectionError(f"lost the connection to {url}: {error}") from error
        raise AssertionError("unreachable")  # tenacity either returns or reraises


class _Waiter:
    """The ``RequestDriver`` of a remote request: the worker thread fills the channel, there is
    nothing to step."""

    def __init__(self, channel: RequestChannel, request_id: int) -> None:
        self._channel = channel
        self._request_id = request_id

    def owns_engine(self) -> bool:
        return False  # no engine lock here: an awaiting caller always waits for the worker

    def wait_for(self, channel: RequestChannel, timeout: float | None) -> None:
        channel.wait(timeout)

    def wake(self) -> None:
        # Called by ``handle.cancel()``: release whoever waits now; the worker closes a stream at its
        # next line, and a request that is not streamed is left to finish on the server.
        if self._channel.cancelled.is_set():
            self._channel.fail(RequestCancelled(f"request {self._request_id} was cancelled"))


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


def _sampling_body(path: str, n: int, params: SamplingParams, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"n": n, "max_tokens": params.max_new_tokens, "temperature": params.temperature,
                            "top_p": params.top_p, "logprobs": True if path == "chat/completions" else 0}
    if params.top_k:
        body["top_k"] = params.top_k  # an extension vLLM, SGLang, llama.cpp and rksc serve accept
    if params.stop:
        body["stop"] = list(params.stop)
    if params.seed is not None:
        body["seed"] = params.seed
    if stream:
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
