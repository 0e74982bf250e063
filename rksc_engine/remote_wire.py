"""The OpenAI wire format as ``RemoteEngine`` speaks it: request bodies, choices assembled from a
server's (streamed) answer into ``Completion``s, the server's errors as Python's, and the daemon
threads that carry the requests. Nothing here holds a connection; ``rksc_engine.remote`` does."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import email.utils
import itertools
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .config import SamplingParams
from .results import Completion, FinishReason


class RemoteServerError(RuntimeError):
    """The server answered with an error that retrying did not fix.

    Attributes:
        status_code: The HTTP status (0 for an error reported inside a stream).
    """

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class WorkerThreads:
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


def prompt_body(prompt: Any) -> tuple[str, dict]:
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


def sampling_body(path: str, n: int, params: SamplingParams) -> dict[str, Any]:
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
class AnswerChoice:
    """One choice as the server sent it (whole, or assembled from a stream's deltas)."""

    index: int
    text: str = ""
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    says_stop_reason: bool = False  # the server sent ``stop_reason`` (vLLM, rksc serve), even as null
    num_deltas: int = 0  # stream deltas that carried text
    top_logprobs: list[dict[str, float]] = dataclasses.field(default_factory=list)  # per position: token -> logprob

    def add(self, choice: dict, path: str, *, delta: bool) -> tuple[str, list[float]]:
        """Take in a (delta) choice of the server's; returns its new text and the log-probs sent with it."""
        if path == "completions":
            text = choice.get("text") or ""
        else:
            text = (choice.get("delta" if delta else "message") or {}).get("content") or ""
        self.text += text
        if text:
            self.num_deltas += 1
        logprobs = choice.get("logprobs") or {}
        if "content" in logprobs:  # chat
            entries = logprobs.get("content") or []
            added = [float(entry["logprob"]) for entry in entries]
            self.top_logprobs += [{t["token"]: float(t["logprob"]) for t in entry.get("top_logprobs") or []}
                                  for entry in entries]
        else:  # legacy completions
            added = [float(lp) for lp in logprobs.get("token_logprobs") or [] if lp is not None]
            self.top_logprobs += [{k: float(v) for k, v in (top or {}).items()}
                                  for top in logprobs.get("top_logprobs") or []]
        self.logprobs += added
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
            if "stop_reason" in choice:
                self.stop_reason, self.says_stop_reason = choice["stop_reason"], True
        return text, added

    def num_tokens(self, usage: dict | None, n: int) -> int:
        """Tokens generated: the usage's count for a one-choice answer, else those the log-probs list,
        else the stream's deltas (``transformers serve`` and llama.cpp send one per token)."""
        reported = (usage or {}).get("completion_tokens")
        if n == 1 and reported is not None:
            return int(reported)
        return len(self.logprobs) or self.num_deltas

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


def usage_of_choices(usage_chunks: Sequence[dict]) -> dict:
    """One usage for a stream that ended with several usage-only chunks. OpenAI sends one, for the
    whole request; llama.cpp's server sends one per choice of a request of ``n``, each counting that
    choice's generated tokens and the prompt the choices share (computed once, then copied). So the
    completion tokens add up and the prompt counts once, as the first chunk has it."""
    usage = dict(usage_chunks[0])
    usage["completion_tokens"] = sum(int(chunk.get("completion_tokens") or 0) for chunk in usage_chunks)
    usage["total_tokens"] = int(usage.get("prompt_tokens") or 0) + usage["completion_tokens"]
    return usage


def completions_from(choices: dict[int, AnswerChoice], n: int, params: SamplingParams, usage: dict | None) -> list[Completion]:
    usage = usage or {}
    prompt_tokens = int(usage.get("prompt_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if sorted(choices) != list(range(n)):
        hint = (" (it ignores n, as transformers serve does: submit(..., monitor=...) and reason() send one "
                "request per branch)" if n > 1 and len(choices) < n else "")
        raise RemoteServerError(f"the server answered choices {sorted(choices)} for n={n}{hint}", 0)
    return [
        Completion(text=choice.text, token_ids=(), logprobs=tuple(choice.logprobs),
                   finish_reason=choice.engine_finish_reason(params), num_prompt_tokens=prompt_tokens,
                   num_cached_tokens=cached, branch_index=index, seed=params.seed,
                   num_reported_tokens=choice.num_tokens(usage, n))
        for index, choice in sorted(choices.items())
    ]


def settle(future: concurrent.futures.Future, work: Callable[[], Any]) -> None:
    """Run ``work`` on a worker thread and hand its result, or its error, to ``future``."""
    try:
        future.set_result(work())
    except BaseException as error:  # the waiting caller's to see
        future.set_exception(error)


def retry_after_s(headers: Any) -> float | None:
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


def json_or_text(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text[:500]


def error_message(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        error = payload["error"]
        param = f" (param: {error['param']})" if error.get("param") else ""
        return f"{error.get('message')}{param}"
    if isinstance(payload, dict) and "detail" in payload:
        return str(payload["detail"])
    return str(payload)


def status_error(message: str, status: int) -> Exception:
    if status in (401, 403):
        return PermissionError(message)
    if status in (400, 404, 413, 422):
        return ValueError(message)
    return RemoteServerError(message, status)
