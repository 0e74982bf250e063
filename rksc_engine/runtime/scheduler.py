"""The scheduler: one step loop that serves every request of an engine.

Requests arrive through ``RKSCEngine.submit`` from any thread or event loop and wait in a FIFO queue.
Every request the scheduler holds is in its ``RequestRegistry`` with a status (``RequestStatus``),
which changes there and nowhere else. Each step, under the engine lock:

1. **Reap**: requests cancelled by their caller leave the batch; their KV is released.
2. **Admit** (``admission``): waiting requests are prefilled (through the radix prefix cache, one
   prefill per prompt however many branches it asks for) while the batch has rows left
   (``scheduler.max_batch_rows``) and the step's prefill budget (``scheduler.max_prefill_tokens``)
   is not spent: a long prompt in passes, one a step; prompts that fit whole packed into one
   forward, or into the decode's own.
3. **Decode**: every running row of every request advances one token in **one forward**. Each
   request keeps its own ``SharedPrefixCache`` (its prompt once, its branches' suffixes); the forward
   sees them together as a ``BatchDecodeCache``, whose attention runs each request's rows over its
   own KV with the operations they would run alone, so batching only widens the linear layers.
   A request's monitor may stop branches or add waves of them (``waves``).
4. **Retire**: finished branches leave the batch; finished requests get their ``Completion``s, and a
   single-branch request's generated KV goes into the prefix cache for the next turn of a chat.

A failure that belongs to one request (its hook raised, its prefill ran out of memory with nothing
else to wait for) fails that request alone. A failure no request could absorb fails every request
the step had admitted, found in the registry; a request still waiting is served by a later step.

Output reaches callers through each request's ``RequestChannel``: a consumer never holds the engine
lock, so a stream read in one thread, closed in another, dropped, or stalled never blocks the loop.

The loop runs on a daemon thread started at the first submit, which exits after a short idle spell
(so an engine nobody uses can be garbage-collected). A caller that holds the engine lock itself
(``with engine.exclusive():``) drives the steps from its own thread instead, so nothing deadlocks.

What a request's own hook raises (its logits processor, its monitor) fails that request alone,
whatever its type (``SystemExit`` and other ``BaseException``s reach its caller as a ``RuntimeError``
caused by them), and the step goes on for the others. The one exception is a ``KeyboardInterrupt``
on the main thread, which drives steps inside ``engine.exclusive()``: Python delivers Ctrl-C there
wherever the main thread happens to be, a hook included, so it is the user stopping the program,
not the hook failing. It stops the step, fails the step's requests and propagates. No signal
reaches the loop's own thread, so a ``KeyboardInterrupt`` there was raised by the hook itself and
fails its request alone.
"""

from __future__ import annotations

import atexit
import copy
import itertools
import logging
import secrets
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..config import SamplingParams, SchedulerConfig
from ..kvcache.shared_prefix import SharedPrefixCache
from ..kvcache.static_rows import StaticRowPool
from ..results import EngineStats
from .admission import Admission
from .batch_forward import forward_rows, forward_static_rows, roll_back, static_row_order, suffix_lengths
from .branch_output import append_token, completion, emit, end_if_done, finish_text
from .cpu_threads import release_openmp_workers
from .detokenize import Detokenizer
from .drafted_step import StepInputs, forward_drafted, forward_static_drafted, may_draft, plan_step, verify
from .drafts import Draft
from .handle import BranchMonitor, LogitsProcessor, RequestCancelled, RequestChannel, RequestHandle
from .lock import EngineLock
from .model_runner import DecodeLayout, ModelRunner, ran_out_of_memory
from .prefill import Prefiller
from .prefix_access import Prefilled
from .registry import RequestRegistry
from .request import Branch, PromptFork, Request, RequestStatus
from .request_kv import RequestKV
from .sampling import batch_choices, choose_next_tokens, make_generators
from .stats import Counters
from .waves import fork_wave, observe, running_branches, stop_branches

logger = logging.getLogger(__name__)

# Seconds the loop thread waits for work before it exits (a new submit starts it again).
IDLE_EXIT_S = 1.0

# Every scheduler whose loop thread may be alive: stopped and joined when the interpreter exits, so a
# daemon thread is never torn down in the middle of a torch call (which aborts the process).
_LIVE_SCHEDULERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all_schedulers() -> None:
    for scheduler in list(_LIVE_SCHEDULERS):
        scheduler.shutdown()


