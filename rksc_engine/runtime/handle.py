"""The public request API: what ``engine.submit`` returns, and how its output reaches the caller.

A submitted request is owned by the scheduler (``rksc_engine.runtime.scheduler``); the caller holds a
``RequestHandle``. The two meet only in a ``RequestChannel``: the scheduler pushes chunks and the
final completions into it, consumers take them out. No engine lock is ever held while a consumer
reads, so a handle can be iterated, awaited, closed or dropped from any thread or event loop.

Promises:
    * ``cancel()`` (also on ``close()``, on leaving a ``with`` block, and when an unfinished handle is
      garbage-collected) only sets a flag and wakes the scheduler; the scheduler drops the request's
      rows at its next step and frees its KV. It never blocks and never raises.
    * A handle's chunks arrive in order; the last chunk of each branch carries its ``Completion``.
    * ``result()`` returns the completions in branch order, or raises the error that failed the request
      (bad input is rejected by ``submit`` itself, before anything is queued).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from ..results import BranchControl, BranchEvent, Completion, StreamChunk

# A per-request logits processor: given each active branch's generated token ids so far (rows in
# the order of ``logits``) and the next-token logits of those rows, (B, V), return the logits to
# sample from (same shape). It runs inside the scheduler's step, for this request's rows only.
LogitsProcessor = Callable[[Sequence[Sequence[int]], torch.Tensor], torch.Tensor]


class BranchMonitor(Protocol):
    """Watches one request's branches as they decode and may stop some or add more.

    ``observe`` runs inside the scheduler's step, once per step of the request, after its rows
    sampled: ``events`` holds one ``BranchEvent`` per branch that advanced (in branch order). It
    sees only its own request. What it returns acts before the next forward: stopped branches
    leave the batch (``finish_reason="cancelled"``), added branches fork off the prompt. Called on
    the scheduler's thread, with the engine held: it must be quick and must not call the engine.
    An exception it raises fails its own request only.
    """

    def observe(self, events: Sequence[BranchEvent]) -> BranchControl | None:
        """React to one step of the request's branches (None: carry on)."""


class RequestDriver(Protocol):
    """What a ``RequestHandle`` needs from whoever fills its channel: the local scheduler, or a
    remote engine's transport."""

    def wait_for(self, channel: RequestChannel, timeout: float | None) -> None:
        """Block until ``channel`` has news (or ``timeout`` passes), making progress if only the
        caller can (the local scheduler, when the caller holds the engine)."""

    def wake(self) -> None:
        """A request changed (it was cancelled): look again."""

    def holds_engine(self) -> bool:
        """Whether the calling thread holds the engine (then awaiting must step it, not wait)."""


class RequestCancelled(RuntimeError):
    """The request was cancelled before it finished, so it has no result."""


