"""The KV a request holds while it runs: its decode cache, built from its prefilled prompt (or, for
a wave of added branches, forked off its owner's prompt), and the radix lock on the prompt it reads
in place; all of it let go of, once, when the request stops running.

Callers hold the engine lock.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from transformers.cache_utils import Cache

from ..config import SchedulerConfig
from ..kvcache.cache_layers import repeat_rows
from ..kvcache.kv_bytes import held_kv_bytes
from ..kvcache.memory import is_out_of_memory
from ..kvcache.shared_prefix import SharedPrefixCache, initial_suffix_capacity
from ..kvcache.static_rows import StaticRowPool, StaticRows
from ..kvcache.suffix_pool import SuffixPool
from .model_runner import DecodeLayout
from .prefix_access import PrefixAccess
from .request import PromptFork, Request


class RequestKV:
    """Builds and frees the KV of running requests (see the module docstring).

    Args:
        access: The radix cache's door (prompts read in place, and their locks).
        config: Suffix pooling and the prompt tail a cache copies (``config`` may be reassigned).

    Attributes:
        suffix_pool: The running requests' generated tokens, in slots of one buffer per layer (None
            when ``max_pooled_suffix_tokens`` is 0).
        static_pool: The rows of the requests that decode as static rows (``DecodeLayout.STATIC_ROWS``).
    """

    def __init__(self, access: PrefixAccess, config: SchedulerConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.access = access
        self.config = config
        self.suffix_pool = SuffixPool(config.max_pooled_suffix_tokens) if config.max_pooled_suffix_tokens else None
        # Every running row's whole KV, for requests that decode as static rows (made on first use).
        self.static_pool = StaticRowPool(device, dtype)

    def decode_cache(self, cache: Cache, n: int, max_new: int, layout: DecodeLayout, request: Request | None = None
                     ) -> Cache | StaticRows:
        """The cache ``n`` branches decode with: ``n`` rows of the static pool, each with the prompt
        copied in (``DecodeLayout.STATIC_ROWS``); the prompt's KV once with a preallocated suffix
        per branch (``SharedPrefixCache``); or the plain ``DynamicCache`` with its row repeated.

        With ``request`` (an exact prefill), the prompt is read in place from the radix cache, which
        the prefill has just filled: its matched nodes are locked for the request's life and become
        its prefix segments, so a prompt prefix shared by many running requests is held (and read
        per step) once. Only a tail the cache could not hold stays private."""
        if layout is DecodeLayout.STATIC_ROWS:
            return self.static_rows(cache, n, max_new)
        if not (layout is DecodeLayout.SHARED_PREFIX and SharedPrefixCache.can_share(cache)):
            repeat_rows(cache, n)
            return cache
        capacity = self._suffix_capacity(max_new)
        in_place = self.access.read_in_place(request.prompt_ids, cache) if request is not None else None
        if in_place is None:
            decode_cache = SharedPrefixCache.from_dynamic_cache(cache, n, suffix_capacity=capacity)
        else:
            request.locked_node = in_place.locked_node
            request.num_private_segments = in_place.num_private_segments
            decode_cache = SharedPrefixCache.from_segments(in_place.segments, n, suffix_capacity=capacity,
                                                           max_copied_tail=self.config.max_copied_prompt_tail)
        self._pool(decode_cache, max_new)
        return decode_cache

    def static_rows(self, prompt: Cache, n: int, max_new: int) -> StaticRows:
        """``n`` rows of the static pool, each holding the batch-1 ``prompt``'s KV. Room is made for
        the prompt and a first stretch of tokens; the pool grows as rows need more (``make_room``)."""
        pool = self.static_pool
        kv = [(layer.keys, layer.values) for layer in prompt.layers]
        length = int(kv[0][0].shape[2])
        pool.reserve(pool.top + n, length + min(max_new, initial_suffix_capacity(max_new)) + 1,
                     [(k.shape[1], k.shape[3]) for k, _ in kv])
        rows = pool.rows(n)
        pool.write_prompt(rows.slots, kv)
        return rows

    def make_room(self, width: int = 1) -> None:
        """Before a static-rows step: room for ``width`` more tokens in every row (a drafted step
        writes its draft's positions too), and no holes below the highest row
        (``StaticRowPool.compact``), so the step runs no row that is not decoding."""
        pool = self.static_pool
        pool.compact()
        needed = pool.max_length() + width
        if needed > pool.capacity:
            pool.reserve(pool.top, max(needed, 2 * pool.capacity))

    def fork_cache(self, fork: PromptFork, count: int, max_new: int, static: bool = False) -> Cache | StaticRows:
        """A cache for ``count`` added branches off the prompt's KV as the first wave took it."""
        if static:
            return self.static_rows(fork.prompt_kv, count, max_new)
        if isinstance(fork.prompt_kv, list):  # segments: the prompt read in place, held once
            cache = SharedPrefixCache.from_segments(fork.prompt_kv, count, suffix_capacity=self._suffix_capacity(max_new),
                                                    max_copied_tail=self.config.max_copied_prompt_tail)
            self._pool(cache, max_new)
            return cache
        cache = copy.deepcopy(fork.prompt_kv)
        repeat_rows(cache, count)
        return cache

    def _suffix_capacity(self, max_new: int) -> int:
        """Suffix positions a new cache's own buffers start with: few when the pool will take its
        rows (its buffers are then dropped), else the request's budget (up to a bound)."""
        return 1 if self.suffix_pool is not None else initial_suffix_capacity(max_new)

    def _pool(self, cache: SharedPrefixCache, max_new: int) -> None:
        """Move a new decode cache's suffix rows into the pool. Where the pool does not take them (out
        of memory, or a copied prompt tail past its limit), the cache's own buffers get the room
        they were spared (``_suffix_capacity``)."""
        if self.suffix_pool is None:
            return
        try:
            if self.suffix_pool.adopt(cache):
                return
        except Exception as error:
            if not is_out_of_memory(error):
                raise
        for layer in cache.layers:
            layer.reserve(layer.num_suffix_tokens + initial_suffix_capacity(max_new))

    def drop_cache(self, request: Request) -> None:
        """Let go of ``request``'s decode cache, its pool slots with it."""
        if isinstance(request.cache, StaticRows):
            request.cache.release()
        elif self.suffix_pool is not None and request.cache is not None:
            self.suffix_pool.release(request.cache)
        request.cache = None

    def release(self, request: Request) -> None:
        """Drop a request's KV and unlock the radix nodes it read (exactly once; again is a no-op). A
        wave releases only its own rows; its owner holds the prompt and the lock for all of them."""
        if request.prefill is not None:  # mid-prefill: closing it unlocks the prefix it matched
            passes, request.prefill = request.prefill.passes, None
            passes.close()
        self.drop_cache(request)
        request.active = []
        if request.owner is not None:
            return
        request.branching.fork = None
        if request.locked_node is not None:
            node, request.locked_node = request.locked_node, None
            self.access.unlock(node)

    def held_bytes(self, requests: Iterable[Request]) -> int:
        """Bytes of KV ``requests`` hold outside the prefix cache (each tensor counted once, however
        many requests or rows share it); segments read in place from the radix cache are the cache's.
        The static pool counts whole while a request holds rows of it."""
        requests = list(requests)
        static = any(isinstance(r.cache, StaticRows) for r in requests)
        return (held_kv_bytes((r.cache, None if r.head.locked_node is None else r.num_private_segments)
                              for r in requests if not isinstance(r.cache, StaticRows))
                + (self.static_pool.nbytes() if static else 0))