class Scheduler:
    """Continuous batching over one model and its prefix cache (see the module docstring).

    Args:
        runner: Runs the forward passes.
        prefiller: Computes prompts' KV through the radix cache, and holds its locks.
        tokenizer: Detokenises branches (stop strings, streamed text).
        config: Batch rows and the per-step prefill budget.
        counters: The engine's counters, which the scheduler adds to and publishes.

    Attributes:
        lock: The engine lock: each step runs under it, and so does whoever holds the engine
            (``exclusive()``, a verifier pass); letting go of it publishes a stats snapshot.
        requests: Every live request and its status.
        admission: Admits waiting requests and prefills their prompts.
        kv: Builds and frees the running requests' KV (``kv.suffix_pool``: their generated tokens).
    """

    def __init__(self, runner: ModelRunner, prefiller: Prefiller, tokenizer: Any, config: SchedulerConfig,
                 counters: Counters) -> None:
        self.runner, self.prefiller, self.tokenizer = runner, prefiller, tokenizer
        self.detokenizer = Detokenizer(tokenizer)
        self.counters = counters
        self.prefix_cache = prefiller.prefix_cache
        # Drafts from the radix cache (``drafts.DraftIndex``); None without a cache.
        self._cached_tokens = self.prefix_cache.continuation if self.prefix_cache is not None else None
        # Whoever lets go of the engine last (a step, a verifier pass, an exclusive() block) publishes
        # the stats snapshot that stats() returns while someone else holds it.
        self.lock = EngineLock(on_release=self._on_release)
        self._published_stats = EngineStats()
        runner.min_budget_tokens = self.largest_prompt_tokens
        self._cv = threading.Condition()  # the loop thread's start, idle wait and exit
        self.requests = RequestRegistry()
        self.kv = RequestKV(prefiller, config, runner.device, runner.dtype)
        self.admission = Admission(config, runner, prefiller, self.requests, counters, self)
        self._config = config
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._stepping = False
        self._closing = False
        self.num_steps = 0
        self.peak_batch_rows = 0
        self.peak_running_kv_bytes = 0

    @property
    def config(self) -> SchedulerConfig:
        """Batch rows, the prefill budget and the decode caches' settings (reassigned by the engine)."""
        return self._config

    @config.setter
    def config(self, config: SchedulerConfig) -> None:
        self._config = self.admission.config = self.kv.config = config

    # -- submission -----------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], n: int, params: SamplingParams, *, stream: bool,
               logits_processor: LogitsProcessor | None,
               context_spans: tuple[tuple[int, int], ...] | None = None,
               monitor: BranchMonitor | None = None, max_branches: int | None = None) -> RequestHandle:
        """Queue a validated request; returns its handle at once. ``context_spans``: the prompt cut
        at the chunk separator, for retrieved-context reuse (``PromptEncoder.context_spans``);
        ``monitor`` and ``max_branches``: see ``RKSCEngine.submit``."""
        seed = params.seed if params.seed is not None else secrets.randbelow(2**31)
        channel = RequestChannel()
        request = Request(next(self._ids), list(prompt_ids), n, params, channel, stream, logits_processor, seed,
                          context_spans=context_spans)
        request.branching.monitor = monitor
        request.branching.max_branches = n if max_branches is None else max_branches
        with self._cv:
            self.requests.add(request)
            self._ensure_thread()
            self._cv.notify_all()
        return RequestHandle(request.request_id, len(prompt_ids), n, channel, self)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def holds_engine(self) -> bool:
        """Whether the calling thread holds the engine lock (inside ``engine.exclusive()``)."""
        return self.lock.held_by_caller()

    def wait_for(self, channel: RequestChannel, timeout: float | None) -> None:
        """Block until ``channel`` has news. A caller holding the engine lock steps the loop itself
        (the loop thread cannot get the lock until it lets go)."""
        if self.holds_engine():
            if self._stepping:
                raise RuntimeError("an engine call cannot be made from inside a running step "
                                   "(for example from a logits processor)")
            self.step()
            return
        with self._cv:
            self._ensure_thread()
        channel.wait(timeout if timeout is not None else 0.5)

    @property
    def num_waiting(self) -> int:
        return self.requests.count(RequestStatus.WAITING)

    def largest_prompt_tokens(self) -> int:
        """Prompt length of the longest live request (0 when there is none)."""
        return max((len(r.prompt_ids) for r in self.requests.live()), default=0)

    @property
    def num_running_rows(self) -> int:
        return self.requests.running_rows()

    @property
    def num_running_requests(self) -> int:
        """Submitted requests decoding now (a request's added waves count with it; a request whose
        result is already delivered does not count)."""
        return len({id(r.head) for r in self.requests.of(RequestStatus.RUNNING)
                    if r.head.branching.live_members > 0 and not r.head.channel.finished})

    def running_kv_bytes(self) -> int:
        """Bytes of KV the running requests hold outside the prefix cache (each tensor counted once,
        however many requests or rows share it)."""
        return self.kv.held_bytes(self.requests.of(RequestStatus.RUNNING))

    # -- stats ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the counters, the cache and the batch. Never waits for the engine: while
        someone holds it, the snapshot published when it was last let go of (and before any request
        finished) is returned."""
        if not self.lock.acquire(blocking=False):
            return self._published_stats
        try:
            return self.publish_stats()
        finally:
            self.lock.release(run_hook=False)  # just published

    def publish_stats(self) -> EngineStats:
        """Take a fresh snapshot and make it the one ``stats()`` returns while the engine is busy
        (the caller holds the engine)."""
        snapshot = self.counters.snapshot()
        cache = self.prefix_cache
        snapshot.cache_bytes = cache.total_bytes + self.prefiller.snapshot_bytes
        snapshot.cache_tokens = cache.total_tokens
        snapshot.cache_evicted_tokens = cache.evicted_tokens
        snapshot.cache_window_freed_tokens = cache.window_freed_tokens
        snapshot.cache_peak_bytes = cache.peak_bytes
        snapshot.cache_budget_bytes = cache.budget_bytes
        snapshot.running_requests = self.num_running_requests
        snapshot.waiting_requests = self.num_waiting
        snapshot.running_kv_bytes = self.running_kv_bytes()
        snapshot.peak_running_kv_bytes = self.peak_running_kv_bytes
        snapshot.peak_batch_rows = self.peak_batch_rows
        snapshot.prefix_cache_refusal = self.runner.prefix_cache_refusal()
        snapshot.batched_decode_refusal = self.runner.batched_decode_refusal()
        self._published_stats = snapshot
        return snapshot

    def _on_release(self) -> None:
        """Run by whoever lets go of the engine: publish the stats, and when that is a thread other
        than the loop's (an ``exclusive()`` block, a verifier pass), let its OpenMP workers go, so the
        loop's own are the process's only ones (``cpu_threads``)."""
        self.publish_stats()
        if threading.current_thread() is not self._thread:
            release_openmp_workers()

    def reset_stats(self) -> None:
        """Zero the counters and the peaks (the caller holds the engine)."""
        self.counters.reset()
        self.prefix_cache.reset_peak()
        self.peak_batch_rows = self.num_running_rows
        self.peak_running_kv_bytes = self.running_kv_bytes()
        self.publish_stats()

    # -- the loop -------------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        # Called with self._cv held.
        if self._closing:
            raise RuntimeError("the engine's scheduler has shut down (the interpreter is exiting)")
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="rksc-scheduler", daemon=True)
            _LIVE_SCHEDULERS.add(self)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread after its current step and wait for it (at interpreter exit)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cv:
                if self._closing:
                    self._thread = None
                    return
                if not self.requests:
                    release_openmp_workers()  # out of work: other threads may use the CPUs now
                    self._cv.wait(IDLE_EXIT_S)
                    if not self.requests:
                        self._thread = None
                        return
            try:
                with self.lock:
                    if self.requests:
                        self.step()
            except BaseException:  # noqa: BLE001 - the step failed its requests; keep serving the rest
                logger.exception("a scheduler step raised a BaseException; its requests were failed")

    def step(self) -> None:
        """One scheduling step (the caller holds the engine lock).

        An error no request could absorb fails every request the step had admitted (prefilling,
        packed or running: the registry knows them all) and leaves the engine usable; waiting
        requests stay queued for the next step. A ``BaseException`` (Ctrl-C on the main thread, or
        ``SystemExit`` from a model's forward hook, say) fails them the same way, then propagates to
        whoever drove the step: their callers are never left waiting for a step that will not come."""
        self._stepping = True
        try:
            self._reap_cancelled()
            pack = self.admission.admit()
            if self.requests.decoding():
                self._decode(pack)
            elif pack:
                self.admission.prefill_pack(pack)
            self.num_steps += 1
        except BaseException as error:
            admitted = self.requests.admitted()
            logger.exception("scheduler step failed; failing its %d admitted requests", len(admitted))
            failure = _as_failure(error)
            for request in admitted:
                self.fail(request, failure)
            self.admission.rows_cap = None
            if not isinstance(error, Exception):
                raise
        finally:
            self._stepping = False  # the engine publishes its stats when the step lets go of it

    @torch.inference_mode()
    def _reap_cancelled(self) -> None:
        """Drop cancelled requests, and end the branches their callers or monitors asked to stop.
        Each request is handled on its own: what goes wrong with one never reaches the others."""
        requests = self.requests
        for request in [*requests.of(RequestStatus.WAITING), *requests.of(RequestStatus.PREFILLING)]:
            if request.channel.cancelled.is_set():
                self.fail(request, RequestCancelled(f"request {request.request_id} was cancelled"))
        drained: set[int] = set()
        for request in requests.decoding():
            head = request.head
            if not head.channel.asks_to_stop and not head.branching.pending_stop:
                continue  # nothing to do for it: the usual case, kept to attribute reads
            if request.status is not RequestStatus.RUNNING:  # ended with another member of its request
                continue
            try:
                if head.channel.cancelled.is_set():
                    self.fail(request, RequestCancelled(f"request {head.request_id} was cancelled"))
                    continue
                if id(head) not in drained:  # once per submitted request, whichever of its waves runs
                    drained.add(id(head))
                    asked = head.channel.take_branch_cancellations()
                    if asked:
                        head.branching.pending_stop |= asked & running_branches(requests.members(head))
                if head.branching.pending_stop and not stop_branches(request, self.counters, self.runner.device):
                    self._member_done(request)
            except Exception as error:
                self.fail(request, error)

    # -- decoding -------------------------------------------------------------------------------
    @torch.inference_mode()
    def _decode(self, pack: list[Request]) -> None:
        """Every running row one token further; ``pack`` (admitted prompts) prefilled in the same
        forward when it can be, else the usual way after it. Either way the pack's requests start
        after the decode and take their next token in the next step."""
        runner = self.runner
        running = self.requests.decoding()  # waves added during this decode take their next token next step
        batched, static, alone = [], [], []
        for request in running:  # by the cache each decodes in
            (static if request.static else batched if request.shared else alone).append(request)
        config = self._config
        plans = (plan_step(batched, torch.cat([r.next_tokens for r in batched]).tolist(), config.draft_tokens,
                           config.draft_sources, self._cached_tokens) if config.draft_tokens and batched else None)
        mixed = self.admission.forward_with_pack(batched, pack) if batched and pack and plans is None else None
        prefilled: list[Prefilled] | None = None
        stepped: tuple[torch.Tensor, list[tuple[int, int]]] | None = None  # the rows' logits and ranges
        if mixed is not None:
            logits, row_ranges, prefilled = mixed
            stepped = (logits, row_ranges)
        elif plans is not None:
            self._decode_drafted(running, batched, plans)
        elif batched:
            try:
                stepped = forward_rows(runner, batched)
            except Exception as error:
                self._decode_failed(error, running, batched)
        if stepped is not None:
            self._count_forward(batched)
            self._advance_rows(batched, *stepped)
        if static:
            self._decode_static(running, static)
        for request in alone:  # a model the shared-prefix path does not support: one forward each
            if request.head.channel.finished or not request.active:
                continue
            try:
                out = runner.decode_forward(request.next_tokens[:, None], request.cache)
            except Exception as error:
                self._decode_failed(error, running, [request])
                continue
            self._advance_or_fail(request, out.logits[:, -1, :])
        if pack:
            if prefilled is not None:
                self.admission.start_prefilled(pack, prefilled)
            else:
                self.admission.prefill_pack(pack)

    def _decode_static(self, running: list[Request], static: list[Request]) -> None:
        """The rows of ``static`` (requests on static rows) one step further: a drafted step
        (``drafted_step.plan_step``, every row drafting) when drafting is on and a row has a draft, else an
        ordinary one."""
        pool, config = self.kv.static_pool, self._config
        try:
            self.kv.make_room()
            order, row_ranges, slots = static_row_order(pool, static)
            plans = None
            if config.draft_tokens:
                next_ids = pool.next_tokens[:pool.top].tolist()
                plans = plan_step(static, [next_ids[s] for s in order], config.draft_tokens, config.draft_sources,
                                  self._cached_tokens, every_row=True)
            if plans is None:
                logits = forward_static_rows(self.runner, pool, order, slots)
            else:  # room for the widest row's positions (no holes now: nothing moves)
                self.kv.make_room(max(plan.width for plan in plans))
                logits = forward_static_drafted(self.runner, pool, order, slots, plans, next_ids)
        except Exception as error:
            self._decode_failed(error, running, static)
            return
        self._count_forward(static)
        if plans is None:
            self._advance_rows(static, logits, row_ranges, pool, slots)
            return
        self.counters.count("draft_forwards")
        for request, plan, (start, stop) in zip(static, plans, row_ranges):
            if plan.verifies:
                self._run_guarded(request, lambda r=request, p=plan, s=start, e=stop:
                                  self._advance_static_verified(r, logits[s:e], p))
            else:  # its rows' tokens from their first position, as in an ordinary step
                self._run_guarded(request, lambda r=request, s=start, e=stop:
                                  self._advance_static_first(r, logits[s:e, 0]))

    def _advance_static_first(self, request: Request, logits: torch.Tensor) -> bool:
        """Advance ``request`` (on static rows, not drafting) by its rows' first positions of a
        drafted step, as an ordinary step would: each slot keeps the KV of its next token only."""
        self.kv.static_pool.advance_by(request.cache.slots, [1] * len(request.cache.slots))
        return self._advance(request, logits)

    def _advance_static_verified(self, request: Request, logits: torch.Tensor, plan: StepInputs) -> bool:
        """Advance ``request`` (on static rows) by what each of its rows verified in a drafted step
        (``drafted_step.verify``): each row's tokens recorded (``_take_verified``), its slot keeping
        the KV of the tokens it fed that it took, its next token the last it took; the rows that
        finished retire. ``logits``: (R, T, V). Returns whether it still has rows."""
        pool = self.kv.static_pool
        taken = verify(logits, plan, request.params, request.row_generators)
        kept = [self._take_verified(request, b, draft, tokens, logprobs)
                for b, draft, (tokens, logprobs) in zip(request.active, plan.drafts, taken)]
        slots = request.cache.slots
        pool.advance_by(slots, kept)
        pool.next_tokens.index_copy_(0, torch.tensor(slots, device=pool.device),
                                     torch.tensor([tokens[-1] for tokens, _ in taken], device=pool.device))
        if not stop_branches(request, self.counters, self.runner.device):
            self._member_done(request)
            return False
        return True

    def _take_verified(self, request: Request, b: int, draft: Draft | None, tokens: list[int],
                       logprobs: list[float]) -> int:
        """Record branch ``b``'s tokens taken in a drafted step (``drafted_step.verify``), up to the
        one that finishes it (nothing after it is taken, as without a draft), stream them, count its
        draft. Returns the positions of the step whose KV it keeps: one per token taken, since each
        token it took but the last was fed at the position after the one it was chosen at (its next
        token, then the draft's tokens), and a finished branch's last token is never fed."""
        params, branch = request.params, request.branches[b]
        appended = 0
        for token, logprob in zip(tokens, logprobs):
            append_token(branch, token, logprob, params, request.max_new, self.runner.eos_token_ids,
                         self.detokenizer, request.watched)
            appended += 1
            if branch.finish_reason is not None:
                break
        self.counters.count("decode_tokens", appended)
        self._count_draft(branch, draft, min(appended, len(tokens) - 1))
        if request.stream:
            emit(request, branch)
        return appended

    def _count_draft(self, branch: Branch, draft: Draft | None, accepted: int) -> None:
        """Count what ``branch``'s ``draft`` (if it had one) proposed and how much of it it kept."""
        if draft is None:
            return
        branch.drafted_tokens += len(draft.tokens)
        branch.accepted_draft_tokens += accepted
        for name, amount in (("drafted_tokens", len(draft.tokens)), ("accepted_draft_tokens", accepted),
                             ("rejected_draft_tokens", len(draft.tokens) - accepted)):
            self.counters.count(name, amount)
            self.counters.count(f"{name}_{draft.source}", amount)

    def _advance_rows(self, requests: list[Request], logits: torch.Tensor, row_ranges: list[tuple[int, int]],
                      pool: StaticRowPool | None = None, slots: torch.Tensor | None = None) -> None:
        """Advance each of ``requests`` by its rows ``row_ranges`` of one forward's ``logits`` (rows,
        V). The requests without a logits processor that choose alike (the greedy ones; the sampled
        ones with the same settings) take their tokens from one call for all (``batch_choices``),
        read to the host once; with ``pool`` (static rows, ``slots`` each row's), those tokens go
        into the pool's next tokens in one write. The work per request is then Python only."""
        choosers = [(None if r.logits_processor is not None else r.params, r.row_generators) for r in requests]
        choices = batch_choices(logits, choosers, row_ranges)
        if choices is not None:
            tokens, logprobs, chosen = choices
            token_list, logprob_list = tokens.tolist(), logprobs.tolist()
            if pool is not None:  # a row not chosen here writes its own next token (``_advance``)
                pool.next_tokens.index_copy_(0, slots, tokens)
        unwatched: list[tuple[Request, int]] = []
        for i, (request, (start, stop)) in enumerate(zip(requests, row_ranges)):
            if choices is None or not chosen[i]:
                self._advance_or_fail(request, logits[start:stop])
                continue
            if not request.watched:
                unwatched.append((request, start))
                continue
            # Static rows feed their next tokens from the pool; the others keep theirs for the forward.
            next_tokens = None if pool is not None else tokens[start:stop]
            self._advance_or_fail(request, None, (token_list[start:stop], logprob_list[start:stop]), next_tokens)
        if unwatched:
            self._advance_unwatched(unwatched, token_list, logprob_list, None if pool is not None else tokens)

    def _advance_unwatched(self, requests: list[tuple[Request, int]], tokens: list[int], logprobs: list[float],
                           next_tokens: torch.Tensor | None) -> None:
        """Record one step of requests that nobody watches while they run (each with its first
        row's index into ``tokens``/``logprobs``), in one loop for all of them: a step appends each
        row's token and checks whether it ended the branch. Static rows find their next tokens in the
        pool; the others take their rows of ``next_tokens`` (the step's chosen tokens, on the device). A
        request with a row that ended, or a branch to stop, then takes the usual way out
        (``stop_branches``); the others cost no call of their own."""
        eos = self.runner.eos_token_ids
        ending: list[Request] = []
        recorded = 0
        for request, start in requests:
            active = request.active
            if not active or request.status is not RequestStatus.RUNNING:  # failed earlier in this step
                continue
            if next_tokens is not None:
                request.next_tokens = next_tokens[start:start + len(active)]
            branches, max_new = request.branches, request.max_new
            ended = False
            for row, b in enumerate(active):
                branch = branches[b]
                token = tokens[start + row]
                branch.token_ids.append(token)
                branch.logprobs.append(logprobs[start + row])
                if token in eos or len(branch.token_ids) >= max_new:
                    ended = True
            recorded += len(active)
            if ended or request.branching.pending_stop:
                ending.append(request)
        self.counters.count("decode_tokens", recorded)
        for request in ending:
            self._run_guarded(request, lambda r=request: self._end_unwatched_rows(r))

    def _end_unwatched_rows(self, request: Request) -> bool:
        """End the branches of an unwatched request whose latest token ended them, and retire its
        ended and stopped rows; returns whether it still has rows."""
        eos, detokenizer = self.runner.eos_token_ids, self.detokenizer
        for b in request.active:
            branch = request.branches[b]
            if branch.finish_reason is None:
                end_if_done(branch, request.max_new, eos, detokenizer)
        if not stop_branches(request, self.counters, self.runner.device):
            self._member_done(request)
            return False
        return True

    def _decode_drafted(self, running: list[Request], batched: list[Request], plans: list[StepInputs]) -> None:
        """``batched`` one step further in one forward over their ``plans``' positions (their next
        tokens and drafts, ``drafted_step``); each request's KV then keeps what its rows verified."""
        lengths = suffix_lengths(batched)
        try:
            logits, row_ranges = forward_drafted(self.runner, batched, plans)  # (rows, T, V)
        except Exception as error:
            self._decode_failed(error, running, batched)
            return
        self.counters.count("draft_forwards")
        self._count_forward(batched)
        for request, plan, length, (start, stop) in zip(batched, plans, lengths, row_ranges):
            if plan.verifies:
                self._run_guarded(request, lambda r=request, p=plan, n=length, s=start, e=stop:
                                  self._advance_verified(r, logits[s:e], p, n))
            else:  # its rows' tokens from their first position, as in an ordinary step
                roll_back([request], [length + 1])
                self._advance_or_fail(request, logits[start:stop, 0])

    def _advance_verified(self, request: Request, logits: torch.Tensor, plan: StepInputs, length: int) -> bool:
        """Advance ``request`` (one row) by what its row verified in a drafted step
        (``drafted_step.verify``): record and stream its tokens, keep the KV of its known token and
        the draft tokens it accepted, retire it when it has finished. ``logits``: (1, T, V); ``length``:
        its suffix length before the step. Returns whether it still has its row."""
        (tokens, logprobs), = verify(logits, plan, request.params, request.row_generators)
        kept = self._take_verified(request, request.active[0], plan.drafts[0], tokens, logprobs)
        roll_back([request], [length + kept])
        request.next_tokens = torch.tensor([tokens[-1]], device=self.runner.device)
        if not stop_branches(request, self.counters, self.runner.device):
            self._member_done(request)
            return False
        return True

    def _count_forward(self, requests: list[Request]) -> None:
        """One decode forward ran the rows of ``requests``: count it once per submitted request."""
        for head in {id(r.head): r.head for r in requests}.values():
            head.decode_forwards += 1

    def _decode_failed(self, error: Exception, running: list[Request], failed: list[Request]) -> None:
        """A decode forward over ``failed`` raised ``error`` (every cache was rolled back). Out of
        memory even after evicting and retrying, with another request to go on: preempt the newest
        request that can start over, to be recomputed when there is room, and admit no more rows
        than the others hold until one finishes; the rest go on. Otherwise ``failed`` fail."""
        victim = None
        if ran_out_of_memory(error) and len(running) >= 2:
            candidates = [r for r in running if r.preemptible and r.active]
            victim = max(candidates, key=lambda r: r.request_id) if candidates else None
        if victim is None:
            for request in failed:
                self.fail(request, error)
            return
        self.preempt(victim)
        self.admission.rows_cap = sum(len(r.active) for r in running if r is not victim)

    def _advance_or_fail(self, request: Request, logits: torch.Tensor | None,
                         chosen: tuple[list[int], list[float]] | None = None,
                         next_tokens: torch.Tensor | None = None) -> bool:
        """``_advance``, but an error (a failing logits processor or monitor, say) fails this request
        alone; only a ``KeyboardInterrupt`` on the main thread stops the step (module docstring)."""
        return self._run_guarded(request, lambda: self._advance(request, logits, chosen, next_tokens))

    def _run_guarded(self, request: Request, advance: Callable[[], bool]) -> bool:
        """``advance()`` (one of ``request``'s advances), but an error fails this request alone; only a
        ``KeyboardInterrupt`` on the main thread stops the step (module docstring). False, without
        calling it, for a request that failed earlier in this step."""
        if request.head.channel.finished or not request.active:  # failed earlier in this step
            return False
        try:
            return advance()
        except KeyboardInterrupt as error:
            if threading.current_thread() is threading.main_thread():
                raise  # the user's Ctrl-C, wherever the main thread was: it stops the step (module docstring)
            self.fail(request, _as_failure(error))  # no signal reaches this thread: the hook raised it
            return False
        except BaseException as error:  # noqa: BLE001 - a request's own hook fails that request alone
            self.fail(request, _as_failure(error))
            return False

    def _advance(self, request: Request, logits: torch.Tensor | None,
                 chosen: tuple[list[int], list[float]] | None = None,
                 next_tokens: torch.Tensor | None = None) -> bool:
        """Sample the next token of each active row of ``request`` from ``logits`` (rows, V), record
        it, stream it, let the monitor react, retire finished and stopped branches. Returns whether
        the request (this wave, for an added one) still has rows.

        ``chosen``, given only to a request without a logits processor, is its rows' tokens and
        log-probabilities, picked with those of the requests that choose alike (``batch_choices``), and
        ``next_tokens`` the same tokens as the tensor its next forward feeds (None when the forward
        finds them elsewhere: static rows read them from their pool)."""
        params, head = request.params, request.head
        if chosen is not None:
            token_list, logprob_list = chosen
        else:
            if request.logits_processor is not None:
                logits = request.logits_processor([request.branches[b].token_ids for b in request.active], logits)
            next_tokens, logprobs = choose_next_tokens(logits, params, request.row_generators)
            token_list, logprob_list = next_tokens.tolist(), logprobs.tolist()
        for row, b in enumerate(request.active):
            append_token(request.branches[b], token_list[row], logprob_list[row], params, request.max_new,
                         self.runner.eos_token_ids, self.detokenizer, request.watched)
        self.counters.count("decode_tokens", len(request.active))
        control = observe(request, token_list, logprob_list)
        if control is not None:
            running = running_branches([*self.requests.members(head), request])
            head.branching.pending_stop |= set(control.stop) & running
            if control.add:
                self._spawn(head, int(control.add))
        if request.stream:
            for b in request.active:  # a branch stopped by the monitor ends in stop_branches
                if request.branches[b].finish_reason is not None or b not in head.branching.pending_stop:
                    emit(request, request.branches[b])
        request.next_tokens = next_tokens
        if not stop_branches(request, self.counters, self.runner.device):
            self._member_done(request)
            return False
        return True

    def _spawn(self, owner: Request, count: int) -> None:
        """Add ``count`` branches to ``owner`` as a wave (``waves.fork_wave``) that takes its first
        tokens now and decodes from the next step on."""
        forked = fork_wave(owner, count, next(self._ids), self.kv, self.runner.device)
        if forked is None:
            return
        wave, logits = forked
        self.requests.add(wave, RequestStatus.RUNNING)
        self.counters.count("branches_added", wave.n)
        self._advance_or_fail(wave, logits)

    def _split_rows(self, head: Request) -> list[Request]:
        """``head``'s branches after its first as members of one row each, forked off its prompt as
        waves are (``waves.fork_wave``) and running, their first tokens not taken yet: branch ``i``
        draws from the generator seeded ``seed + i`` from the prompt's logits, as it would among its
        siblings. Returns each with the logits it takes its first token from."""
        waves = []
        for _ in range(head.n - len(head.branches)):
            forked = fork_wave(head, 1, next(self._ids), self.kv, self.runner.device)
            if forked is None:
                break
            self.requests.add(forked[0], RequestStatus.RUNNING)
            waves.append(forked)
        if head.branching.max_branches <= head.n:
            head.branching.fork = None  # no branch will be added
        return waves

    # -- starting and ending requests -------------------------------------------------------------
    @torch.inference_mode()
    def start(self, request: Request, prefilled: Prefilled) -> None:
        """Fan the prefilled prompt out to the ``n`` branches and take their first tokens."""
        request.num_cached_tokens = prefilled.num_cached_tokens
        request.exact, request.reuse_decision = prefilled.exact, prefilled.asks
        request.max_new = min(request.params.max_new_tokens, self.runner.context_window - len(request.prompt_ids))
        branching = request.branching
        # A request that drafts decodes each branch as a member of one row (the submitted request
        # takes branch 0, waves the others): a member's rows share one suffix length, so only a
        # branch alone keeps every draft token it verified.
        split = (self._config.draft_tokens > 0 and request.n > 1 and may_draft(request) and request.shared_prefix
                 and SharedPrefixCache.can_share(prefilled.cache))
        rows = 1 if split else request.n
        forks = branching.max_branches > request.n or split
        # On the plain path (the model or this prompt cannot share), later waves copy the batch-1 prompt
        # cache; static rows copy it into their slots and leave it as it is.
        static = request.layout is DecodeLayout.STATIC_ROWS
        plain = not static and not (request.shared_prefix and SharedPrefixCache.can_share(prefilled.cache))
        template = (prefilled.cache if static else copy.deepcopy(prefilled.cache) if plain else None) if forks else None
        request.cache = self.kv.decode_cache(prefilled.cache, rows, request.max_new, request.layout,
                                             request=request if prefilled.exact else None)
        if forks:
            # Later waves fork off the prompt's KV exactly as the first did: the same segments (read in
            # place, so held once) or a copy of the batch-1 prompt cache, and the same first logits.
            prompt_kv = request.cache.prompt_segments() if request.shared else template
            branching.fork = PromptFork(prompt_kv, prefilled.last_logits.clone())  # a logits processor may edit its input
        request.branches = [Branch(i) for i in range(rows)]
        for branch in request.branches:
            branch.skip_tokens, branch.emitted_chars = request.replay.delivered.get(branch.index, (0, 0))
        request.active = list(range(rows))
        request.watched = (request.stream or bool(request.params.stop) or branching.monitor is not None
                           or request.logits_processor is not None or forks)
        if not request.params.greedy:
            request.generators = make_generators(request.seed, rows, self.runner.device)
        branching.live_members = 1
        self.requests.move(request, RequestStatus.RUNNING)
        # Every member runs before any takes a token: a branch that ends at its first token must not
        # finish the request while its siblings have not started.
        waves = self._split_rows(request) if split else []
        logits = prefilled.last_logits if rows == 1 else prefilled.last_logits.expand(rows, -1)
        self._advance_or_fail(request, logits)
        for wave, wave_logits in waves:
            self._advance_or_fail(wave, wave_logits)
        self.peak_batch_rows = max(self.peak_batch_rows, self.num_running_rows)
        self.peak_running_kv_bytes = max(self.peak_running_kv_bytes, self.running_kv_bytes())

    def preempt(self, request: Request) -> None:
        """Take ``request`` out of the batch and put it first in the queue. Its KV is freed; it starts
        over when admitted again and, with the same prompt and seeds, generates the same tokens, of
        which its streams deliver only those they have not delivered yet."""
        self.kv.release(request)
        if request.branches:  # not when its prompt was still being prefilled: nothing new was delivered
            request.replay.delivered = {b.index: (len(b.token_ids) - len(b.pending_ids), b.emitted_chars)
                                        for b in request.branches}
        request.branches, request.active, request.generators, request.next_tokens = [], [], [], None
        request.draft_index, request.decode_forwards = None, 0
        self.counters.count("preemptions")
        self.requests.move(request, RequestStatus.WAITING, first=True)

    def fail(self, request: Request, error: BaseException) -> None:
        """Fail the submitted request ``request`` belongs to, with all its waves, and free their KV
        (``CANCELLED`` for a ``RequestCancelled``). Never raises: a failure must not spread to the
        requests processed after it."""
        head = request.head
        ended = RequestStatus.CANCELLED if isinstance(error, RequestCancelled) else RequestStatus.FAILED
        members = self.requests.members(head)
        try:
            for member in members:
                self.kv.release(member)
            self.kv.release(head)
        except Exception:
            logger.exception("could not release the KV of request %d", head.request_id)
        for member in [*members, head]:
            self.requests.move(member, ended)
        head.channel.fail(error)

    def _member_done(self, request: Request) -> None:
        """``request`` (the submitted request or one of its waves) has no rows left: free its rows' KV
        and, once no wave of the submitted request is left, finish it."""
        head = request.head
        head.branching.live_members -= 1
        if request is not head or head.branching.live_members > 0:
            self.kv.drop_cache(request)  # the prompt lives on in the owner's fork for the other waves
        if request is not head:
            self.requests.move(request, RequestStatus.FINISHED)
        if head.branching.live_members > 0:
            return
        self._finish(head)

    def _finish(self, request: Request) -> None:
        self.admission.rows_cap = None  # rows have freed up: admit up to the configured batch again
        if request.draft_index is not None and request.branches:
            # Without drafts its longest branch takes one forward a token after its first.
            longest = max(len(b.token_ids) for b in request.branches)
            self.counters.count("draft_steps_saved", max(0, longest - 1 - request.decode_forwards))
        if request.n == 1 and request.exact and len(request.branches) == 1 and request.cache is not None:
            # approximate (ASKS) KV never enters the exact cache
            try:
                self.prefiller.cache_generated(request.prompt_ids, request.branches[0].token_ids, request.cache)
            except Exception:  # caching is an optimisation: the request's answer stands without it
                logger.exception("could not cache the KV of request %d's answer", request.request_id)
        self.kv.release(request)
        if not request.watched:  # a branch that ended by eos or length has its text; a stopped one not yet
            for branch in request.branches:
                if branch.finish_reason == "cancelled":
                    finish_text(branch, self.detokenizer)
        completions = [completion(request, b) for b in request.branches]
        self.runner.request_finished()
        self.requests.move(request, RequestStatus.FINISHED)
        try:
            self.publish_stats()  # before the caller wakes, so its stats() sees this request
        except Exception:
            logger.exception("could not publish the engine's stats")
        request.channel.finish(completions)


def _as_failure(error: BaseException) -> BaseException:
    """The error a failed request's caller receives: ``error`` itself, or, for a ``BaseException``
    that is not an ``Exception`` (``SystemExit`` from a hook), a ``RuntimeError`` caused by it, so a
    caller's ``result()`` does not exit its thread."""
    if isinstance(error, Exception):
        return error
    failure = RuntimeError(f"the scheduler step was interrupted by {type(error).__name__}: {error}")
    failure.__cause__ = error
    return failure