class RequestChannel:
    """The scheduler-to-consumer queue of one request (thread-safe, asyncio-aware)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._chunks: collections.deque[StreamChunk] = collections.deque()
        self._completions: list[Completion] | None = None
        self._error: BaseException | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.cancelled = threading.Event()
        self._branches_to_cancel: set[int] = set()
        # Set with ``cancelled`` (``cancel``) and by ``cancel_branches``: a plain attribute the
        # scheduler reads every step for every request, so a request nobody stopped costs no call.
        self.asks_to_stop = False

    # -- producer side (the scheduler) ----------------------------------------------------------
    def push(self, chunk: StreamChunk) -> None:
        with self._cond:
            self._chunks.append(chunk)
            self._notify()

    def finish(self, completions: list[Completion]) -> None:
        with self._cond:
            self._completions = completions
            self._notify()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self._completions is None and self._error is None:
                self._error = error
            self._notify()

    def _notify(self) -> None:
        self._cond.notify_all()
        waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            if future.done():  # its awaiter was cancelled or timed out
                continue
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:
                # The awaiting loop has closed (``asyncio.run`` returned after a time-out): nobody is
                # left to wake, and this must never reach the scheduler, which serves other requests.
                pass

    def take_branch_cancellations(self) -> set[int]:
        """Branch indices the consumer asked to stop since the last call (the scheduler's side)."""
        with self._cond:
            taken, self._branches_to_cancel = self._branches_to_cancel, set()
            self.asks_to_stop = self.cancelled.is_set()  # ``cancel`` sets ``cancelled`` first
            return taken

    # -- consumer side --------------------------------------------------------------------------
    def cancel(self) -> None:
        """Ask the scheduler to drop the request (at its next step)."""
        self.cancelled.set()
        self.asks_to_stop = True

    def cancel_branches(self, indices: set[int]) -> None:
        with self._cond:
            self._branches_to_cancel |= indices
            self.asks_to_stop = True

    @property
    def finished(self) -> bool:
        return self._completions is not None or self._error is not None

    def take(self) -> tuple[StreamChunk | None, bool]:
        """The next chunk if one is queued, and whether the request has ended (nothing more will come)."""
        with self._cond:
            if self._chunks:
                return self._chunks.popleft(), False
            return None, self.finished

    def wait(self, timeout: float | None) -> None:
        with self._cond:
            if not self._chunks and not self.finished:
                self._cond.wait(timeout)

    def async_waiter(self) -> asyncio.Future:
        """A future that resolves at the next push, finish or failure (at once if one is pending)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if self._chunks or self.finished:
                future.set_result(None)
            else:
                self._waiters.append((loop, future))
                future.add_done_callback(self._forget_waiter)
        return future

    def _forget_waiter(self, future: asyncio.Future) -> None:
        # A waiter cancelled by its task (``wait_for`` timing out) is dropped at once, so a
        # long-lived request does not collect the futures of every closed loop that awaited it.
        if future.cancelled():
            with self._cond:
                self._waiters = [(loop, f) for loop, f in self._waiters if f is not future]

    def outcome(self) -> list[Completion]:
        with self._cond:
            if self._error is not None:
                raise self._error
            assert self._completions is not None
            return self._completions


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class RequestHandle:
    """A submitted request: iterate its chunks, wait for its completions, or cancel it.

    Use it any of these ways::

        handle = engine.submit(prompt, n=4, params=params)
        completions = handle.result()          # block until all branches finish
        for chunk in handle: ...               # StreamChunk per step and branch (submit(stream=True))
        completions = await handle             # from asyncio
        async for chunk in handle: ...
        handle.cancel()                        # from any thread; frees the request's KV at the next step

    Attributes:
        request_id: Unique within the engine.
        num_prompt_tokens: Tokens of the encoded prompt.
        n: Branches requested.
    """

    def __init__(self, request_id: int, num_prompt_tokens: int | None, n: int, channel: RequestChannel,
                 scheduler: RequestDriver) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.n = n
        self._channel = channel
        self._scheduler = scheduler

    # -- state ----------------------------------------------------------------------------------
    def done(self) -> bool:
        """Whether the request has finished, failed or been cancelled (and the scheduler knows)."""
        return self._channel.finished

    def cancel(self) -> None:
        """Stop the request; its rows leave the batch and its KV is freed at the scheduler's next step."""
        if not self._channel.cancelled.is_set():
            self._channel.cancel()
            self._scheduler.wake()

    close = cancel

    def cancel_branches(self, branch_indices: Sequence[int]) -> None:
        """Stop some branches and keep the rest: at the scheduler's next step their rows leave the
        batch and their KV is freed; each comes back as a ``Completion`` with
        ``finish_reason="cancelled"`` holding what it had generated. Indices of branches that have
        finished already (or do not exist yet) are ignored. Never blocks.

        Raises:
            TypeError: ``branch_indices`` holds something other than ints.
            ValueError: an index is negative.
        """
        indices = set()
        for index in branch_indices:
            if not isinstance(index, int) or isinstance(index, bool):
                raise TypeError(f"branch_indices must hold ints, got {type(index).__name__}")
            if index < 0:
                raise ValueError(f"branch_indices must be >= 0, got {index}")
            indices.add(index)
        if indices and not self._channel.finished:
            self._channel.cancel_branches(indices)
            self._scheduler.wake()

    @property
    def cancelled(self) -> bool:
        return self._channel.cancelled.is_set()

    # -- blocking consumers ---------------------------------------------------------------------
    def result(self, timeout: float | None = None) -> list[Completion]:
        """The completions in branch order, once every branch has finished.

        Raises:
            RequestCancelled: the request was cancelled first.
            TimeoutError: ``timeout`` seconds passed first (the request goes on).
            Exception: whatever failed the request (out of memory after retries, ...).
        """
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._channel.finished:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            self._scheduler.wait_for(self._channel, remaining)
        return self._channel.outcome()

    def __iter__(self) -> Iterator[StreamChunk]:
        """Chunks as they are produced; the last chunk of each branch carries its ``Completion``.
        Raises the request's error, if it failed, after the chunks that came before it. Leaving the
        loop early (``break``, an exception, closing or dropping the iterator) cancels the request."""
        try:
            while True:
                chunk, ended = self._channel.take()
                if chunk is not None:
                    yield chunk
                elif ended:
                    self._channel.outcome()  # raises the error of a failed or cancelled request
                    return
                else:
                    self._scheduler.wait_for(self._channel, None)
        finally:
            if not self._channel.finished:
                self.cancel()

    # -- asyncio consumers ----------------------------------------------------------------------
    def __await__(self):
        return self._async_result().__await__()

    async def _async_result(self) -> list[Completion]:
        try:
            while not self._channel.finished:
                if self._scheduler.holds_engine():  # awaited inside ``engine.exclusive()``: nobody else can step
                    self._scheduler.wait_for(self._channel, None)
                    continue
                await self._channel.async_waiter()
        except asyncio.CancelledError:
            self.cancel()
            raise
        return self._channel.outcome()

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        try:
            while True:
                chunk, ended = self._channel.take()
                if chunk is not None:
                    yield chunk
                elif ended:
                    self._channel.outcome()
                    return
                elif self._scheduler.holds_engine():
                    self._scheduler.wait_for(self._channel, None)
                else:
                    await self._channel.async_waiter()
        except (asyncio.CancelledError, GeneratorExit):
            self.cancel()
            raise

    # -- lifetime -------------------------------------------------------------------------------
    def __enter__(self) -> RequestHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.done():
            self.cancel()

    def __del__(self) -> None:
        # A handle nobody can reach any more cannot deliver its output: free the request's KV.
        try:
            if not self._channel.finished:
                self._channel.cancel()
        except Exception:
            pass


def stream_chunks(handle: RequestHandle) -> Iterator[StreamChunk]:
    """``handle``'s chunks as a plain iterator; leaving it early (``close``, garbage collection)
    cancels the request."""
    try:
        yield from handle
    finally:
        if not handle.done():
            handle.cancel()


async def astream_chunks(handle: RequestHandle) -> AsyncIterator[StreamChunk]:
    """``stream_chunks`` for asyncio; cancelling the consuming task cancels the request."""
    try:
        async for chunk in handle:
            yield chunk
    finally:
        if not handle.done():
            handle.cancel()
