"""Every live request of a scheduler and its status: the one place a request moves between states.

A request is registered when it is submitted (``WAITING``) or, for a wave of added branches, when
its owner's monitor adds it (``RUNNING``), and leaves when it ends (``FINISHED``, ``FAILED`` or
``CANCELLED``). In between it is always in exactly one status, so whoever must end every request
(the step, when it fails) finds them all here, and no request can fall between two lists.

The moves a request may make (anything else is a bug, and raises):

* ``WAITING -> ADMITTED``: admission takes it from the queue.
* ``ADMITTED -> PACKED | PREFILLING``: its prompt joins this step's pack, or starts its passes.
* ``PACKED -> PREFILLING``: the pack is prefilled one prompt at a time after all (a packed forward
  failed, or packing is off).
* ``PACKED | PREFILLING -> RUNNING``: its prompt is prefilled; its branches start decoding.
* ``PREFILLING -> PREFILLING``: a pass done, more to go: it goes to the back of the prefilling list,
  so the next step's budget serves the others first.
* ``PACKED | PREFILLING | RUNNING -> WAITING``: out of memory; it starts over later, from the head
  of the queue.
* any live status ``-> FAILED | CANCELLED``, and ``RUNNING -> FINISHED``.

Requests of one status keep the order they entered it in: the decode batch's rows are in that order.
Submitting threads add to the queue while the scheduler's thread moves requests, so every call
takes the registry's lock.
"""

from __future__ import annotations

import threading

from .request import ENDED, Request, RequestStatus

_W, _A, _PK, _PF, _R = (RequestStatus.WAITING, RequestStatus.ADMITTED, RequestStatus.PACKED,
                        RequestStatus.PREFILLING, RequestStatus.RUNNING)
# status -> the live statuses it may move to (an ended status may be reached from any live one,
# except FINISHED, which only a running request reaches).
MOVES: dict[RequestStatus, frozenset[RequestStatus]] = {
    _W: frozenset({_A}),
    _A: frozenset({_PK, _PF}),
    _PK: frozenset({_PF, _R, _W}),
    _PF: frozenset({_PF, _R, _W}),
    _R: frozenset({_W}),
}
# The statuses a request may be registered in: a submitted request waits; a wave runs at once.
FIRST = frozenset({_W, _R})


class RequestRegistry:
    """The live requests of one scheduler, each in the list of its status (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lists: dict[RequestStatus, list[Request]] = {status: [] for status in MOVES}

    def add(self, request: Request, status: RequestStatus = RequestStatus.WAITING) -> None:
        """Register a new request, at the back of ``status``'s list."""
        if request.status is not None or status not in FIRST:
            raise RuntimeError(f"request {request.request_id} cannot be registered as {status.name} "
                               f"(its status is {request.status})")
        with self._lock:
            request.status = status
            self._lists[status].append(request)

    def move(self, request: Request, status: RequestStatus, *, first: bool = False) -> None:
        """Move ``request`` to ``status``: to the back of its list (the front with ``first``), or out
        of the registry for an ended status. Never raises for an end: ending a request must not fail."""
        with self._lock:
            current = request.status
            if current is None or current in ENDED:
                if status in ENDED:
                    return  # already ended (a failure reaching it twice): nothing to do
                raise RuntimeError(f"request {request.request_id} has ended ({current}); it cannot become {status.name}")
            if status in ENDED:
                if status is RequestStatus.FINISHED and current is not RequestStatus.RUNNING:
                    raise RuntimeError(f"request {request.request_id} cannot finish from {current.name}")
            elif status not in MOVES[current]:
                raise RuntimeError(f"request {request.request_id} cannot move from {current.name} to {status.name}")
            self._lists[current].remove(request)
            request.status = status
            if status in ENDED:
                return
            if first:
                self._lists[status].insert(0, request)
            else:
                self._lists[status].append(request)

    def of(self, status: RequestStatus, limit: int | None = None) -> list[Request]:
        """The requests of ``status``, in order, the first ``limit`` of them when given (a copy:
        moving them while iterating is fine)."""
        with self._lock:
            return self._lists[status][:limit]

    def first(self, status: RequestStatus) -> Request | None:
        """The first request of ``status``, or None."""
        with self._lock:
            found = self._lists[status]
            return found[0] if found else None

    def count(self, status: RequestStatus) -> int:
        with self._lock:
            return len(self._lists[status])

    def live(self) -> list[Request]:
        """Every live request, by status (in the order statuses are met), then by order within one."""
        with self._lock:
            return [request for requests in self._lists.values() for request in requests]

    def admitted(self) -> list[Request]:
        """Every live request past the queue: the ones a step works on."""
        return [request for request in self.live() if request.status is not RequestStatus.WAITING]

    def members(self, head: Request) -> list[Request]:
        """The live requests of the submitted request ``head``: itself and its waves."""
        return [request for request in self.live() if request.head is head]

    def decoding(self) -> list[Request]:
        """The running requests that have rows to decode, in batch order."""
        return [request for request in self.of(RequestStatus.RUNNING) if request.active]

    def running_rows(self) -> int:
        """Rows the running requests decode."""
        return sum(len(request.active) for request in self.of(RequestStatus.RUNNING))

    def __bool__(self) -> bool:
        with self._lock:
            return any(self._lists.values())
