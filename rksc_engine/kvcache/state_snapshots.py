"""Prompt-state snapshots for models whose cache the radix tree cannot slice (recurrent layers).

A Mamba, gated-delta-net or convolution layer keeps one state that each token overwrites, so there
is no per-token KV to cut at an arbitrary prefix. The state after exactly ``n`` tokens is still
exact to resume from: a prompt that starts with those ``n`` tokens can continue from a copy of it.
So each prefilled prompt leaves a snapshot of the model's whole cache (recurrent states and any
attention layers' KV) after all its tokens but the last, and a later prompt that extends those
tokens (the same prompt again, an agent's next turn) starts from the longest one it extends
(SGLang's ``MambaRadixCache`` keeps such snapshots at tree nodes; here they sit at prompt ends).

Snapshots are kept under a byte budget; the least recently used go first.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from .cache_layers import layer_tensors
from .memory import is_out_of_memory


def cache_bytes(cache: Any) -> int:
    """Bytes of the tensors a ``transformers`` cache holds (KV, conv and recurrent states)."""
    return sum(t.numel() * t.element_size() for layer in getattr(cache, "layers", ()) for t in layer_tensors(layer))


class StateSnapshots:
    """Copies of a model's cache after given token sequences, under a byte budget (LRU).

    Not thread-safe by itself: the engine serialises access under its lock.

    Args:
        budget_bytes: Most bytes kept (> 0).
    """

    def __init__(self, budget_bytes: int) -> None:
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be an int > 0, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[tuple[int, ...], tuple[Any, int]] = OrderedDict()  # oldest first
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, token_ids: Sequence[int], max_tokens: int) -> tuple[Any, int]:
        """A copy of the snapshot after the longest stored sequence that ``token_ids[:max_tokens]``
        starts with, and that sequence's length; ``(None, 0)`` when none."""
        best: tuple[int, ...] | None = None
        for key in self._entries:
            if len(key) <= max_tokens and (best is None or len(key) > len(best)) \
                    and tuple(token_ids[:len(key)]) == key:
                best = key
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        return copy.deepcopy(self._entries[best][0]), len(best)

    def insert(self, token_ids: Sequence[int], cache: Any) -> bool:
        """Keep a copy of ``cache`` as the state after ``token_ids``, evicting the least recently used
        snapshots to make room. Returns whether it was kept (not when it alone exceeds the budget,
        when the same sequence is kept already, or when the copy runs out of memory)."""
        key = tuple(token_ids)
        size = cache_bytes(cache)
        if not key or key in self._entries or size > self.budget_bytes:
            return False
        while self._entries and self.total_bytes + size > self.budget_bytes:
            _, (_, freed) = self._entries.popitem(last=False)
            self.total_bytes -= freed
        try:
            snapshot = copy.deepcopy(cache)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            return False
        self._entries[key] = (snapshot, size)
        self.total_bytes += size
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.total_bytes = 0
