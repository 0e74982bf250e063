"""Several prompts prefilled in one forward, packed into one row, each attending only to itself.

The prompts' uncached tokens go in one after another as a single row ``(1, total new tokens)``, so
the linear layers read their weights once for all of them. Attention is where packing can waste
work: a dense block-diagonal mask over the whole row costs ``(total)^2`` however little of it is
visible. ``PackedPromptsCache`` instead runs each prompt's attention on its own
(``split_attention.prompt_attention``: its new tokens over its cached prefix and causally over
themselves), so a pack costs what its prompts cost apart, ``sum(new * (cached + new))``. It is
reached through ``shared_prefix_attention``, as the decode caches are.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from .shared_prefix import SplitAttentionCache
from .split_attention import AttentionVariant, prompt_attention

# One prompt's cached prefix for one layer, (1, H_kv, P, D) keys and values; None when none is cached.
LayerPrefix = tuple[torch.Tensor, torch.Tensor] | None


class PackedPromptsLayer(CacheLayerMixin):
    """One layer of a ``PackedPromptsCache``: keeps each prompt's new KV (its span of the row)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, prefixes: list[LayerPrefix], spans: list[tuple[int, int]]) -> None:
        super().__init__()
        self.prefixes = prefixes
        self.spans = spans
        self.new: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep each prompt's new KV, views of the row's (1, H_kv, N, D); the attention reads them."""
        self.new = [(key_states[:, :, start:stop], value_states[:, :, start:stop]) for start, stop in self.spans]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.spans[-1][1] if self.new else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1


class PackedPromptsCache(SplitAttentionCache):
    """The cache of one packed prefill forward (module docstring).

    Args:
        prefixes: Per prompt, its cached prefix's per-layer ``(keys, values)`` (each (1, H_kv, P, D)),
            or None when nothing of it is cached.
        num_new_tokens: Per prompt, how many of its tokens the forward computes (at least 1 each).
        fused: Use PyTorch's fused CPU attention kernel where available.
    """

    def __init__(self, prefixes: list[list[tuple[torch.Tensor, torch.Tensor]] | None], num_new_tokens: list[int],
                 num_layers: int, fused: bool = True) -> None:
        if not num_new_tokens or len(prefixes) != len(num_new_tokens):
            raise ValueError("a packed prefill needs one prefix entry (or None) and one new-token count per prompt")
        if any(count < 1 for count in num_new_tokens):
            raise ValueError("each packed prompt needs at least one new token")
        self.spans: list[tuple[int, int]] = []
        start = 0
        for count in num_new_tokens:
            self.spans.append((start, start + count))
            start += count
        layers = [PackedPromptsLayer([None if prefix is None else prefix[i] for prefix in prefixes], self.spans)
                  for i in range(num_layers)]
        super().__init__(layers, fused)

    def prompt_kv(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Prompt ``index``'s new tokens' KV per layer, (1, H_kv, T, D) each, after the forward."""
        return [layer.new[index] for layer in self.layers]

    def attend(self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               variant: AttentionVariant) -> torch.Tensor:
        """Each prompt's queries (its span of ``query``, (1, H, N, D)) over its own prefix and new
        KV; returns (1, N, H, D)."""
        layer = self.layers[layer_index]
        outputs = [prompt_attention(query[:, :, start:stop], prefix, new_keys, new_values, scale, self.fused, variant)
                   for (start, stop), prefix, (new_keys, new_values) in zip(layer.spans, layer.prefixes, layer.new)]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
