"""Admission: which waiting requests a step starts, and how their prompts are prefilled.

Each step, waiting requests are admitted in order while the batch has rows left
(``scheduler.max_batch_rows``, or fewer after a preemption) and the step's prefill budget
(``scheduler.max_prefill_tokens``) is not spent. The first prefill of a step always runs, so no
prompt waits forever. A prompt is prefilled one of four ways:

* **in passes**: a prompt longer than what is left of the budget is prefilled a pass a step, each
  the size of what the step has left, while the running requests decode between them;
* **whole**, in a forward of its own;
* **packed**: prompts that fit the budget whole are gathered (``RequestStatus.PACKED``) and
  prefilled together in one forward (``packed_prefill``), as long as none shares an uncached
  prefix with an earlier one in the pack (such a prompt waits for the pack to be prefilled and
  cached, then reuses it);
* **mixed**: when rows are decoding (``mixed_prefill``), the pack is prefilled in the decode's own
  forward (``batch_forward.forward_rows_and_prompts``).

A prompt that runs out of memory while other requests hold memory goes back to the head of the
queue until one of them finishes; alone, nothing could make room, so it fails.

Callers hold the engine lock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from ..config import SchedulerConfig
from ..kvcache.prefix_match import common_prefix_length
from .batch_forward import forward_rows_and_prompts
from .model_runner import ModelRunner, ran_out_of_memory
from .prefill import Prefiller
from .prefix_access import Prefilled
from .registry import RequestRegistry
from .request import PrefillProgress, Request, RequestStatus
from .stats import Counters

logger = logging.getLogger(__name__)

WAITING, ADMITTED, PACKED, PREFILLING = (RequestStatus.WAITING, RequestStatus.ADMITTED, RequestStatus.PACKED,
                                         RequestStatus.PREFILLING)


class AdmissionHost(Protocol):
    """What admission needs from the scheduler it serves."""

    def start(self, request: Request, prefilled: Prefilled) -> None:
        """Fan ``request``'s prefilled prompt out to its branches and take their first tokens."""

    def fail(self, request: Request, error: BaseException) -> None:
        """Fail ``request`` and free what it holds."""

    def preempt(self, request: Request) -> None:
        """Free what ``request`` holds and put it back at the head of the queue."""


