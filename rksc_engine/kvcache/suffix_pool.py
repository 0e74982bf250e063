"""One buffer per layer for the generated tokens of every running request.

Each request's ``SharedPrefixCache`` keeps its branches' own tokens in suffix buffers of its own, so
a decode step of ``N`` requests wrote the new KV with ``N`` copies a layer and attended to the
suffixes with ``N`` calls a layer: on a CPU, a step's cost grew with the number of requests, not
only with rows. The pool holds every adopted request's suffix rows as consecutive slots of one
tensor per layer, ``(slots, H_kv, capacity, D)``, and the requests' layers hold views of their slots.
A decode step then writes all pooled rows' new KV in one indexed copy a layer, and attends all the
rows of consecutive slots in one call over their keys padded to a common length and masked
(``pooled_suffix_attention``).

Slots are handed out in adoption order, which is the order the scheduler runs its requests in, so a
batch's rows are consecutive slots. A request that ends leaves a hole; holes are reclaimed when the
slots run out, by rebuilding the pool with the living requests packed in the same order. The
capacity is one for all slots: it doubles when a row needs more, up to ``max_tokens``; a request
that outgrows that leaves the pool for buffers of its own, so one long request does not make every
slot long.

Bits: the padded keys are masked, and the padding is a multiple of ``SUFFIX_ALIGNMENT``, so that
with one thread a row's result does not depend on how far the other rows of its call reach. With
several threads PyTorch's fused CPU kernel gives a row bits that depend on which thread takes it,
so there a row's result may differ in the last bits with the batch, as the shared prefix's reads
already may; tokens are what ``benchmarks/batch_invariance.py`` measures.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..config import MIN_POOLED_SUFFIX_TOKENS
from .memory import is_out_of_memory
from .split_attention import fused_cpu_attention, partial_attention

# A pooled suffix call reads its keys padded to a multiple of this (the capacity is one too), so
# that every real key of a row goes through the same vector code of the kernel however long the
# other rows of the call are (measured bit-exact with one thread for lengths 1 to 448).
SUFFIX_ALIGNMENT = MIN_POOLED_SUFFIX_TOKENS


def aligned_length(length: int) -> int:
    """``length`` rounded up to a multiple of ``SUFFIX_ALIGNMENT``."""
    return -(-length // SUFFIX_ALIGNMENT) * SUFFIX_ALIGNMENT


def pooled_suffix_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                            scale: float, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's attention over its own suffix, for rows whose suffixes share one padded tensor.

    Args:
        query: (R, H_kv, G, D), one new token a row (the GQA group's heads as rows).
        keys: (R, H_kv, L, D), ``L`` a multiple of ``SUFFIX_ALIGNMENT``; a row's keys past its
            length are padding.
        values: (R, H_kv, L, D).
        mask: (R, 1, 1, L) float, 0 where a key is the row's and -inf on padding.

    Returns:
        ``(out (R, H_kv, G, D), lse (R, H_kv, G))`` in float32, as ``request_partials`` gives a suffix.
    """
    result = fused_cpu_attention(query, keys, values, scale, mask) if fused else None
    if result is not None:
        return result
    return partial_attention(query, keys, values, scale, torch.isfinite(mask))


