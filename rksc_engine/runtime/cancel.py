"""``CancelToken``: how a caller stops a long engine call it started (a tree search, a reasoning
call's verifier pass) from another thread, an event loop, or a server that lost its client.

Promises:
    * ``cancel()`` only sets a flag and runs the callbacks the call registered (cancelling its
      in-flight ``RequestHandle``s); it never blocks on the work and never raises, so it is safe
      from a signal handler's thread, an event loop or a finalizer. Calling it again does nothing.
    * The call checks the token at fixed points (between a tree search's levels, before a verifier
      pass) and stops there with ``RequestCancelled``; its requests in flight end at the
      scheduler's next step. What it had already put into the prefix cache stays, consistent.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

from .handle import RequestCancelled, RequestHandle

logger = logging.getLogger(__name__)


class CancelToken:
    """A flag a long engine call checks, with callbacks that cancel what it has in flight.

    Example:
        >>> token = CancelToken()
        >>> threading.Timer(5.0, token.cancel).start()
        >>> engine.tree_search("...", depth=40, cancel=token)  # RequestCancelled if still running at 5 s
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Ask the call to stop: set the flag and run the registered callbacks (once each)."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            callbacks, self._callbacks = list(self._callbacks.values()), {}
        for callback in callbacks:
            _run_quietly(callback)

    def raise_if_cancelled(self, what: str) -> None:
        """``RequestCancelled`` saying ``what`` stopped, when the token is cancelled."""
        if self._cancelled:
            raise RequestCancelled(f"{what}: cancelled by its CancelToken")

    @contextmanager
    def cancelling(self, handles: Collection[RequestHandle]) -> Iterator[None]:
        """While the block runs, ``cancel()`` cancels the handles in ``handles`` (at once when it
        already was). The collection is read when ``cancel()`` runs, so handles the block adds to it
        are covered; one added after that is the block's to cancel (check ``cancelled`` after adding)."""
        key = self._register(lambda: [handle.cancel() for handle in list(handles)])
        try:
            yield
        finally:
            if key is not None:
                with self._lock:
                    self._callbacks.pop(key, None)

    def _register(self, callback: Callable[[], None]) -> int | None:
        """Run ``callback`` on ``cancel()``; at once (returning None) when the token is cancelled."""
        with self._lock:
            if not self._cancelled:
                key = next(self._ids)
                self._callbacks[key] = callback
                return key
        _run_quietly(callback)
        return None


def _run_quietly(callback: Callable[[], None]) -> None:
    # ``cancel()`` must never raise into whoever cancels (a server's disconnect handler, say).
    try:
        callback()
    except Exception:
        logger.exception("a cancellation callback failed")


def check_cancel_token(cancel: object) -> CancelToken | None:
    """``cancel`` when it is a ``CancelToken`` or None; ``TypeError`` naming ``cancel`` otherwise."""
    if cancel is not None and not isinstance(cancel, CancelToken):
        raise TypeError(f"cancel must be a CancelToken or None, got {type(cancel).__name__}")
    return cancel
