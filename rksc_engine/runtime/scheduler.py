"""The scheduler: one step loop that serves every request of an engine.

Requests arrive through ``RKSCEngine.submit`` from any thread or event loop and wait in a FIFO queue.
Each step, under the engine lock:

1. **Reap**: requests cancelled by their caller leave the batch; their KV is released.
2. **Admit**: waiting requests are prefilled (through the radix prefix cache, one prefill per prompt
   however many branches it asks for) while the batch has rows left (``scheduler.max_batch_rows``)
   and the step's prefill budget (``scheduler.max_prefill_tokens``) is not spent. A prompt longer
   than the budget is prefilled in chunks of that size, one per step, while the running requests go
   on decoding between them. Prompts that fit whole are prefilled together in one forward
   (``packed_prefill``), or, when rows are decoding and ``mixed_prefill`` is on, in the decode's own forward.
3. **Decode**: every running row of every request advances one token in **one forward**. Each
   request keeps its own ``SharedPrefixCache`` (its prompt once, its branches' suffixes); the forward
   sees them together as a ``BatchDecodeCache``, whose attention runs each request's rows over its
   own KV with the operations they would run alone, so batching only widens the linear layers.
4. **Retire**: finished branches leave the batch; finished requests get their ``Completion``s, and a
   single-branch request's generated KV goes into the prefix cache for the next turn of a chat.

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
import collections
import copy
import itertools
import logging
import secrets
import threading
import weakref
from typing import Any

import torch

from ..config import SamplingParams, SchedulerConfig
from ..kvcache.cache_layers import layer_tensors, repeat_rows, select_rows
from ..kvcache.memory import ForwardOutOfMemoryError, is_out_of_memory
from ..kvcache.prefix_match import common_prefix_length
from ..kvcache.shared_prefix import SharedPrefixCache, initial_suffix_capacity
from ..kvcache.suffix_pool import SuffixPool
from ..results import BranchEvent, EngineStats
from .batch_forward import forward_rows, forward_rows_and_prompts
from .branch_output import append_token, completion, emit
from .cpu_threads import release_openmp_workers
from .handle import BranchMonitor, LogitsProcessor, RequestCancelled, RequestChannel, RequestHandle
from .lock import EngineLock
from .model_runner import ModelRunner
from .prefill import Prefilled, Prefiller
from .request import Branch, Request
from .sampling import choose_next_tokens, greedy_choices, make_generators
from .stats import Counters

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
    """

    def __init__(self, runner: ModelRunner, prefiller: Prefiller, tokenizer: Any, config: SchedulerConfig,
                 counters: Counters) -> None:
        self.runner, self.prefiller, self.tokenizer = runner, prefiller, tokenizer
        self.config, self.counters = config, counters
        self.prefix_cache = prefiller.prefix_cache
        # Whoever lets go of the engine last (a step, a verifier pass, an exclusive() block) publishes
        # the stats snapshot that stats() returns while someone else holds it.
        self.lock = EngineLock(on_release=self._on_release)
        self._published_stats = EngineStats()
        runner.min_budget_tokens = self.largest_prompt_tokens
        self._cv = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._prefilling: list[Request] = []  # admitted, prompt prefilled in chunks over several steps
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._stepping = False
        self._closing = False
        self.num_steps = 0
        self.peak_batch_rows = 0
        self.peak_running_kv_bytes = 0
        self.num_preemptions = 0
        # Set by a preemption: the rows that last fitted, which admission respects until a request
        # finishes (else the preempted request would be re-admitted into the same shortage at once).
        self._rows_cap: int | None = None
        # What is left of this step's prefill budget: the size of the next prefill pass.
        self._pass_tokens = 0
        self._spawned: list[Request] = []  # waves added during the current decode
        # Admitted prompts whose prefill rides in this step's decode forward (``mixed_prefill``).
        self._pack_in_flight: list[Request] = []
        self._mixes_prompts = True  # False once a mixed step failed its check or any non-OOM failure
        self._mixed_checked = False
        # The running requests' generated tokens, in slots of one buffer per layer.
        self.suffix_pool = SuffixPool(config.max_pooled_suffix_tokens) if config.max_pooled_suffix_tokens else None

    # -- submission -----------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], n: int, params: SamplingParams, *, stream: bool,
               logits_processor: LogitsProcessor | None,
               segments: tuple[tuple[int, int], ...] | None = None,
               monitor: BranchMonitor | None = None, max_branches: int | None = None) -> RequestHandle:
        """Queue a validated request; returns its handle at once. ``segments``: the prompt cut at the
        chunk separator, for retrieved-context reuse (``PromptEncoder.segments``); ``monitor`` and
        ``max_branches``: see ``RKSCEngine.submit``."""
        seed = params.seed if params.seed is not None else secrets.randbelow(2**31)
        channel = RequestChannel()
        request = Request(next(self._ids), list(prompt_ids), n, params, channel, stream, logits_processor, seed)
        request.segments = segments
        request.monitor = monitor
        request.max_branches = n if max_branches is None else max_branches
        with self._cv:
            self._waiting.append(request)
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
        return len(self._waiting)

    def largest_prompt_tokens(self) -> int:
        """Prompt length of the longest request running or waiting (0 when there is none)."""
        return max((len(r.prompt_ids) for r in [*self._running, *self._prefilling, *self._waiting]), default=0)

    @property
    def num_running_rows(self) -> int:
        return sum(len(r.active) for r in self._running)

    @property
    def num_running_requests(self) -> int:
        """Submitted requests decoding now (a request's added waves count with it; a request whose
        result is already delivered does not count)."""
        return len({id(r.head) for r in self._running if r.head.live_members > 0 and not r.head.channel.finished})

    def running_kv_bytes(self) -> int:
        """Bytes of KV the running requests hold outside the prefix cache (each tensor counted once,
        however many requests or rows share it)."""
        seen: dict[int, int] = {}
        for request in self._running:
            for layer in getattr(request.cache, "layers", ()):
                # The branches' suffixes, or a DynamicCache's all (a recurrent layer's states instead)
                tensors = layer_tensors(layer)
                segments = getattr(layer, "prompt_segments", [])
                # Segments read in place from the radix cache are the cache's bytes, not the request's.
                if request.head.locked_node is None:
                    private = segments
                else:
                    private = segments[len(segments) - request.num_private_segments:] if request.num_private_segments else []
                tensors += [t for pair in private for t in pair]
                for tensor in tensors:
                    if isinstance(tensor, torch.Tensor):
                        storage = tensor.untyped_storage()
                        seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

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

    def _has_work(self) -> bool:
        return bool(self._waiting or self._running or self._prefilling)

    def _loop(self) -> None:
        while True:
            with self._cv:
                if self._closing:
                    self._thread = None
                    return
                if not self._has_work():
                    release_openmp_workers()  # out of work: other threads may use the CPUs now
                    self._cv.wait(IDLE_EXIT_S)
                    if not self._has_work():
                        self._thread = None
                        return
            try:
                with self.lock:
                    if self._has_work():
                        self.step()
            except BaseException:  # noqa: BLE001 - the step failed its requests; keep serving the rest
                logger.exception("a scheduler step raised a BaseException; its requests were failed")

    def step(self) -> None:
        """One scheduling step (the caller holds the engine lock).

        An error no request could absorb fails the requests it touched (running and prefilling)
        and leaves the engine usable. A ``BaseException`` (Ctrl-C on the main thread, or ``SystemExit``
        from a model's forward hook, say) fails them the same way, then propagates to whoever drove the
        step: their callers are never left waiting for a step that will not come."""
        self._stepping = True
        try:
            self._reap_cancelled()
            pack = self._admit()
            if self._running:
                self._decode(pack)
            elif pack:
                self._prefill_pack(pack)
            self.num_steps += 1
        except BaseException as error:
            logger.exception("scheduler step failed; failing the %d running requests", len(self._running))
            failure = _as_failure(error)
            for request in [*self._running, *self._prefilling, *self._spawned, *self._pack_in_flight]:
                self._fail(request, failure)
            self._spawned, self._pack_in_flight = [], []
            self._running, self._prefilling = [], []
            self._rows_cap = None
            if not isinstance(error, Exception):
                raise
        finally:
            self._stepping = False  # the engine publishes its stats when the step lets go of it

    @torch.inference_mode()
    def _reap_cancelled(self) -> None:
        """Drop cancelled requests, and end the branches their callers or monitors asked to stop.
        Each request is handled on its own: what goes wrong with one never reaches the others."""
        with self._cv:
            waiting = [r for r in self._waiting if r.channel.cancelled.is_set()]
            for request in waiting:
                self._waiting.remove(request)
        for request in waiting:
            self._fail(request, RequestCancelled(f"request {request.request_id} was cancelled"))
        for request in [r for r in self._prefilling if r.channel.cancelled.is_set()]:
            self._prefilling.remove(request)
            self._fail(request, RequestCancelled(f"request {request.request_id} was cancelled"))
        drained: set[int] = set()
        for request in list(self._running):
            head = request.head
            try:
                if head.channel.cancelled.is_set():
                    self._fail(request, RequestCancelled(f"request {head.request_id} was cancelled"))
                    continue
                if id(head) not in drained:  # once per submitted request, whichever of its waves runs
                    drained.add(id(head))
                    asked = head.channel.take_branch_cancellations()
                    if asked:
                        head.pending_stop |= asked & {b for r in self._running if r.head is head for b in r.active}
                if head.pending_stop and not self._stop_branches(request):
                    self._member_done(request)
            except Exception as error:
                self._fail(request, error)
        self._running = [r for r in self._running if r.active and not r.head.channel.finished]

    # -- admission ------------------------------------------------------------------------------
    def _admit(self) -> list[Request]:
        """Advance the requests whose long prompts are being prefilled in chunks, then start waiting
        requests, while the step's prefill budget (``max_prefill_tokens``) and the batch's rows last.
        The first prefill of a step always runs, so no prompt waits forever.

        Prompts that fit the budget whole are gathered into a pack and prefilled in one forward
        (``packed_prefill``), as long as none shares an uncached prefix with an earlier one in the
        pack: such a prompt waits for the pack to be prefilled and cached, then reuses it. When rows
        are decoding (``mixed_prefill``), the pack is returned instead, for the decode forward to
        prefill it; otherwise the returned list is empty."""
        config = self.config
        budget = config.max_prefill_tokens
        for request in list(self._prefilling):
            if budget <= 0:
                return []
            budget -= self._prefill_more(request, budget)
        pack: list[Request] = []
        try:
            self._admit_waiting(budget, pack)
        except BaseException as error:  # the pack's requests are in no list the step's handler fails
            failed, pack[:] = list(pack), []
            for request in failed:
                self._fail(request, _as_failure(error))
            raise
        if pack and self._mixes(pack):
            self._pack_in_flight = pack
            return pack
        self._prefill_pack(pack)
        return []

    def _mixes(self, pack: list[Request]) -> bool:
        """Whether this step's decode forward prefills ``pack``: rows decode on the shared-prefix path."""
        return (self.config.mixed_prefill and self._mixes_prompts and all(r.shared_prefix for r in pack)
                and any(r.shared for r in self._running))

    def _admit_waiting(self, budget: int, pack: list[Request]) -> None:
        """Admit waiting requests within ``budget`` prompt tokens and the batch's rows. Prompts that
        may be packed are gathered in ``pack`` (the caller prefills what is left in it)."""
        config = self.config
        packing = (config.packed_prefill or config.mixed_prefill) and self.prefiller.packs_prompts()
        while budget > 0:
            with self._cv:
                if not self._waiting:
                    return
                request = self._waiting[0]
                rows = self.num_running_rows + sum(r.n for r in [*self._prefilling, *pack])
                limit = config.max_batch_rows if self._rows_cap is None else min(config.max_batch_rows, self._rows_cap)
                if (self._running or self._prefilling or pack) and rows + request.n > limit:
                    return
                if budget < config.max_prefill_tokens and len(request.prompt_ids) > budget:
                    return  # not this step: its prompt would overrun what is left of the budget
                self._waiting.popleft()
            try:
                request.shared_prefix = self.runner.decodes_with_shared_prefix()  # may refuse (forced but unsupported)
            except Exception as error:  # this request fails, nothing counted; the others go on
                self._fail(request, error)
                continue
            request.admissions += 1
            if request.admissions == 1:
                self.counters.count("requests")
            if packing and request.segments is None:
                cached = self.prefiller.cached_prefix_length(request.prompt_ids)
                if pack and _shares_uncached_prefix(request.prompt_ids, cached, pack):
                    self._prefill_pack_before(request, pack)
                    cached = self.prefiller.cached_prefix_length(request.prompt_ids)  # the pack is cached now
                new_tokens = len(request.prompt_ids) - cached
                if new_tokens <= budget:
                    pack.append(request)
                    budget -= max(1, new_tokens)
                    continue
            self._prefill_pack_before(request, pack)
            request.prefill = self.prefiller.prefill_steps(request.prompt_ids, self._next_pass_tokens,
                                                           request.segments)
            self._prefilling.append(request)
            budget -= self._prefill_more(request, budget)

    def _prefill_pack_before(self, request: Request, pack: list[Request]) -> None:
        """Prefill and empty ``pack`` before admitting ``request``, which is in no list yet: an
        interrupt on the way fails it too, or its caller would wait forever."""
        flushing, pack[:] = list(pack), []
        try:
            self._prefill_pack(flushing)
        except BaseException as error:
            self._fail(request, _as_failure(error))
            raise

    def _prefill_pack(self, pack: list[Request]) -> None:
        """Prefill the gathered prompts: one forward for two or more, the usual path for one. If the
        packed forward fails, each prompt takes the usual path, and its own failure is its own."""
        if len(pack) <= 1 or not self.config.packed_prefill:
            self._prefill_each(pack)
            return
        try:
            prefilled = self.prefiller.prefill_packed([r.prompt_ids for r in pack], self.config.max_prefill_tokens)
        except Exception:  # noqa: BLE001 - an optimisation: the usual path decides each request's fate
            logger.warning("packed prefill of %d prompts failed; prefilling them one by one", len(pack),
                           exc_info=True)
            self.counters.count("packed_prefill_fallbacks")
            self._prefill_each(pack)
            return
        except BaseException as error:
            for request in pack:
                self._fail(request, _as_failure(error))
            raise
        self._start_prefilled(pack, prefilled)

    def _start_prefilled(self, pack: list[Request], prefilled: list[Prefilled]) -> None:
        """Start each request of ``pack`` from its prefilled prompt; a failure is the request's own."""
        for index, (request, result) in enumerate(zip(pack, prefilled)):
            try:
                self._start(request, result)
            except Exception as error:
                if not self._requeue_after_oom(request, error):
                    self._fail(request, error)
            except BaseException as error:  # the pack's later requests are in no list yet: fail them too
                for unstarted in pack[index:]:
                    self._fail(unstarted, _as_failure(error))
                raise

    def _prefill_each(self, requests: list[Request]) -> None:
        """Prefill each of ``requests`` whole, in a forward of its own (the usual path)."""
        for request in requests:  # all listed first: a BaseException in one leaves the rest to the step's handler
            request.prefill = self.prefiller.prefill_steps(request.prompt_ids, None)
            self._prefilling.append(request)
        for request in requests:
            self._prefill_more(request, len(request.prompt_ids))

    def _next_pass_tokens(self) -> int:
        return self._pass_tokens

    def _prefill_more(self, request: Request, budget: int) -> int:
        """Run ``request``'s next prefill pass, of at most ``budget`` new tokens (what is left of the
        step's ``max_prefill_tokens``); when the prompt is done, fan it out to its branches and take
        their first tokens. Returns the tokens computed.

        Out of memory in a pass, while other requests hold memory, puts the request back at the
        head of the queue (its prefix unlocked, nothing of it kept) until one of them finishes;
        alone, nothing else could make room, so it fails."""
        self._prefilling.remove(request)
        self._pass_tokens = budget
        try:
            computed = next(request.prefill)
        except StopIteration as done:
            request.prefill = None
            try:
                self._start(request, done.value)
            except Exception as error:
                if not self._requeue_after_oom(request, error):
                    self._fail(request, error)
            except BaseException as error:
                self._fail(request, _as_failure(error))
                raise
            last_pass = len(request.prompt_ids) - request.num_cached_tokens - request.prefill_done
            request.prefill_done = 0
            return max(1, last_pass)
        except Exception as error:
            request.prefill = None
            if not self._requeue_after_oom(request, error):
                self._fail(request, error)
            return budget
        except BaseException as error:  # in neither list now: fail it here, or its caller waits forever
            request.prefill = None
            self._fail(request, _as_failure(error))
            raise
        request.prefill_done += computed
        self._prefilling.append(request)  # more passes to go, in later steps
        return computed

    def _requeue_after_oom(self, request: Request, error: BaseException) -> bool:
        """Put a request whose prefill ran out of memory back at the head of the queue, when other
        requests hold memory that their finishing will free. Returns whether it did."""
        if not _is_oom(error) or not (self._running or self._prefilling):
            return False
        self._preempt(request)
        request.prefill_done = 0
        self._rows_cap = self.num_running_rows
        return True

    @torch.inference_mode()
    def _start(self, request: Request, prefilled: Any) -> None:
        """Fan the prefilled prompt out to the ``n`` branches and take their first tokens."""
        request.num_cached_tokens = prefilled.num_cached_tokens
        request.exact, request.asks = prefilled.exact, prefilled.asks
        request.max_new = min(request.params.max_new_tokens, self.runner.context_window - len(request.prompt_ids))
        forks = request.max_branches > request.n
        # On the plain path (the model or this prompt cannot share), later waves copy the batch-1 prompt cache.
        plain = not (request.shared_prefix and SharedPrefixCache.can_share(prefilled.cache))
        template = copy.deepcopy(prefilled.cache) if forks and plain else None
        request.cache = self._decode_cache(prefilled.cache, request.n, request.max_new, request.shared_prefix,
                                           request=request if prefilled.exact else None)
        self._pool(request.cache, request.max_new)
        if forks:
            # Later waves fork off the prompt's KV exactly as the first did: the same segments (read in
            # place, so held once) or a copy of the batch-1 prompt cache, and the same first logits.
            prompt_kv = request.cache.prompt_segments() if request.shared else template
            request.fork = (prompt_kv, prefilled.last_logits.clone())  # a logits processor may edit its input
        request.branches = [Branch(i) for i in range(request.n)]
        for branch in request.branches:
            branch.skip_tokens, branch.emitted_chars = request.delivered.get(branch.index, (0, 0))
        request.active = list(range(request.n))
        if not request.params.greedy:
            request.generators = make_generators(request.seed, request.n, self.runner.device)
        request.live_members = 1
        logits = prefilled.last_logits if request.n == 1 else prefilled.last_logits.expand(request.n, -1)
        if self._advance_or_fail(request, logits):
            self._running.append(request)
        self._running += self._take_spawned()
        self.peak_batch_rows = max(self.peak_batch_rows, self.num_running_rows)
        self.peak_running_kv_bytes = max(self.peak_running_kv_bytes, self.running_kv_bytes())

    def _spawn(self, owner: Request, count: int) -> None:
        """Add ``count`` branches to ``owner``, forked off its prompt, as a wave that decodes from the
        next step on. They take the next indices, so branch ``i`` is seeded ``seed + i`` and draws
        the same tokens as it would have in the first wave."""
        first = len(owner.branches)
        count = min(count, owner.max_branches - first)
        if count <= 0 or owner.fork is None:
            return
        prompt_kv, last_logits = owner.fork
        wave = Request(next(self._ids), owner.prompt_ids, count, owner.params, owner.channel, owner.stream,
                        owner.logits_processor, owner.seed)
        wave.owner = owner
        wave.shared_prefix, wave.max_new, wave.max_branches = owner.shared_prefix, owner.max_new, count
        wave.num_cached_tokens, wave.exact, wave.asks = owner.num_cached_tokens, owner.exact, owner.asks
        wave.num_private_segments = owner.num_private_segments
        if isinstance(prompt_kv, list):
            wave.cache = SharedPrefixCache.from_segments(prompt_kv, count,
                                                         suffix_capacity=self._suffix_capacity(owner.max_new),
                                                         max_copied_tail=self.config.max_copied_prompt_tail)
            self._pool(wave.cache, owner.max_new)
        else:
            wave.cache = copy.deepcopy(prompt_kv)
            repeat_rows(wave.cache, count)
        owner.branches.extend(Branch(first + j) for j in range(count))
        if not owner.params.greedy:
            owner.generators.extend(make_generators(owner.seed + first, count, self.runner.device))
        wave.branches, wave.generators = owner.branches, owner.generators  # shared with the owner
        wave.active = list(range(first, first + count))
        owner.live_members += 1
        self.counters.count("branches_added", count)
        logits = last_logits if count == 1 else last_logits.expand(count, -1)
        if self._advance_or_fail(wave, logits):
            self._spawned.append(wave)

    def _take_spawned(self) -> list[Request]:
        spawned, self._spawned = self._spawned, []
        return [r for r in spawned if r.active and not r.head.channel.finished]

    def _decode_cache(self, cache: Any, n: int, max_new: int, shared_prefix: bool, request: Request | None = None
                      ) -> Any:
        """The cache ``n`` branches decode with: the prompt's KV once with a preallocated suffix per
        branch (``SharedPrefixCache``), or the plain ``DynamicCache`` with its row repeated.

        With ``request`` (an exact prefill), the prompt is read in place from the radix cache, which
        the prefill has just filled: its matched nodes are locked for the request's life and become
        its prefix segments, so a prompt prefix shared by many running requests is held (and read
        per step) once. Only a tail the cache could not hold stays private."""
        if not (shared_prefix and SharedPrefixCache.can_share(cache)):
            repeat_rows(cache, n)
            return cache
        capacity = self._suffix_capacity(max_new)
        in_place = self.prefiller.read_in_place(request.prompt_ids, cache) if request is not None else None
        if in_place is None:
            return SharedPrefixCache.from_dynamic_cache(cache, n, suffix_capacity=capacity)
        request.locked_node = in_place.locked_node
        request.num_private_segments = in_place.num_private_segments
        return SharedPrefixCache.from_segments(in_place.segments, n, suffix_capacity=capacity,
                                               max_copied_tail=self.config.max_copied_prompt_tail)

    def _suffix_capacity(self, max_new: int) -> int:
        """Suffix positions a new cache's own buffers start with: few when the pool will take its
        rows (its buffers are then dropped), else the request's budget (up to a bound)."""
        return 1 if self.suffix_pool is not None else initial_suffix_capacity(max_new)

    def _pool(self, cache: Any, max_new: int) -> None:
        """Move a new decode cache's suffix rows into the pool. Where the pool does not take them (out
        of memory, or a copied prompt tail past its limit), the cache's own buffers get the room
        they were spared (``_suffix_capacity``)."""
        if self.suffix_pool is None or not isinstance(cache, SharedPrefixCache):
            return
        try:
            if self.suffix_pool.adopt(cache):
                return
        except Exception as error:
            if not is_out_of_memory(error):
                raise
        for layer in cache.layers:
            layer.reserve(layer.num_suffix_tokens + initial_suffix_capacity(max_new))

    def _drop_cache(self, request: Request) -> None:
        """Let go of ``request``'s decode cache, its pool slots with it."""
        if self.suffix_pool is not None and request.cache is not None:
            self.suffix_pool.release(request.cache)
        request.cache = None

    def _preempt(self, request: Request) -> None:
        """Take ``request`` out of the batch and put it first in the queue. Its KV is freed; it starts
        over when admitted again and, with the same prompt and seeds, generates the same tokens, of
        which its streams deliver only those they have not delivered yet."""
        self._release(request)
        if request.branches:  # not when its prompt was still being prefilled: nothing new was delivered
            request.delivered = {b.index: (len(b.token_ids) - len(b.pending_ids), b.emitted_chars)
                                 for b in request.branches}
        request.branches, request.active, request.generators, request.next_tokens = [], [], [], None
        self.num_preemptions += 1
        self.counters.count("preemptions")
        with self._cv:
            self._waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        """Drop a request's KV and unlock the radix nodes it read (exactly once). A wave releases
        only its own rows; its owner holds the prompt and the lock for all of them."""
        if request.prefill is not None:  # mid-prefill: closing it unlocks the prefix it matched
            request.prefill.close()
            request.prefill = None
        self._drop_cache(request)
        request.active = []
        if request.owner is not None:
            return
        request.fork = None
        if request.locked_node is not None:
            self.prefiller.unlock(request.locked_node)
            request.locked_node = None

    def _fail(self, request: Request, error: BaseException) -> None:
        """Fail the submitted request ``request`` belongs to, with all its waves, and free their KV.
        Never raises: a failure must not spread to the requests processed after it."""
        head = request.head
        try:
            for member in [r for r in [*self._running, *self._spawned] if r.head is head]:
                self._release(member)
            self._release(head)
        except Exception:
            logger.exception("could not release the KV of request %d", head.request_id)
        head.channel.fail(error)

    # -- decoding -------------------------------------------------------------------------------
    @torch.inference_mode()
    def _decode(self, pack: list[Request] | None = None) -> None:
        """Every running row one token further; ``pack`` (admitted prompts) prefilled in the same
        forward when it can be, else the usual way after it. Either way the pack's requests start
        after the decode and take their next token in the next step."""
        runner = self.runner
        pack = pack or []
        batched = [r for r in self._running if r.shared]
        alone = [r for r in self._running if not r.shared]
        still_running: list[Request] = []
        mixed = self._decode_with_prompts(batched, pack) if batched and pack else None
        prefilled: list[Prefilled] | None = None
        stepped: tuple[torch.Tensor, list[tuple[int, int]]] | None = None  # the rows' logits and ranges
        if mixed is not None:
            logits, row_ranges, prefilled = mixed
            stepped = (logits, row_ranges)
        elif batched:
            try:
                stepped = forward_rows(runner, batched)
            except Exception as error:
                # Out of memory even after evicting and retrying (every cache was rolled back):
                # preempt the newest request, to be recomputed when there is room; the rest go on.
                victim = self._oom_victim(error)
                if victim is None:
                    for request in batched:
                        self._fail(request, error)
                else:
                    self._preempt(victim)
                    still_running += [r for r in batched if r is not victim]
                    self._rows_cap = sum(len(r.active) for r in self._running if r is not victim)
        if stepped is not None:
            logits, row_ranges = stepped
            takes_greedy = [r.params.greedy and r.logits_processor is None for r in batched]
            greedy = greedy_choices(logits, takes_greedy)
            for request, takes, (start, stop) in zip(batched, takes_greedy, row_ranges):
                chosen = (greedy[0][start:stop], greedy[1][start:stop]) if greedy is not None and takes else None
                if self._advance_or_fail(request, logits[start:stop], chosen):
                    still_running.append(request)
        for request in alone:  # a model the shared-prefix path does not support: one forward each
            if request.head.channel.finished or not request.active:
                continue
            try:
                out = runner.decode_forward(request.next_tokens[:, None], request.cache)
            except Exception as error:
                victim = self._oom_victim(error)
                if victim is None:
                    self._fail(request, error)
                else:
                    self._preempt(victim)
                    self._rows_cap = sum(len(r.active) for r in self._running if r is not victim)
                    if victim is not request:
                        still_running.append(request)
                continue
            if self._advance_or_fail(request, out.logits[:, -1, :]):
                still_running.append(request)
        kept = {id(r) for r in still_running}
        self._running = [r for r in self._running if id(r) in kept and r.active and not r.head.channel.finished]
        self._running += self._take_spawned()
        if pack:
            self._pack_in_flight = []
            if prefilled is not None:
                self._start_prefilled(pack, prefilled)
            else:
                self._prefill_pack(pack)

    def _decode_with_prompts(self, batched: list[Request], pack: list[Request]) -> Any:
        """``forward_rows_and_prompts``; None when it failed, with the rows as they were (the caller
        decodes them and prefills the pack the usual way, where each failure is its own). A failure
        other than running out of memory, or a failed first check, stops mixing for good."""
        check = not self._mixed_checked
        try:
            result = forward_rows_and_prompts(self.runner, self.prefiller, batched, [r.prompt_ids for r in pack],
                                              check=check)
        except Exception as error:  # noqa: BLE001 - an optimisation: the usual path decides each request's fate
            self.counters.count("mixed_prefill_fallbacks")
            if not _is_oom(error):
                self._mixes_prompts = False
                self.counters.count("mixed_prefill_disabled")
                logger.warning("prefilling prompts in the decode forward failed; prefilling them apart from now on",
                               exc_info=True)
            return None
        self._mixed_checked = True
        self.counters.count("mixed_prefills")
        return result

    def _oom_victim(self, error: BaseException) -> Request | None:
        """The request to preempt after ``error``: the newest that can start over, when it is out of
        memory and another request would go on; None when the error is to fail its requests."""
        if not _is_oom(error) or len(self._running) < 2:
            return None
        candidates = [r for r in self._running if r.preemptible and r.active]
        return max(candidates, key=lambda r: r.request_id) if candidates else None

    def _advance_or_fail(self, request: Request, logits: torch.Tensor,
                         chosen: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """``_advance``, but an error (a failing logits processor or monitor, say) fails this request
        alone; only a ``KeyboardInterrupt`` on the main thread stops the step (module docstring)."""
        if request.head.channel.finished or not request.active:  # failed earlier in this step
            return False
        try:
            return self._advance(request, logits, chosen)
        except KeyboardInterrupt as error:
            if threading.current_thread() is threading.main_thread():
                raise  # the user's Ctrl-C, wherever the main thread was: it stops the step (module docstring)
            self._fail(request, _as_failure(error))  # no signal reaches this thread: the hook raised it
            return False
        except BaseException as error:  # noqa: BLE001 - a request's own hook fails that request alone
            self._fail(request, _as_failure(error))
            return False

    def _advance(self, request: Request, logits: torch.Tensor,
                 chosen: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """Sample the next token of each active row of ``request`` from ``logits`` (rows, V), record
        it, stream it, let the monitor react, retire finished and stopped branches. Returns whether
        the request (this wave, for an added one) still has rows. ``chosen``, given only to a greedy
        request without a logits processor, is its rows' tokens and log-probabilities, picked for the
        whole batch at once (``greedy_choices``)."""
        params, head = request.params, request.head
        if request.logits_processor is not None:
            logits = request.logits_processor([request.branches[b].token_ids for b in request.active], logits)
        if chosen is not None:
            tokens, logprobs = chosen
        else:
            generators = [request.generators[b] for b in request.active] if request.generators else []
            tokens, logprobs = choose_next_tokens(logits, params, generators)
        token_list, logprob_list = tokens.tolist(), logprobs.tolist()
        for row, b in enumerate(request.active):
            append_token(request.branches[b], token_list[row], logprob_list[row], params, request.max_new,
                         self.runner.eos_token_ids, self.tokenizer)
        self.counters.count("decode_tokens", len(request.active))
        if head.monitor is not None:
            events = [BranchEvent(b, token_list[row], logprob_list[row], len(request.branches[b].token_ids),
                                  request.branches[b].text,
                                  completion(request, request.branches[b])
                                  if request.branches[b].finish_reason is not None else None)
                      for row, b in enumerate(request.active)]
            control = head.monitor.observe(events)
            if control is not None:
                running = {b for r in [*self._running, *self._spawned, request] if r.head is head for b in r.active}
                head.pending_stop |= set(control.stop) & running
                if control.add:
                    self._spawn(head, int(control.add))
        if request.stream:
            for b in request.active:  # a branch stopped by the monitor ends in _stop_branches
                if request.branches[b].finish_reason is not None or b not in head.pending_stop:
                    emit(request, request.branches[b])
        request.next_tokens = tokens
        if not self._stop_branches(request):
            self._member_done(request)
            return False
        return True

    def _stop_branches(self, request: Request) -> bool:
        """Retire ``request``'s finished rows, and end (``"cancelled"``) those its owner was asked to
        stop; its cache keeps only the rows that go on. Returns whether any row is left."""
        head = request.head
        keep_rows = []
        for row, b in enumerate(request.active):
            branch = request.branches[b]
            if branch.finish_reason is None and b in head.pending_stop:
                branch.finish_reason = "cancelled"
                head.branches_stopped = True
                self.counters.count("branches_cancelled")
                if request.stream:
                    emit(request, branch)
            if branch.finish_reason is None:
                keep_rows.append(row)
        head.pending_stop -= set(request.active)
        if not keep_rows:
            request.active = []
            return False
        if len(keep_rows) < len(request.active):
            index = torch.tensor(keep_rows, device=self.runner.device)
            select_rows(request.cache, index)
            if request.next_tokens is not None and request.next_tokens.shape[0] == len(request.active):
                request.next_tokens = request.next_tokens[index]
            request.active = [request.active[r] for r in keep_rows]
        return True

    def _member_done(self, request: Request) -> None:
        """``request`` (the submitted request or one of its waves) has no rows left: free its rows' KV
        and, once no wave of the submitted request is left, finish it."""
        head = request.head
        head.live_members -= 1
        if request is not head or head.live_members > 0:
            self._drop_cache(request)  # the prompt lives on in the owner's fork for the other waves
        if head.live_members > 0:
            return
        self._finish(head)

    def _finish(self, request: Request) -> None:
        self._rows_cap = None  # rows have freed up: admit up to the configured batch again
        if request.n == 1 and request.exact and len(request.branches) == 1 and request.cache is not None:
            # approximate (ASKS) KV never enters the exact cache
            try:
                self.prefiller.cache_generated(request.prompt_ids, request.branches[0].token_ids, request.cache)
            except Exception:  # caching is an optimisation: the request's answer stands without it
                logger.exception("could not cache the KV of request %d's answer", request.request_id)
        self._release(request)
        completions = [completion(request, b) for b in request.branches]
        self.runner.request_finished()
        try:
            self.publish_stats()  # before the caller wakes, so its stats() sees this request
        except Exception:
            logger.exception("could not publish the engine's stats")
        request.channel.finish(completions)


def _shares_uncached_prefix(prompt_ids: list[int], cached: int, pack: list[Request]) -> bool:
    """Whether ``prompt_ids`` begins with more of a packed prompt than the ``cached`` tokens the radix
    cache holds of it: prefilled in the same pack, it would compute that shared part again instead
    of reusing it. (The cache never serves a prompt's last token, so neither would the pack.)"""
    return any(common_prefix_length(prompt_ids, other.prompt_ids, limit=len(prompt_ids) - 1) > cached
               for other in pack)


def _as_failure(error: BaseException) -> BaseException:
    """The error a failed request's caller receives: ``error`` itself, or, for a ``BaseException``
    that is not an ``Exception`` (``SystemExit`` from a hook), a ``RuntimeError`` caused by it, so a
    caller's ``result()`` does not exit its thread."""
    if isinstance(error, Exception):
        return error
    failure = RuntimeError(f"the scheduler step was interrupted by {type(error).__name__}: {error}")
    failure.__cause__ = error
    return failure


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, ForwardOutOfMemoryError) or is_out_of_memory(error)
