"""Branches a client can end: a request of ``n`` branches over an OpenAI-compatible server run as ``n``
streamed requests of one prompt, watched by a ``BranchMonitor`` (``RemoteEngine.submit(...,
monitor=...)``, which early stop and tree search use).

A server decides the choices of one request together and offers no way to end one of them, so each
branch is a request of its own: branch ``i`` asks for one choice seeded ``seed + i`` (where the
server honours ``seed``, branch ``i`` is the sample ``n`` choices would give it on ``rksc serve``).
The prompt is the same text for every branch, so a server with a prefix cache (vLLM's and SGLang's
automatic prefix caching, llama.cpp's ``cache_prompt``, ``rksc serve``'s radix cache) computes it
once; each ``Completion`` reports the ``num_cached_tokens`` its server's ``usage`` gave.

Contract:
    * The monitor sees every token a branch's stream carries as a ``BranchEvent`` (``token_id`` -1:
      servers send no ids; ``logprob`` the one the server streamed with it, 0.0 where it sent none).
      A delta that lists no log-probs counts as one token. Each token is held back until the next
      delta or the end of its stream, so that the branch's last token carries its ``Completion``.
    * ``observe`` runs under the request's lock, one branch's token at a time, in the order the
      servers' streams arrive (not in lockstep as the local scheduler's steps). What the rules
      decide from each branch's own tokens is what they decide locally: where ``answered`` ends a
      branch, which branches ``confidence`` leaves out, the winner ``decided`` keeps. When they
      act can differ (which tokens ``decided`` saves), and the ``length`` rule's reference is the
      length of the branches that finished first in time, which a server's queueing can change.
    * A branch the monitor stops (or ``handle.cancel_branches`` names) has its connection closed at
      once, so the server stops generating it (vLLM, SGLang, ``rksc serve`` and ``transformers
      serve`` abort a request whose client has gone); its ``Completion`` holds what had arrived, with
      ``finish_reason="cancelled"``. Branches the monitor adds are new requests, indices ``n``,
      ``n + 1``, ..., up to ``max_branches``.
    * The request finishes when every launched branch has ended; its completions come in branch
      order. One branch failing (an error answer, a stream that breaks off) fails the request and
      closes the other branches' connections; so does a monitor that raises, or ``cancel()``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from .config import SamplingParams
from .results import BranchControl, BranchEvent, Completion, StreamChunk
from .runtime.handle import BranchMonitor, RequestCancelled, RequestChannel, RequestHandle

# Whoever sends the requests (``RemoteEngine``): start branch ``index`` (its own seeded request),
# report to the listener, and return what closes its connection.
StartBranch = Callable[[int, "BranchListener"], Callable[[], None]]


class BranchListener(Protocol):
    """What a branch's transport reports, from its worker thread."""

    def on_delta(self, index: int, text: str, logprobs: Sequence[float]) -> None:
        """A piece of branch ``index``'s stream: new text and the log-probs sent with it."""

    def on_end(self, index: int, completion: Completion) -> None:
        """Branch ``index`` finished; ``completion`` is the whole of it."""

    def on_error(self, index: int, error: BaseException) -> None:
        """Branch ``index`` failed (or was cancelled: its connection was closed)."""


@dataclasses.dataclass
class _Branch:
    index: int
    close: Callable[[], None] | None = None
    text: str = ""
    logprobs: list[float] = dataclasses.field(default_factory=list)
    num_tokens: int = 0  # tokens the monitor has been shown (or held back for it)
    held: BranchEvent | None = None  # the latest token's event, until it is known not to be the last
    shown: BranchEvent | None = None  # the latest event the monitor saw: what a stopped branch keeps
    completion: Completion | None = None  # set once the branch has ended