class Admission:
    """Admits waiting requests and prefills their prompts (see the module docstring).

    Args:
        config: Batch rows, the prefill budget, packed and mixed prefill (``config`` may be reassigned).
        runner: Runs the forwards; probes whether branches decode through the shared prefix.
        prefiller: Prefills prompts through the radix cache.
        requests: The scheduler's registry, through which every request changes status.
        counters: The engine's counters.
        host: The scheduler: starts, fails and preempts requests.

    Attributes:
        rows_cap: Set by a preemption: the rows that last fitted, which admission respects until a
            request finishes (else the preempted request would be re-admitted into the same shortage).
    """

    def __init__(self, config: SchedulerConfig, runner: ModelRunner, prefiller: Prefiller,
                 requests: RequestRegistry, counters: Counters, host: AdmissionHost) -> None:
        self.config, self.runner, self.prefiller = config, runner, prefiller
        self.requests, self.counters, self.host = requests, counters, host
        self.rows_cap: int | None = None
        self._mixes_prompts = True  # False once a mixed step failed its check or any non-OOM failure
        self._mixed_checked = False

    def admit(self) -> list[Request]:
        """Advance the prompts being prefilled in passes, then admit waiting requests, within the
        step's budget and rows. Returns this step's pack when the decode forward is to prefill it
        (``mixed_prefill``); otherwise the pack is prefilled here, and the list is empty."""
        budget = self.config.max_prefill_tokens
        for request in self.requests.of(PREFILLING):
            if budget <= 0:
                return []
            budget -= self._prefill_pass(request, budget)
        self._admit_waiting(budget)
        pack = self.requests.of(PACKED)
        if pack and self._mixes(pack):
            return pack
        self.prefill_pack(pack)
        return []

    def _mixes(self, pack: list[Request]) -> bool:
        """Whether this step's decode forward prefills ``pack``: rows decode on the shared-prefix path."""
        return (self.config.mixed_prefill and self._mixes_prompts and all(r.shared_prefix for r in pack)
                and any(r.shared for r in self.requests.decoding()))

    def _admit_waiting(self, budget: int) -> None:
        """Admit waiting requests within ``budget`` prompt tokens and the batch's rows. Prompts that
        may be packed become ``PACKED`` (the caller prefills the pack); the others start their passes."""
        config, requests = self.config, self.requests
        packing = (config.packed_prefill or config.mixed_prefill) and self.prefiller.packing.packs_prompts()
        while budget > 0:
            request = requests.first(WAITING)
            if request is None:
                return
            pending = [*requests.of(PREFILLING), *requests.of(PACKED)]
            rows = requests.running_rows() + sum(r.n for r in pending)
            limit = config.max_batch_rows if self.rows_cap is None else min(config.max_batch_rows, self.rows_cap)
            if (requests.decoding() or pending) and rows + request.n > limit:
                return
            if budget < config.max_prefill_tokens and len(request.prompt_ids) > budget:
                return  # not this step: its prompt would overrun what is left of the budget
            requests.move(request, ADMITTED)
            try:
                request.layout = self.runner.decode_layout()  # may refuse (forced but unsupported)
            except Exception as error:  # this request fails, nothing counted; the others go on
                self.host.fail(request, error)
                continue
            request.replay.admissions += 1
            if request.replay.admissions == 1:
                self.counters.count("requests")
            if packing and request.context_spans is None:
                cached = self.prefiller.cached_prefix_length(request.prompt_ids)
                pack = requests.of(PACKED)
                if pack and worth_splitting_pack(request.prompt_ids, cached, pack,
                                                 requests.of(WAITING, MIN_SAVED_TOKENS_TO_SPLIT_PACK)):
                    self.prefill_pack(pack)
                    cached = self.prefiller.cached_prefix_length(request.prompt_ids)  # the pack is cached now
                new_tokens = len(request.prompt_ids) - cached
                if new_tokens <= budget:
                    requests.move(request, PACKED)
                    budget -= max(1, new_tokens)
                    continue
            self.prefill_pack(requests.of(PACKED))
            request.prefill = PrefillProgress(self.prefiller.prefill_steps(request.prompt_ids, budget,
                                                                           request.context_spans))
            requests.move(request, PREFILLING)
            budget -= self._prefill_pass(request, budget)

    def prefill_pack(self, pack: list[Request]) -> None:
        """Prefill the gathered prompts: one forward for two or more, the usual path for one. If the
        packed forward fails, each prompt takes the usual path, and its own failure is its own."""
        if len(pack) <= 1 or not self.config.packed_prefill:
            self._prefill_each(pack)
            return
        try:
            prefilled = self.prefiller.packing.prefill_packed([r.prompt_ids for r in pack],
                                                              self.config.max_prefill_tokens)
        except Exception:  # noqa: BLE001 - an optimisation: the usual path decides each request's fate
            logger.warning("packed prefill of %d prompts failed; prefilling them one by one", len(pack),
                           exc_info=True)
            self.counters.count("packed_prefill_fallbacks")
            self._prefill_each(pack)
            return
        self.start_prefilled(pack, prefilled)

    def start_prefilled(self, pack: list[Request], prefilled: list[Prefilled]) -> None:
        """Start each request of ``pack`` from its prefilled prompt; a failure is the request's own."""
        for request, result in zip(pack, prefilled):
            self._start(request, result)

    def _prefill_each(self, requests: list[Request]) -> None:
        """Prefill each of ``requests`` whole, in a forward of its own (the usual path)."""
        for request in requests:
            request.prefill = PrefillProgress(self.prefiller.prefill_steps(request.prompt_ids, None))
            self.requests.move(request, PREFILLING)
        for request in requests:
            self._prefill_pass(request, len(request.prompt_ids))

    def _prefill_pass(self, request: Request, budget: int) -> int:
        """Run ``request``'s next prefill pass, of at most ``budget`` new tokens (what is left of the
        step's ``max_prefill_tokens``); when the prompt is done, start its branches. Returns the
        tokens computed (``budget`` when the pass failed)."""
        progress = request.prefill
        try:
            # The first pass's size went in with the prefill; each later one is sent back to it.
            computed = progress.passes.send(budget) if progress.computed_tokens else next(progress.passes)
        except StopIteration as done:
            request.prefill = None
            self._start(request, done.value)
            return max(1, len(request.prompt_ids) - done.value.num_cached_tokens - progress.computed_tokens)
        except Exception as error:
            request.prefill = None
            if not self._requeue_after_oom(request, error):
                self.host.fail(request, error)
            return budget
        progress.computed_tokens += computed
        self.requests.move(request, PREFILLING)  # more passes to go, in later steps, after the others'
        return computed

    def _start(self, request: Request, prefilled: Prefilled) -> None:
        try:
            self.host.start(request, prefilled)
        except Exception as error:
            if not self._requeue_after_oom(request, error):
                self.host.fail(request, error)

    def _requeue_after_oom(self, request: Request, error: BaseException) -> bool:
        """Put a request whose prefill (or start) ran out of memory back at the head of the queue,
        when other requests hold memory that their finishing will free. Returns whether it did."""
        others = [r for r in [*self.requests.decoding(), *self.requests.of(PREFILLING)] if r is not request]
        if not ran_out_of_memory(error) or not others:
            return False
        self.host.preempt(request)
        self.rows_cap = self.requests.running_rows()
        return True

    # -- prompts prefilled in the decode's forward (mixed prefill) ------------------------------
    def forward_with_pack(self, batched: list[Request], pack: list[Request]
                          ) -> tuple[torch.Tensor, list[tuple[int, int]], list[Prefilled]] | None:
        """``forward_rows_and_prompts``: the decode of ``batched`` and the prefill of ``pack`` in one
        forward; None when it failed, with the rows as they were (the caller decodes them and
        prefills the pack the usual way, where each failure is its own). A failure other than
        running out of memory, or a failed first check, stops mixing for good."""
        check = not self._mixed_checked
        try:
            result = forward_rows_and_prompts(self.runner, self.prefiller, batched, [r.prompt_ids for r in pack],
                                              check=check)
        except Exception as error:  # noqa: BLE001 - an optimisation: the usual path decides each request's fate
            self.counters.count("mixed_prefill_fallbacks")
            if not ran_out_of_memory(error):
                self._mixes_prompts = False
                self.counters.count("mixed_prefill_disabled")
                logger.warning("prefilling prompts in the decode forward failed; prefilling them apart from now on",
                               exc_info=True)
            return None
        self._mixed_checked = True
        self.counters.count("mixed_prefills")
        return result


