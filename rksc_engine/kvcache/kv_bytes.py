"""Byte accounting of the KV that decode caches hold outside the radix prefix cache (what the
running requests cost beyond the cache's own budget)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .cache_layers import layer_tensors


def held_kv_bytes(holdings: Iterable[tuple[Any, int | None]]) -> int:
    """Bytes of KV that decode caches hold outside the prefix cache, each tensor's storage counted
    once, however many caches or rows share it.

    Each holding is ``(cache, private_segments)``: a decode cache (a ``SharedPrefixCache``'s branch
    suffixes and prompt segments, a ``DynamicCache``'s whole KV, or a recurrent layer's states; None
    holds nothing), and how many of its last prompt segments are its own. None means all of them:
    none is read in place from the radix cache, whose bytes such segments are."""
    seen: dict[int, int] = {}
    for cache, private_segments in holdings:
        for layer in getattr(cache, "layers", ()):
            tensors = layer_tensors(layer)
            segments = getattr(layer, "prompt_segments", [])
            if private_segments is None:
                private = segments
            else:
                private = segments[len(segments) - private_segments:] if private_segments else []
            tensors += [t for pair in private for t in pair]
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
