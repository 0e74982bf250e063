"""Run blocking engine work off the event loop; shared by the LangChain and LlamaIndex adapters.

The engine is synchronous and holds a lock for a whole generation; awaiting it directly would
freeze every other task on the loop for seconds. Calls go to a worker thread; a stream is drained
by one dedicated worker thread into an ``asyncio.Queue``, so the loop only ever waits on the queue.
One thread per stream matters: an engine stream holds the engine's re-entrant lock for its whole
life, and a lock taken in one thread cannot be released from another (LangChain's default
``_astream`` would call ``next()`` from a fresh executor thread each time).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
_DONE = object()


async def run_in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a worker thread (the context, hence the active span, is copied)."""
    return await asyncio.to_thread(fn, *args, **kwargs)


async def iterate_in_thread(make_iterator: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Items of the iterator ``make_iterator()``, produced in a worker thread.

    When the consumer stops early (``aclose``, cancellation), the worker closes the iterator, so an
    engine stream releases the engine lock instead of holding it forever.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    context = contextvars.copy_context()

    def put(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop closed while the worker ran on; nobody is listening
            stop.set()

    def worker() -> None:
        iterator = None
        try:
            iterator = make_iterator()
            for item in iterator:
                put(item)
                if stop.is_set():
                    break
        except BaseException as exc:  # handed to the consumer, re-raised there
            put(_Failure(exc))
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
            put(_DONE)

    thread = threading.Thread(target=context.run, args=(worker,), name="rksc-stream", daemon=True)
    thread.start()
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item
    finally:
        stop.set()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