# A forward of its own for part of a pack pays for itself only when it saves about this many prompt
# tokens: a forward's fixed cost outweighs computing a few shared tokens again (a chat template's
# opening shared by two requests, say), not the same opening shared by a queue of them.
MIN_SAVED_TOKENS_TO_SPLIT_PACK = 64


def worth_splitting_pack(prompt_ids: list[int], cached: int, pack: Sequence[Request],
                         waiting: Sequence[Request]) -> bool:
    """Whether to prefill ``pack`` before admitting ``prompt_ids``, so that it reuses what it shares
    with a packed prompt beyond the ``cached`` tokens the radix cache holds of it: worth it when
    that shared part, counted once for this prompt and once for each ``waiting`` prompt that begins
    with it too, comes to ``MIN_SAVED_TOKENS_TO_SPLIT_PACK`` tokens (each sharer adds a token or
    more, so the head of the queue that long is enough to look at). (The cache never serves a
    prompt's last token, so neither would the pack.)"""
    limit = len(prompt_ids) - 1
    reach = max((common_prefix_length(prompt_ids, other.prompt_ids, limit=limit) for other in pack), default=0)
    shared = reach - cached
    if shared <= 0:
        return False
    saved = shared
    for other in waiting:
        if saved >= MIN_SAVED_TOKENS_TO_SPLIT_PACK:
            break
        if common_prefix_length(prompt_ids, other.prompt_ids, limit=reach) == reach:
            saved += shared
    return saved >= MIN_SAVED_TOKENS_TO_SPLIT_PACK
