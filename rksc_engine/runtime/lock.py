"""The engine lock: one scheduler step, verifier pass or ``exclusive()`` block at a time."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class EngineLock:
    """A re-entrant lock that knows its owner, so "does this thread hold the engine?" is answered
    without reaching into ``threading.RLock`` internals. Used as ``with lock:``."""

    def __init__(self, on_release: Callable[[], None] | None = None) -> None:
        self._lock = threading.RLock()
        self._owner: int | None = None
        self._depth = 0
        self._on_release = on_release  # run by the outermost release, while the lock is still held

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self._owner = threading.get_ident()
        self._depth += 1
        return True

    def release(self, run_hook: bool = True) -> None:
        if self._owner != threading.get_ident():
            raise RuntimeError("the engine lock is released by a thread that does not hold it")
        if run_hook and self._depth == 1 and self._on_release is not None:
            try:
                self._on_release()
            except Exception:  # a convenience (the stats snapshot): never a reason to keep the lock
                logger.exception("the engine lock's release hook failed")
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
        self._lock.release()

    def held_by_caller(self) -> bool:
        return self._owner == threading.get_ident()

    def __enter__(self) -> EngineLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