class BranchFanOut:
    """One monitored request over a server: its branches, its monitor and its caller's channel.

    Args:
        request_id: The id of the handle.
        n: Branches to launch first.
        max_branches: The most branches the monitor may bring the request to (>= n).
        params: The request's sampling settings (``seed`` is branch 0's).
        monitor: Watches the branches; None runs them as they are.
        stream: Push a ``StreamChunk`` per delta and each branch's last chunk (else none, as a
            local engine pushes none for a request it does not stream).
        start: Starts one branch's request (see ``StartBranch``).
    """

    def __init__(self, request_id: int, n: int, max_branches: int, params: SamplingParams,
                 monitor: BranchMonitor | None, stream: bool, start: StartBranch) -> None:
        self.request_id, self.n, self.max_branches = request_id, n, max_branches
        self.params, self.monitor, self.stream, self._start = params, monitor, stream, start
        self.channel = RequestChannel()
        self._lock = threading.RLock()  # a branch closed from the monitor may report from this thread
        self._branches: list[_Branch] = []
        self._done = False

    def launch(self) -> RequestHandle:
        """Start the first ``n`` branches; the request's handle."""
        with self._lock:
            for _ in range(self.n):
                self._open_branch()
        return RequestHandle(self.request_id, None, self.n, self.channel, _FanOutDriver(self))

    # -- the transport's reports -------------------------------------------------------------------
    def on_delta(self, index: int, text: str, logprobs: Sequence[float]) -> None:
        with self._lock:
            branch = self._running(index)
            if branch is None:
                return
            before = branch.text
            branch.text += text
            branch.logprobs.extend(logprobs)
            # Tokens the delta brings: those its log-probs list beyond the ones shown already (a
            # server that sends them only at the end lists them all there), else one per delta.
            fresh = branch.logprobs[branch.num_tokens:] if logprobs else ([0.0] if text else [])
            for k, logprob in enumerate(fresh):
                self._show_held(branch)
                if self._done or branch.completion is not None:  # the monitor stopped it (or the request)
                    self._finish_if_done()
                    return
                branch.num_tokens += 1
                shown = branch.text if k == len(fresh) - 1 else before
                branch.held = BranchEvent(index, -1, float(logprob), branch.num_tokens, shown)
            if self.stream and (text or logprobs):
                self.channel.push(StreamChunk(text, branch_index=index, logprobs=tuple(logprobs)))
            self._finish_if_done()  # the monitor may have stopped the last other running branch

    def on_end(self, index: int, completion: Completion) -> None:
        with self._lock:
            branch = self._running(index)
            if branch is None:
                return
            event = branch.held or BranchEvent(index, -1, 0.0, max(branch.num_tokens, 1), completion.text)
            branch.held = None
            self._end(branch, completion)
            self._observe([dataclasses.replace(event, text=completion.text, completion=completion)])
            self._finish_if_done()

    def on_error(self, index: int, error: BaseException) -> None:
        with self._lock:
            if self._running(index) is not None:
                self._fail(error)

    # -- the caller's requests ---------------------------------------------------------------------
    def wake(self) -> None:
        """The handle changed: cancelled as a whole, or some branches asked to stop."""
        with self._lock:
            if self._done:
                return
            if self.channel.cancelled.is_set():
                self._fail(RequestCancelled(f"request {self.request_id} was cancelled"))
                return
            for index in sorted(self.channel.take_branch_cancellations()):
                branch = self._running(index)
                if branch is not None:
                    self._stop(branch)
            self._finish_if_done()

    # -- inside the lock ---------------------------------------------------------------------------
    def _running(self, index: int) -> _Branch | None:
        if self._done or not 0 <= index < len(self._branches):
            return None
        branch = self._branches[index]
        return branch if branch.completion is None else None

    def _open_branch(self) -> None:
        branch = _Branch(len(self._branches))
        self._branches.append(branch)
        branch.close = self._start(branch.index, self)

    def _show_held(self, branch: _Branch) -> None:
        if branch.held is not None:
            event, branch.held, branch.shown = branch.held, None, branch.held
            self._observe([event])

    def _observe(self, events: list[BranchEvent]) -> None:
        if self.monitor is None or self._done:
            return
        try:
            control = self.monitor.observe(events)
        except Exception as error:  # the monitor's failure is its own request's
            self._fail(error)
            return
        if control is not None:
            self._apply(control)

    def _apply(self, control: BranchControl) -> None:
        for index in sorted(control.stop):
            branch = self._running(index)
            if branch is not None:
                self._stop(branch)
        for _ in range(max(0, min(int(control.add), self.max_branches - len(self._branches)))):
            self._open_branch()

    def _stop(self, branch: _Branch) -> None:
        """End ``branch`` with what the monitor had seen of it (as a local engine's stopped branch
        holds the tokens up to the step its monitor reacted to), and close its connection."""
        seen = branch.shown.num_tokens if branch.shown is not None else 0
        stopped = Completion(text=branch.shown.text if branch.shown is not None else "", token_ids=(),
                             logprobs=tuple(branch.logprobs[:seen]), finish_reason="cancelled", num_prompt_tokens=0,
                             branch_index=branch.index, seed=self.params.seed, num_reported_tokens=seen)
        branch.held = None
        self._end(branch, stopped)
        if branch.close is not None:
            branch.close()

    def _end(self, branch: _Branch, completion: Completion) -> None:
        branch.completion = completion
        # Chunks only for a streamed request, as a local engine's: ``handle.result()`` waits for news
        # on the channel, and a chunk nobody takes is news at once, so it would spin on it and starve
        # the threads that read the servers' streams.
        if self.stream:
            self.channel.push(StreamChunk("", completion=completion, branch_index=branch.index))

    def _finish_if_done(self) -> None:
        if self._done or any(b.completion is None for b in self._branches):
            return
        self._done = True
        completions = [b.completion for b in self._branches]
        # A stopped branch never saw its usage: it had the prompt its siblings report.
        prompt_tokens = max((c.num_prompt_tokens for c in completions), default=0)
        self.channel.finish([c if c.finish_reason != "cancelled" or c.num_prompt_tokens
                             else dataclasses.replace(c, num_prompt_tokens=prompt_tokens) for c in completions])

    def _fail(self, error: BaseException) -> None:
        if self._done:
            return
        self._done = True
        self.channel.fail(error)
        for branch in self._branches:
            if branch.completion is None and branch.close is not None:
                branch.close()


class _FanOutDriver:
    """The ``RequestDriver`` of a fanned-out request: the branches' threads fill its channel."""

    def __init__(self, fan_out: BranchFanOut) -> None:
        self._fan_out = fan_out

    def holds_engine(self) -> bool:
        return False

    def wait_for(self, channel: RequestChannel, timeout: float | None) -> None:
        channel.wait(timeout)

    def wake(self) -> None:
        self._fan_out.wake()
