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
    * A pool's threads are daemons of its own: no call, however long, keeps the process alive once
      the server has stopped. ``shutdown(wait_s)`` (at the server's shutdown, and at the
      interpreter's exit) drops queued calls, tells running ones to stop and waits at most ``wait_s``.
    * ``WorkerPool.run(fn, on_cancel=...)``: when the awaiting task is cancelled (its client went
      away), a queued call never runs and a running one has ``on_cancel()`` called (a tree search's
      ``CancelToken.cancel``), so it stops at its next check.
    * ``WorkerPool.run_cancellable(engine, fn)`` runs ``fn(scoped)`` on a pool thread, ``scoped``
      being a ``CancellableEngine`` over ``engine``. Cancelling the awaiting task (its client went
      away) returns at once, without waiting for the thread: a call still queued never runs, and a
      running call has its engine requests cancelled and every later ``submit`` refused with
      ``RequestCancelled``, so it ends at its next engine request.
    * Nothing here takes the engine lock; the event loop only submits to the pool and awaits.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from rksc_engine import RequestCancelled, RequestHandle, SamplingParams
from rksc_engine.protocol import Engine

T = TypeVar("T")
log = logging.getLogger("rksc_serve.workers")

# Threads per pool by default: each mostly waits on the scheduler, which batches the calls of all of
# them into one forward, so more threads than cores is the point.
DEFAULT_WORKER_THREADS = 16
MAX_WORKER_THREADS = 1024
# Seconds a pool thread waits for a call before it ends (the next call starts another).
IDLE_EXIT_S = 30.0


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
    """A fixed number of daemon threads for blocking calls; calls beyond them wait in its queue.

    Its threads are the pool's own, not a ``concurrent.futures`` executor's: an executor's threads
    are joined when the interpreter exits, so one abandoned call (a tree search whose client left)
    would keep ``rksc serve`` alive after Ctrl-C until it ended. Here a call that can be stopped
    says how (``on_cancel``); ``shutdown`` drops the queue, stops the calls running, and waits for
    them a bounded time; and threads still busy after it never hold up the process's exit.

    Args:
        name: Its threads' name prefix (``rksc-turns_0``...), as thread dumps show them.
        max_threads: Threads at most, in [1, ``MAX_WORKER_THREADS``]; started as calls arrive, and
            ended after ``IDLE_EXIT_S`` without one.
    """

    def __init__(self, name: str, max_threads: int) -> None:
        self.name = name
        self.max_threads = check_worker_threads(max_threads, "max_threads")
        self._cv = threading.Condition()
        self._queue: collections.deque[_Call] = collections.deque()
        self._running: set[_Call] = set()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False
        self._thread_ids = itertools.count()
        _LIVE_POOLS.add(self)

    @property
    def num_running(self) -> int:
        """Calls running on the pool's threads now (a cancelled call counts until it has returned)."""
        with self._cv:
            return len(self._running)

    async def run(self, fn: Callable[..., T], *args: Any, on_cancel: Callable[[], None] | None = None) -> T:
        """``fn(*args)`` on a pool thread. Cancelling the caller drops the call if it has not started;
        a started call is told to stop by ``on_cancel()`` (when given: it must not block), which
        ``shutdown`` calls too; without it, the call goes on to its end."""
        call = _Call(concurrent.futures.Future(), fn, args, on_cancel)
        self._enqueue(call)
        try:
            # wrap_future cancels the call's future when this await is cancelled; a queued call then never runs.
            return await asyncio.wrap_future(call.future)
        except asyncio.CancelledError:
            call.stop()
            raise

    async def run_cancellable(self, engine: Engine, fn: Callable[[CancellableEngine], T]) -> T:
        """``fn(scoped)`` on a pool thread, ``scoped`` a ``CancellableEngine`` over ``engine``: when the
        caller is cancelled (or the pool shut down), the call's engine requests are cancelled too and
        it submits no more."""
        scoped = CancellableEngine(engine)
        return await self.run(fn, scoped, on_cancel=scoped.cancel)

    def shutdown(self, wait_s: float = 0.0) -> bool:
        """Drop the queued calls, tell the running ones to stop (``on_cancel``), and wait up to
        ``wait_s`` seconds for the threads to end. Returns whether they all did. Never waits longer;
        a thread still busy after it is a daemon and does not keep the process alive."""
        with self._cv:
            self._closed = True
            queued, self._queue = list(self._queue), collections.deque()
            running, threads = list(self._running), list(self._threads)
            self._cv.notify_all()
        for call in queued:
            call.future.cancel()
        for call in running:
            call.stop()
        deadline = time.monotonic() + wait_s
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)

    def _enqueue(self, call: _Call) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError(f"the {self.name} pool has shut down (the server is stopping)")
            self._queue.append(call)
            # A thread that is idle now may already be promised to an earlier call: start one more
            # whenever the queue outgrows the idle threads.
            if len(self._queue) > self._idle and len(self._threads) < self.max_threads:
                thread = threading.Thread(target=self._work, name=f"{self.name}_{next(self._thread_ids)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cv.notify()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._idle += 1
                    notified = self._cv.wait(IDLE_EXIT_S)
                    self._idle -= 1
                    if not notified and not self._queue:
                        break  # idle a while: end, so that an app nobody serves any more can be collected
                if not self._queue:  # idle, or closed
                    self._threads.remove(threading.current_thread())
                    return
                call = self._queue.popleft()
                if not call.future.set_running_or_notify_cancel():
                    continue  # its caller went away while it waited
                self._running.add(call)
            try:
                call.run()
            finally:
                with self._cv:
                    self._running.discard(call)
            del call  # an idle thread holds nothing of its last call (a dropped handle must be collectable)


class _Call:
    """One call of a ``WorkerPool``: its future, what it runs, and how to stop it once started."""

    def __init__(self, future: concurrent.futures.Future, fn: Callable[..., Any], args: tuple[Any, ...],
                 on_cancel: Callable[[], None] | None) -> None:
        self.future, self.fn, self.args, self.on_cancel = future, fn, args, on_cancel

    def run(self) -> None:
        try:
            result = self.fn(*self.args)
        except BaseException as error:  # noqa: BLE001 - the awaiting caller gets it, as from an executor
            self.future.set_exception(error)
        else:
            self.future.set_result(result)

    def stop(self) -> None:
        """Tell a started call to stop (never blocks, never raises); a queued one is dropped by its future."""
        if self.on_cancel is None:
            return
        try:
            self.on_cancel()
        except Exception:
            log.exception("stopping a pool call failed")


# Every pool not yet collected: at the interpreter's exit their running calls are told to stop and
# given a moment to, so that none is cut off by the interpreter's end in the middle of a torch call
# (the engine's scheduler is stopped by its own exit hook, which runs after this one).
_LIVE_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()
EXIT_WAIT_S = 5.0


@atexit.register
def _stop_all_pools() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for pool in list(_LIVE_POOLS):
        pool.shutdown(wait_s=max(0.0, deadline - time.monotonic()))
