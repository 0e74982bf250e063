"""Blocking engine work off the event loop: the server's own bounded thread pools, and cancellation
that reaches the engine requests such work makes.

Some answers are made by synchronous engine code: a tool call or a JSON answer is decoded one JSON
value at a time (``rksc_engine.structured.tools``), and a tree search submits a level and waits for it. The app
runs each such call on a ``WorkerPool`` of its own instead of asyncio's default executor, so
    * a burst queues behind a fixed number of threads rather than taking the threads the whole
      process shares (``engine.areason``'s verifier pass runs there, and so does any
      ``asyncio.to_thread`` of the adapters);
    * tree searches, which run long, use a pool apart from tool turns, which are short, and cannot
      starve them.

Promises:
    * ``WorkerPool.run_cancellable(engine, fn)`` runs ``fn(scoped)`` on a pool thread, ``scoped``
      being a ``CancellableEngine`` over ``engine``. Cancelling the awaiting task (its client went
      away) returns at once, without waiting for the thread: a call still queued never runs, and a
      running call has its engine requests cancelled and every later ``submit`` refused with
      ``RequestCancelled``, so it ends at its next engine request.
    * Nothing here takes the engine lock; the event loop only submits to the pool and awaits.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from rksc_engine import RequestCancelled, RequestHandle, SamplingParams
from rksc_engine.protocol import Engine

T = TypeVar("T")

# Threads per pool by default: each mostly waits on the scheduler, which batches the calls of all of
# them into one forward, so more threads than cores is the point.
DEFAULT_WORKER_THREADS = 16
MAX_WORKER_THREADS = 1024


def check_worker_threads(value: Any, name: str = "worker_threads") -> int:
    """``value`` when it is an int in [1, ``MAX_WORKER_THREADS``]; otherwise ``ValueError`` naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_WORKER_THREADS:
        raise ValueError(f"{name} must be an int in [1, {MAX_WORKER_THREADS}], got {value!r}")
    return value


class CancellableEngine:
    """``engine`` as one piece of blocking work sees it.

    ``cancel()`` cancels every request the work has submitted through this object and makes the next
    ``submit`` raise ``RequestCancelled``, so the work stops at its next engine request. Only
    ``submit`` (and the ``generate`` forms, built on it here) is intercepted: every other attribute
    is the engine's own, which is all that ``rksc_engine.structured.tools`` and the constrained decoder use.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._handles: list[RequestHandle] = []
        self._handles_guard = threading.Lock()
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def submit(self, *args: Any, **kwargs: Any) -> RequestHandle:
        """``engine.submit(*args, **kwargs)``, remembered so that ``cancel()`` reaches it."""
        if self._cancelled:
            raise RequestCancelled("the request's client went away; its work submits nothing more")
        handle = self._engine.submit(*args, **kwargs)
        with self._handles_guard:
            if not self._cancelled:
                # Finished handles need no cancelling: dropping them keeps a long call's list short.
                self._handles = [h for h in self._handles if not h.done()]
                self._handles.append(handle)
                return handle
        handle.cancel()  # cancel() ran while this request was being submitted
        raise RequestCancelled("the request's client went away; its work submits nothing more")

    def generate(self, prompt: Any, params: SamplingParams | None = None) -> Any:
        return self.submit(prompt, 1, params).result()[0]

    def generate_branches(self, prompt: Any, n: int, params: SamplingParams | None = None) -> Any:
        return self.submit(prompt, n, params).result()

    def cancel(self) -> None:
        """Cancel the requests submitted so far and refuse the next ones. Never blocks."""
        with self._handles_guard:
            self._cancelled = True
            handles, self._handles = self._handles, []
        for handle in handles:
            handle.cancel()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class WorkerPool:
    """A fixed number of threads for blocking calls; calls beyond them wait in its queue.

    Args:
        name: Its threads' name prefix (``rksc-turns_0``...), as thread dumps show them.
        max_threads: Threads at most, in [1, ``MAX_WORKER_THREADS``]; started as calls arrive.
    """

    def __init__(self, name: str, max_threads: int) -> None:
        self.name = name
        self.max_threads = check_worker_threads(max_threads, "max_threads")
        self._executor = ThreadPoolExecutor(max_threads, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a pool thread. Cancelling the caller drops the call if it has not started;
        a started call goes on (``run_cancellable`` tells it to stop)."""
        # wrap_future cancels the pool's future when this await is cancelled; a queued call then never runs.
        return await asyncio.wrap_future(self._executor.submit(fn, *args))

    async def run_cancellable(self, engine: Engine, fn: Callable[[CancellableEngine], T]) -> T:
        """``fn(scoped)`` on a pool thread, ``scoped`` a ``CancellableEngine`` over ``engine``: when the
        caller is cancelled, the call's engine requests are cancelled too and it submits no more."""
        scoped = CancellableEngine(engine)
        try:
            return await self.run(fn, scoped)
        except asyncio.CancelledError:
            scoped.cancel()
            raise

    def shutdown(self) -> None:
        """Drop the queued calls and let the threads end after their current one. Never blocks."""
        self._executor.shutdown(wait=False, cancel_futures=True)
