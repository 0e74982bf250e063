"""Out-of-memory recovery for forward passes: roll the request's KV back, free prefix-cache memory,
shrink the cache budget, and retry with backoff (``tenacity``); a pass that still does not fit ends
in ``ForwardOutOfMemoryError``.

Out of memory means ``is_out_of_memory``: ``torch.OutOfMemoryError``, ``MemoryError``, or the plain
``RuntimeError`` torch raises when the CPU allocator fails ("DefaultCPUAllocator: can't allocate memory").

Before anything runs, ``available_memory_bytes`` says how much a new allocation on a device can
still get, so that a request certain not to fit is refused up front.

Promises:
    * A failed try leaves the request's ``transformers`` cache exactly as it was before the try:
      layers that had already appended the new positions' KV are cropped back, so a retry never sees
      a position twice and a final failure leaves the caller's cache usable.
    * ``on_oom`` runs between tries (never after the last), so a retry count is the number of times
      memory was freed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
)

from .cache_layers import has_recurrent_state

T = TypeVar("T")

# torch.OutOfMemoryError is CUDA/MPS/XPU running out; MemoryError is the host allocator.
OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, MemoryError)
# A failed host allocation inside a torch op is a plain RuntimeError ("[enforce fail at
# alloc_cpu.cpp:...] ... DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes");
# MPS on older torch raises "MPS backend out of memory" the same way.
OOM_MESSAGES: tuple[str, ...] = ("can't allocate memory", "MPS backend out of memory")


class ForwardOutOfMemoryError(RuntimeError):
    """A forward pass ran out of memory on every try, after the prefix cache was shrunk between tries."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure that freeing memory could cure: one of
    ``OOM_ERRORS``, or a ``RuntimeError`` whose message says an allocator ran out (``OOM_MESSAGES``)."""
    if isinstance(error, ForwardOutOfMemoryError):
        return False  # already retried (its message may quote the allocator's)
    if isinstance(error, OOM_ERRORS):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in OOM_MESSAGES)


def available_memory_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can get now: on CUDA, what the driver has free plus what
    torch's caching allocator holds unused; elsewhere the host's (Linux's ``MemAvailable``, else
    the physical memory); None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def cache_lengths(cache: Any) -> list[int] | None:
    """Per-layer sequence length of a ``transformers`` cache, or None when it has no such layers."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(layer, "get_seq_length") for layer in layers):
        return None
    return [layer.get_seq_length() for layer in layers]


def roll_back(cache: Any, lengths: list[int] | None) -> None:
    """Crop each layer of ``cache`` back to ``lengths`` (from ``cache_lengths`` before the try).

    A pass that fails mid-way has appended the new positions to the first layers only, so each layer
    is cropped by its own excess (``layer.crop(-excess)``, the ``transformers`` >= 5 convention).

    Raises:
        ForwardOutOfMemoryError: a layer holds new positions but cannot be cropped, or the model
            has recurrent layers (their state cannot be rolled back); retrying would feed those
            positions twice, so the pass is not retried.
    """
    if has_recurrent_state(cache):
        # A recurrent state is overwritten in place by the pass: there is nothing to crop it back to.
        raise ForwardOutOfMemoryError("forward pass ran out of memory in a model with recurrent layers, whose state "
                                      "cannot be rolled back, so the pass is not retried")
    if lengths is None:
        return
    for index, (layer, length) in enumerate(zip(cache.layers, lengths)):
        excess = layer.get_seq_length() - length
        if excess <= 0:
            continue
        if not hasattr(layer, "crop"):
            raise ForwardOutOfMemoryError(
                f"forward pass ran out of memory after layer {index} had cached its new positions, and "
                f"{type(layer).__name__} cannot be cropped back, so the pass is not retried"
            )
        layer.crop(-excess)


def run_with_oom_retry(
    forward: Callable[[], T],
    cache: Any,
    *,
    on_oom: Callable[[BaseException, int], None],
    max_attempts: int,
    backoff_s: float,
) -> T:
    """Run ``forward()``; on an out-of-memory error (``is_out_of_memory``) roll ``cache`` back, call
    ``on_oom(error, attempt)`` and try again, at most ``max_attempts`` tries in all.

    Args:
        forward: The pass; it appends to ``cache``.
        cache: The request's ``transformers`` cache (per-layer ``get_seq_length``/``crop``), or None.
        on_oom: Frees memory between tries (evict, shrink the budget, empty the allocator cache).
        max_attempts: Tries in all, >= 1.
        backoff_s: First wait between tries; doubles each retry (capped at 2 s).

    Raises:
        ForwardOutOfMemoryError: every try ran out of memory (the last error is its ``__cause__``).
    """
    lengths = cache_lengths(cache)

    def attempt() -> T:
        try:
            return forward()
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            try:
                roll_back(cache, lengths)
            except ForwardOutOfMemoryError as unrecoverable:
                raise unrecoverable from error
            raise

    # The first try runs outside tenacity: a step's forward almost never runs out of memory, and
    # setting up the retry machinery costs more than a small model's decode step can spare.
    try:
        return attempt()
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        first = error
    if max_attempts == 1:
        raise _out_of_memory(max_attempts, first) from first
    # Tries 2 and on, numbered as the whole sequence numbers them: ``on_oom`` hears of each failed
    # try before the wait that follows it.
    on_oom(first, 1)
    time.sleep(_backoff(backoff_s, 1))
    retrying = Retrying(
        stop=stop_after_attempt(max_attempts - 1),
        wait=lambda state: _backoff(backoff_s, state.attempt_number + 1),
        retry=retry_if_exception(is_out_of_memory),
        before_sleep=lambda state: on_oom(state.outcome.exception(), state.attempt_number + 1),
        reraise=False,
    )
    try:
        return retrying(attempt)
    except RetryError as error:
        last = error.last_attempt.exception()
        raise _out_of_memory(max_attempts, last) from last


def _backoff(backoff_s: float, failed_try: int) -> float:
    """The wait after try ``failed_try`` failed: ``backoff_s``, doubling each try, at most 2 s (or
    ``backoff_s`` when that is longer)."""
    return min(backoff_s * 2 ** (failed_try - 1), max(backoff_s, 2.0))


def _out_of_memory(max_attempts: int, last: BaseException) -> ForwardOutOfMemoryError:
    return ForwardOutOfMemoryError(
        f"forward pass ran out of memory on all {max_attempts} tries, with the prefix cache evicted and "
        f"its budget shrunk between tries; lower the batch (n), the prompt length or "
        f"rsbcm.cache_budget_mb. Last error: {type(last).__name__}: {last}"
    )
