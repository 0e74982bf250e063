"""Drain a blocking iterator from a worker thread, so ``astream`` never blocks the event loop.

LangChain's default ``_astream`` calls ``next()`` on the sync stream in a fresh executor thread each
time; an engine stream holds the engine's re-entrant lock for its whole life, and a lock taken in one
thread cannot be released from another. So one dedicated thread runs the whole iterator and hands
items to the loop through an ``asyncio.Queue``.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def iterate_in_thread(make_iterator: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Items of ``make_iterator()``, produced in one worker thread.

    When the consumer stops early (``aclose``, cancellation), the worker stops and closes the
    iterator, so an engine stream releases the engine lock.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    context = contextvars.copy_context()  # callbacks and the parent run travel with the work

    def put(item: object) -> None:
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
        except BaseException as exc:  # re-raised in the consumer
            put(_Failure(exc))
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
            put(_DONE)

    threading.Thread(target=context.run, args=(worker,), name="rksc-langchain-stream", daemon=True).start()
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
