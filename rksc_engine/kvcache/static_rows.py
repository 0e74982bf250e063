"""Static decode rows: each running branch's whole KV in one slot of a preallocated buffer per layer.

The shared-prefix path (``shared_prefix``) reads a prompt once for all the branches and requests
that share it, which is what a memory-bound decode step (a CPU, a large model) wants; but its
attention walks each request's segments, so the host's work per step grows with the requests. Where
the host's work is the step (a GPU with a small or mid-size model, or a compiled step), the
serving engines' layout wins instead: every row's keys and values in a fixed-shape pool, one
attention call per layer over all rows, with masks built once per step. That is this module.

* ``StaticRowPool`` holds, per layer, keys and values of shape ``(slots, H_kv, capacity, D)``. A
  branch takes a slot when its request starts; its prompt's KV is copied in (``write_prompt``), and
  each decode step writes one more position. A slot past the end of a row's tokens holds zeros, so
  a masked position (weight exactly 0) never turns a product into NaN.
* Slots are handed out lowest first, and a step runs the rows ``[0, top)``: ``top`` is one past the
  highest slot in use, so a freed slot below it is a hole the step carries as a masked row until
  ``compact`` moves the highest rows down into the holes.
* ``StaticRowsCache`` is the ``transformers`` cache one forward sees: ``update`` writes each row's
  new keys and values at its own position, in one scatter per layer, and returns the rows' whole
  buffers, cut at ``key_length``; the caller's attention mask hides what a row must not see.

Every shape a step uses depends only on ``top``, ``key_length`` and the pool's sizes, so the step can
be compiled (``torch.compile``) or captured, and its operator count does not grow with the requests.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache

# A slot's capacity grows in steps of this many tokens, so a growing batch reallocates rarely and
# the key lengths a step sees come from a short list (each a shape a compiled step is built for).
CAPACITY_STEP = 256
# A step's keys are cut at the longest row rounded up to a multiple of this: short rows in a pool
# grown for long ones do not pay for the padding, and the lengths a compiled step sees stay few.
KEY_LENGTH_STEP = 64


def round_up(value: int, step: int) -> int:
    return -(-value // step) * step


class StaticRowPool:
    """Slots of per-token KV for the rows that decode, one preallocated buffer per layer.

    Args:
        device: Where the buffers live.
        dtype: Their dtype (the model's).

    The buffers are made on the first ``reserve``, shaped after the KV that first arrives (each
    layer may have its own head count and size).
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.keys: list[torch.Tensor] = []  # per layer (slots, H_kv, capacity, D)
        self.values: list[torch.Tensor] = []
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)  # (slots,) tokens each slot holds
        self._lengths: list[int] = []  # the same on the host, so planning a step never waits on the device
        self._free: list[int] = []  # a heap of free slots below ``top``
        self.top = 0  # one past the highest slot in use
        self.num_used = 0
        self.next_tokens = torch.zeros(0, dtype=torch.long, device=device)  # (slots,) what each row feeds next
        self._owners: dict[int, StaticRows] = {}  # slot -> the rows holding it, renamed by ``compact``

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def capacity(self) -> int:
        """Tokens each slot can hold."""
        return self.keys[0].shape[2] if self.keys else 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def bytes_for(self, num_slots: int, capacity: int, layer_shapes: Sequence[tuple[int, int]]) -> int:
        """Bytes the buffers would take at ``num_slots`` x ``capacity`` for layers of ``(H_kv, D)``."""
        per_token = sum(heads * dim for heads, dim in layer_shapes) * 2 * self.dtype.itemsize
        return num_slots * capacity * per_token

    def layer_shapes(self) -> list[tuple[int, int]]:
        return [(k.shape[1], k.shape[3]) for k in self.keys]

    def reserve(self, num_slots: int, capacity: int, layer_shapes: Sequence[tuple[int, int]] | None = None) -> None:
        """Make room for at least ``num_slots`` slots of ``capacity`` tokens, keeping what is held.

        Slots grow by doubling and capacity in steps of ``CAPACITY_STEP``, so growing one row at
        a time reallocates rarely. ``layer_shapes`` (per layer ``(H_kv, D)``) is needed the first time."""
        if not self.keys:
            if layer_shapes is None:
                raise ValueError("the first reserve needs the layers' shapes")
            shapes = list(layer_shapes)
        else:
            shapes = self.layer_shapes()
            if num_slots <= self.num_slots and capacity <= self.capacity:
                return
        slots = max(self.num_slots, 1)
        while slots < num_slots:
            slots *= 2
        new_capacity = max(self.capacity, round_up(max(capacity, 1), CAPACITY_STEP))
        keys, values = [], []
        for i, (heads, dim) in enumerate(shapes):
            k = torch.zeros(slots, heads, new_capacity, dim, dtype=self.dtype, device=self.device)
            v = torch.zeros_like(k)
            if self.keys:
                old = self.keys[i].shape
                k[:old[0], :, :old[2]] = self.keys[i]
                v[:old[0], :, :old[2]] = self.values[i]
            keys.append(k)
            values.append(v)
        lengths = torch.zeros(slots, dtype=torch.long, device=self.device)
        lengths[:self.lengths.shape[0]] = self.lengths
        next_tokens = torch.zeros(slots, dtype=torch.long, device=self.device)
        next_tokens[:self.next_tokens.shape[0]] = self.next_tokens
        self.keys, self.values, self.lengths, self.next_tokens = keys, values, lengths, next_tokens
        self._lengths += [0] * (slots - len(self._lengths))

    # -- slots ----------------------------------------------------------------------------------
    def rows(self, count: int) -> StaticRows:
        """``count`` rows for one request's branches, in free slots (lowest first; the caller has
        reserved room for them)."""
        rows = StaticRows(self, self.acquire(count))
        for slot in rows.slots:
            self._owners[slot] = rows
        return rows

    def acquire(self, count: int) -> list[int]:
        """``count`` free slots, lowest first (the caller has reserved room for them)."""
        taken = []
        while len(taken) < count and self._free:
            taken.append(heapq.heappop(self._free))
        while len(taken) < count:
            taken.append(self.top)
            self.top += 1
        if self.top > self.num_slots:
            raise RuntimeError(f"the pool has {self.num_slots} slots; reserve {self.top} first")
        self.num_used += count
        return taken

    def release(self, slots: Sequence[int]) -> None:
        """Free ``slots``: their buffers are zeroed (a stale inf or NaN at a masked position would
        spoil the next row's product), and ``top`` drops below the free slots at its end."""
        if not slots:
            return
        index = torch.tensor(list(slots), device=self.device)
        for k, v in zip(self.keys, self.values):
            k.index_fill_(0, index, 0)
            v.index_fill_(0, index, 0)
        self.lengths.index_fill_(0, index, 0)
        for slot in slots:
            self._lengths[slot] = 0
            self._owners.pop(slot, None)
            self._free.append(slot)
        self.num_used -= len(slots)
        self._trim_top()

    def _trim_top(self) -> None:
        free = set(self._free)
        while self.top > 0 and self.top - 1 in free:
            free.discard(self.top - 1)
            self.top -= 1
        self._free = sorted(free)  # sorted is a valid heap

    def write_prompt(self, slots: Sequence[int], layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy one prompt's KV (per layer ``(keys, values)``, each (1, H_kv, P, D)) into each of
        ``slots``, which then hold ``P`` tokens."""
        length = int(layer_kv[0][0].shape[2])
        if length > self.capacity:
            raise ValueError(f"a prompt of {length} tokens does not fit slots of {self.capacity}")
        index = torch.tensor(list(slots), device=self.device)
        for (k, v), pool_k, pool_v in zip(layer_kv, self.keys, self.values):
            rows = len(slots)
            pool_k[index, :, :length] = k.to(self.dtype).expand(rows, -1, -1, -1)
            pool_v[index, :, :length] = v.to(self.dtype).expand(rows, -1, -1, -1)
        self.lengths.index_fill_(0, index, length)
        for slot in slots:
            self._lengths[slot] = length

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def max_length(self) -> int:
        return max(self._lengths[:self.top], default=0)

    def advance(self, live: torch.Tensor, slots: Sequence[int]) -> None:
        """After a step: the rows ``slots`` (whose mask over ``[0, top)`` is ``live``) hold one
        more token each."""
        self.lengths[:self.top] += live
        for slot in slots:
            self._lengths[slot] += 1

    def advance_by(self, slots: Sequence[int], amounts: Sequence[int]) -> None:
        """After a drafted step: slot ``slots[i]`` holds ``amounts[i]`` more tokens (what it wrote
        past them is garbage no mask shows, and the next step writes over it)."""
        for slot, amount in zip(slots, amounts):
            self._lengths[slot] += amount
        self.lengths.index_add_(0, torch.tensor(list(slots), device=self.device),
                                torch.tensor(list(amounts), dtype=self.lengths.dtype, device=self.device))

    def truncate(self, slots: Sequence[int], lengths: Sequence[int]) -> None:
        """Forget what ``slots`` hold past ``lengths`` (a step that failed part-way is undone)."""
        for slot, length in zip(slots, lengths):
            if self._lengths[slot] > length:
                for k, v in zip(self.keys, self.values):
                    k[slot, :, length:] = 0
                    v[slot, :, length:] = 0
                self._lengths[slot] = length
                self.lengths[slot] = length

    def compact(self) -> int:
        """Move the highest rows down into the holes below them, until ``top`` is the number of
        slots in use; each moved row's ``StaticRows`` is renamed in place. Returns the rows moved."""
        moved = 0
        while self._free and self._free[0] < self.top - 1:
            hole, source = heapq.heappop(self._free), self.top - 1  # top - 1 is always in use
            length = self._lengths[source]
            for k, v in zip(self.keys, self.values):
                k[hole, :, :length] = k[source, :, :length]
                v[hole, :, :length] = v[source, :, :length]
                k[source, :, :length] = 0
                v[source, :, :length] = 0
            self.lengths[hole], self.next_tokens[hole] = length, self.next_tokens[source]
            self.lengths[source] = 0
            self._lengths[hole], self._lengths[source] = length, 0
            owner = self._owners.pop(source)
            owner.slots[owner.slots.index(source)] = hole
            self._owners[hole] = owner
            self._free.append(source)
            self._trim_top()
            moved += 1
        return moved

    def key_length(self, width: int = 1) -> int:
        """The key length a step of ``width`` positions a row over ``[0, top)`` attends: the
        longest row after this step's tokens, rounded up to ``KEY_LENGTH_STEP`` (at most the
        capacity)."""
        return min(self.capacity, round_up(self.max_length() + width, KEY_LENGTH_STEP))


class StaticRows:
    """The slots one request's branches decode in: its row ``r`` is slot ``slots[r]`` of ``pool``
    (``compact`` renames them in place)."""

    def __init__(self, pool: StaticRowPool, slots: list[int]) -> None:
        self.pool, self.slots = pool, slots

    @property
    def num_rows(self) -> int:
        return len(self.slots)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only the rows ``rows`` (in that order); the others' slots are freed."""
        kept = [self.slots[r] for r in rows]
        keep = set(kept)
        self.pool.release([s for s in self.slots if s not in keep])
        self.slots = kept

    def batch_select_indices(self, index: torch.Tensor) -> None:
        """``keep`` by a tensor of rows, as ``transformers``' caches take it (``select_rows``)."""
        self.keep(index.tolist())

    def release(self) -> None:
        self.pool.release(self.slots)
        self.slots = []

    def layer_kv(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row ``row``'s tokens' KV, per layer ``(keys, values)`` (1, H_kv, T, D) (views)."""
        slot = self.slots[row]
        length = self.pool.length(slot)
        return [(k[slot:slot + 1, :, :length], v[slot:slot + 1, :, :length])
                for k, v in zip(self.pool.keys, self.pool.values)]


class StaticRowsCache(Cache):
    """The cache one decode forward over a ``StaticRowPool``'s rows ``[0, top)`` sees.

    ``update`` writes row ``i``'s new keys and values at ``positions[i]`` of slot ``i`` and returns
    every row's buffer up to ``key_length``; what a row may attend is the attention mask's business.
    The model's own attention then runs once per layer for all rows.

    Args:
        keys, values: The pool's buffers, per layer (slots, H_kv, capacity, D).
        positions: (top, T) where each row's new tokens go (T is 1 but in a drafted step).
        key_length: Keys each row's buffer is cut at (past every row's new token).
    """

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], positions: torch.Tensor,
                 key_length: int) -> None:
        super().__init__(layers=[])
        self.keys, self.values, self.positions, self.key_length = keys, values, positions, key_length

    def __len__(self) -> int:
        return len(self.keys)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width = key_states.shape[0], key_states.shape[2]
        keys = self.keys[layer_idx][:rows]
        values = self.values[layer_idx][:rows]
        # (rows, H_kv, T, D): each row's new tokens at their own positions along the key axis.
        index = self.positions.view(rows, 1, width, 1).expand(rows, keys.shape[1], width, keys.shape[3])
        keys.scatter_(2, index, key_states.to(keys.dtype))
        values.scatter_(2, index, value_states.to(values.dtype))
        return keys[:, :, :self.key_length], values[:, :, :self.key_length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # The model derives ``cache_position`` from this when none is given; positions and masks
        # come from the caller, so no model code depends on the value.
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.key_length, 0

    @property
    def is_compileable(self) -> bool:
        return True