def suffix_mask(lengths: list[int], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (R, 1, 1, L) additive mask of rows whose suffixes hold ``lengths`` keys, ``L`` the longest
    rounded up to ``SUFFIX_ALIGNMENT``."""
    padded = aligned_length(max(lengths))
    visible = torch.arange(padded, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    mask = torch.zeros(len(lengths), 1, 1, padded, dtype=dtype, device=device)
    return mask.masked_fill_(~visible[:, None, None, :], float("-inf"))


class SuffixPool:
    """The suffix rows of the requests it adopted, in slots of one tensor per layer.

    A cache the pool adopted holds its suffix in views of the pool's tensors from its first slot
    on (``SharedPrefixCache.attach_pool_slot``; its ``suffix_pool`` is then the pool), so
    everything that reads or writes them in place works as on buffers of its own. The pool hands
    the cache new views whenever it rebuilds, and the cache lets go of them when it leaves
    (``SharedPrefixCache.detach_pool``).

    Args:
        max_tokens: Most suffix tokens a pooled row may hold (the capacity's ceiling); a request
            that needs more is given buffers of its own. At least ``SUFFIX_ALIGNMENT``.
    """

    def __init__(self, max_tokens: int) -> None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise TypeError(f"max_tokens must be an int, got {type(max_tokens).__name__}")
        if max_tokens < SUFFIX_ALIGNMENT:
            raise ValueError(f"max_tokens must be >= {SUFFIX_ALIGNMENT}, got {max_tokens}")
        self.max_tokens = max_tokens
        self.keys: list[torch.Tensor] = []  # per layer (slots, H_kv, capacity, D)
        self.values: list[torch.Tensor] = []
        # The adopted caches in slot order, each with the slots it was given (its rows may since
        # have shrunk, leaving the rest of its slots unused).
        self._members: list[tuple[weakref.ref, int]] = []

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def num_members(self) -> int:
        return len(self._live_members())

    def holds(self, cache: Any) -> bool:
        return getattr(cache, "suffix_pool", None) is self

    def adopt(self, cache: Any) -> bool:
        """Move ``cache``'s suffix rows into slots after the last member's. Returns False, leaving
        the cache as it was, when its layers do not match the pool's or its suffix is longer than
        ``max_tokens`` allows; raises on out of memory with the pool and the cache as they were."""
        if self.holds(cache):
            return True
        layers = cache.layers
        used = layers[0].num_suffix_tokens
        if used + 1 > self.max_tokens:
            return False
        if self.keys and not self._matches(layers):
            return False
        rows = layers[0].keys.shape[0]
        members = self._live_members()
        end = self._end(members)
        if not self.keys or end + rows > self.num_slots or used + 1 > self.capacity:
            # Sized to what lives now (the slots and the capacity may shrink as well as grow).
            self._rebuild(members, doubled_to(1, self._live_rows(members) + rows),
                          doubled_to(SUFFIX_ALIGNMENT, max(used, self._longest(members)) + 1), template=layers)
            members = self._live_members()
            end = self._end(members)
        for index, layer in enumerate(layers):
            # The slots may have held an ended request's KV: a masked position's value still enters
            # the product with weight zero, so a stale inf or NaN there would spoil this request.
            self.keys[index][end:end + rows].zero_()
            self.values[index][end:end + rows].zero_()
            layer.copy_suffix_into(self.keys[index][end:end + rows], self.values[index][end:end + rows])
        self._members.append((weakref.ref(cache), rows))
        self._bind(cache, end, rows)
        return True

    def make_room(self, cache: Any, needed: int) -> None:
        """Give pooled ``cache`` room for ``needed`` suffix tokens a row: the pool is rebuilt longer
        (sized to the rows that live; every member's views are rebound), or, past ``max_tokens`` or
        when the longer pool does not fit in memory, the cache leaves the pool with buffers of its own."""
        if needed <= self.capacity:
            return
        if needed > self.max_tokens:
            self.release(cache, keep_capacity=needed)
            return
        members = self._live_members()
        try:
            self._rebuild(members, doubled_to(1, self._live_rows(members)),
                          doubled_to(SUFFIX_ALIGNMENT, max(needed, self._longest(members) + 1)))
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            # A pool of every slot at the new length does not fit: this request alone takes buffers
            # of its own, which need only its rows at that length.
            self.release(cache, keep_capacity=needed)

    def release(self, cache: Any, keep_capacity: int | None = None) -> None:
        """Take ``cache`` out of the pool; its slots become free. With ``keep_capacity``, its suffix is
        first copied into buffers of its own with room for that many tokens a row (it goes on
        decoding); without, its layers are left without a suffix (it is done)."""
        if not self.holds(cache):
            return
        cache.detach_pool(keep_capacity)
        self._members = [(ref, slots) for ref, slots in self._members if ref() is not cache]
        if not self._live_members():  # idle: give the memory back
            self.keys, self.values = [], []

    # -- internals ------------------------------------------------------------------------------
    def _live_members(self) -> list[tuple[Any, int]]:
        live = [(ref(), slots) for ref, slots in self._members]
        live = [(cache, slots) for cache, slots in live if cache is not None and self.holds(cache)]
        if len(live) != len(self._members):
            self._members = [(weakref.ref(cache), slots) for cache, slots in live]
        return live

    @staticmethod
    def _live_rows(members: list[tuple[Any, int]]) -> int:
        return sum(cache.layers[0].keys.shape[0] for cache, _ in members)

    @staticmethod
    def _longest(members: list[tuple[Any, int]]) -> int:
        return max((cache.layers[0].num_suffix_tokens for cache, _ in members), default=0)

    @staticmethod
    def _end(members: list[tuple[Any, int]]) -> int:
        if not members:
            return 0
        cache, slots = members[-1]
        return cache.pool_slot + slots

    def _matches(self, layers: Any) -> bool:
        return len(layers) == len(self.keys) and all(
            layer.keys.shape[1] == keys.shape[1] and layer.keys.shape[3] == keys.shape[3]
            and layer.keys.dtype == keys.dtype and layer.keys.device == keys.device
            for layer, keys in zip(layers, self.keys))

    def _rebuild(self, members: list[tuple[Any, int]], slots: int, capacity: int, template: Any = None) -> None:
        """New tensors of ``slots`` x ``capacity``, the members packed from slot 0 in their order.
        Everything is allocated before anything moves, so out of memory leaves the pool as it was.
        Zero-filled: padding is masked, but a masked key's value still enters the product with weight
        zero, and uninitialised memory may hold a NaN."""
        like = self.keys or [layer.keys for layer in (template or members[0][0].layers)]
        keys = [torch.zeros(slots, k.shape[1], capacity, k.shape[3], dtype=k.dtype, device=k.device) for k in like]
        values = [torch.zeros_like(k) for k in keys]
        start = 0
        placed = []
        for cache, _ in members:
            rows = cache.layers[0].keys.shape[0]
            for index, layer in enumerate(cache.layers):
                layer.copy_suffix_into(keys[index][start:start + rows], values[index][start:start + rows])
            placed.append((cache, start, rows))
            start += rows
        self.keys, self.values = keys, values
        self._members = [(weakref.ref(cache), rows) for cache, _, rows in placed]
        for cache, slot, rows in placed:
            self._bind(cache, slot, rows)

    def _bind(self, cache: Any, slot: int, rows: int) -> None:
        cache.attach_pool_slot(self, slot, [keys[slot:slot + rows] for keys in self.keys],
                               [values[slot:slot + rows] for values in self.values])


def doubled_to(capacity: int, needed: int) -> int:
    """``capacity`` (at least 1) doubled until it holds ``needed``."""
    capacity = max(capacity, 1)
    while capacity < needed:
        capacity *= 2
    return capacity
