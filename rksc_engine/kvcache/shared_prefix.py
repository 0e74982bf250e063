"""Shared-prefix decoding: one copy of the prompt's KV for all branches, attention split in two.

``n`` sibling branches share a prompt of ``P`` tokens. The plain path copies the prompt's KV ``n``
times (``batch_repeat_interleave``) and ``DynamicCache`` concatenates on every step, so each decode
step re-reads ``n`` copies of the prompt and copies the whole cache again. Here instead (the
Hydragen / "cascade attention" decomposition):

* ``SharedPrefixCache`` keeps the prompt's keys and values once per layer, ``(1, H_kv, P, D)``, and
  each branch's own generated tokens in a preallocated suffix buffer ``(B, H_kv, capacity, D)`` that
  decode steps write into in place (the capacity doubles when full, so appends are amortised O(1)).
* ``shared_prefix_attention``, registered in ``transformers``' ``AttentionInterface`` under
  ``ATTENTION_NAME``, attends all branches' queries to the prefix as one batched product (the
  prefix is read once per layer, not once per branch), attends each branch to its own suffix, and
  merges the two partial softmaxes exactly by their log-sum-exp:
  ``out = o_p * exp(lse_p - lse) + o_s * exp(lse_s - lse)``, ``lse = logaddexp(lse_p, lse_s)``,
  computed as ``lerp(o_p, o_s, sigmoid(lse_s - lse_p))``.

The model code is not forked: ``decode_step`` switches the model's attention implementation to
``ATTENTION_NAME`` for one forward and passes the cache to the attention function through the
forward's keyword arguments, which ``transformers`` models hand down to their attention calls. The
function asks the cache how its rows attend (``SplitAttentionCache.attend``): this module's
``SharedPrefixCache`` for one request, ``batch_decode.BatchDecodeCache`` for the rows of several.
Sliding windows, soft-capping and attention sinks (``AttentionVariant``) are applied as the model's
own attention applies them. The block math (a block's partial attention, the exact merges, the
variants) lives in ``split_attention``; this module owns one request's cache and the routing into
the attention. Not every model passes what its attention needs, so ``probe.probe`` checks a model
once, numerically against the plain path, and the engine falls back to ``DynamicCache`` when it
fails.

Exactness: in float32 the split attention equals eager attention over the concatenated KV to
rounding (``tests/unit/kvcache/test_shared_prefix.py`` bounds it), and on the tiny test models the decoded
tokens equal the plain path's token for token.
"""

from __future__ import annotations

import contextlib
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from ..config import DEFAULT_MAX_COPIED_PROMPT_TAIL
from .split_attention import (
    AttentionVariant,
    combine,
    prefix_rows,
    request_partials,
    segment_attention,
    variant_partials,
)
from .suffix_pool import SuffixPool, doubled_to

ATTENTION_NAME = "rksc_shared_prefix"
# The forward keyword that carries the cache down to ``shared_prefix_attention``.
CACHE_KWARG = "rksc_shared_prefix_cache"
# Suffix capacity in tokens allocated up front for a call (it doubles when full): the call's token
# budget, but at most this many, so a huge max_new_tokens does not reserve gigabytes it may not use.
MAX_INITIAL_SUFFIX_CAPACITY = 1024
MIN_SUFFIX_CAPACITY = 32


def initial_suffix_capacity(max_new_tokens: int) -> int:
    """Suffix tokens to preallocate per branch for a call allowed ``max_new_tokens``."""
    return max(1, min(max_new_tokens, MAX_INITIAL_SUFFIX_CAPACITY))


# -- attention ----------------------------------------------------------------------------------
class SplitAttentionCache(Cache, ABC):
    """A cache that ``shared_prefix_attention`` reads: it keeps a layer's KV as blocks (prompt
    segments, suffixes) and says how that layer's queries attend to them.

    ``SharedPrefixCache`` is one request's; ``BatchDecodeCache`` (``batch_decode``) routes the rows
    of several requests, each to its own ``SharedPrefixCache``.

    Args:
        layers: The cache's layers.
        fused: Use PyTorch's fused CPU attention kernel where available.
    """

    def __init__(self, layers: list[CacheLayerMixin], fused: bool) -> None:
        super().__init__(layers=layers)
        self.fused = fused
        self.num_attention_calls = 0  # how often shared_prefix_attention ran; `probe` checks it

    def forward_kwargs(self) -> dict[str, Any]:
        """The keyword arguments a model forward needs to reach ``shared_prefix_attention``."""
        return {CACHE_KWARG: self}

    @abstractmethod
    def attend(self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               variant: AttentionVariant) -> torch.Tensor:
        """Layer ``layer_index``'s attention output (B, T, H, D) for ``query`` (B, H, T, D), given
        the ``key``/``value`` that the layer's ``update`` returned."""


def shared_prefix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of ``B`` branches over one shared prefix plus each branch's own suffix.

    Called by ``transformers`` attention modules in place of eager/SDPA attention (signature of
    ``AttentionInterface`` functions). ``key``/``value`` are what the cache layer's ``update``
    returned for this layer: for a ``SharedPrefixCache``, the branches' suffixes, new tokens
    included. The cache says how its rows attend (``SplitAttentionCache.attend``).

    Args:
        module: The attention module; its ``layer_idx`` picks the prefix, its
            ``num_key_value_groups`` gives the GQA group size.
        query: (B, H, T, D), the T new tokens' queries (T = 1 when decoding).
        key: (B, H_kv, S, D), suffix keys; the last T are the new tokens'.
        value: (B, H_kv, S, D).
        attention_mask: Must be ``None``: branches in a batch always have equal lengths, so only
            causality among the T new tokens needs masking, and that is done here.
        scaling: Dot-product scale; default ``D ** -0.5``.
        dropout: Must be 0 (inference only).
        **kwargs: Must hold ``CACHE_KWARG``; may hold the layer's ``sliding_window``, ``softcap``
            and ``s_aux`` (attention sinks), which are applied as the model's own attention does.

    Returns:
        ``(output (B, T, H, D), None)``.
    """
    cache = kwargs.get(CACHE_KWARG)
    if not isinstance(cache, SplitAttentionCache):
        raise RuntimeError(f"{ATTENTION_NAME} attention needs the cache passed as the {CACHE_KWARG!r} keyword")
    if attention_mask is not None or dropout:
        raise NotImplementedError(f"{ATTENTION_NAME} takes no attention mask and no dropout")
    variant = AttentionVariant.of(module, kwargs)
    cache.num_attention_calls += 1
    scale = query.shape[-1]**-0.5 if scaling is None else float(scaling)
    return cache.attend(module.layer_idx, query, key, value, scale, variant), None


AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)


@contextlib.contextmanager
def attention_implementation(model: Any, name: str) -> Iterator[None]:
    """Run the block with ``model.config._attn_implementation`` set to ``name``, then restore it."""
    config = model.config
    if config._attn_implementation == name:
        yield
        return
    # The setter recurses into sub-configs, which may hold implementations of their own: remember each.
    configs = [config] + [getattr(config, key, None) for key in getattr(config, "sub_configs", {}) or {}]
    previous = [(c, c._attn_implementation) for c in configs if c is not None]
    config._attn_implementation = name
    try:
        yield
    finally:
        for sub, value in previous:  # the top config first: its setter overwrites the sub-configs
            sub._attn_implementation = value


# -- the cache ----------------------------------------------------------------------------------
class SharedPrefixLayer(CacheLayerMixin):
    """One layer's KV: the shared prefix once, and a preallocated per-branch suffix.

    The prefix is a list of segments in position order, each ``(keys, values)`` of shape
    (1, H_kv, P_i, D) and never written: one segment for a prompt held privately, or the prompt's
    radix-cache nodes themselves, read in place. ``keys``/``values`` are the suffix buffers
    (B, H_kv, capacity, D); only the first ``num_suffix_tokens`` positions hold data. The first
    ``num_copied_prompt_tokens`` of them may be the prompt's last segments, copied in for every
    branch (``prompt_tail``); ``segments`` then lists the others, ``prompt_segments`` all of them.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, segments: list[tuple[torch.Tensor, torch.Tensor]], num_branches: int, capacity: int):
        super().__init__()
        if not segments:
            raise ValueError("the prefix needs at least one segment")
        self.segments = segments  # [(keys, values)], each (1, H_kv, P_i, D), never written
        first = segments[0][0]
        _, num_kv_heads, _, head_dim = first.shape
        self.device = first.device
        shape = (num_branches, num_kv_heads, max(capacity, 1), head_dim)
        self.keys = torch.empty(shape, dtype=first.dtype, device=self.device)
        self.values = torch.empty(shape, dtype=first.dtype, device=self.device)
        self.num_suffix_tokens = 0
        self.num_prefix_tokens = sum(k.shape[2] for k, _ in segments)
        self.prompt_tail: list[tuple[torch.Tensor, torch.Tensor]] = []  # the copied segments themselves
        # Set while the suffix buffers are views of a ``SuffixPool``'s slots (``bind_suffix_buffers``):
        # called with the positions a write needs, it makes the room (the pool grows, or gives the
        # cache buffers of its own), so the layer never reallocates its views itself.
        self.on_grow: Callable[[int], None] | None = None
        self.is_initialized = True

    @property
    def num_copied_prompt_tokens(self) -> int:
        """Prompt tokens at the front of every branch's suffix (``prompt_tail``'s), 0 if none."""
        return sum(keys.shape[2] for keys, _ in self.prompt_tail)

    @property
    def prompt_segments(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The whole prompt's segments, in position order, the copied tail included."""
        return [*self.segments, *self.prompt_tail] if self.prompt_tail else self.segments

    def copy_prompt_tail(self, num_segments: int = 1) -> None:
        """Move the last ``num_segments`` segments into the front of every branch's suffix (see
        ``SchedulerConfig.max_copied_prompt_tail`` for why); at least one stays in place."""
        if not 1 <= num_segments < len(self.segments) or self.num_suffix_tokens:
            raise ValueError("a prompt copies 1 to all but one of its segments, before any suffix token")
        tail = self.segments[-num_segments:]
        count = sum(keys.shape[2] for keys, _ in tail)
        if count > self.keys.shape[2]:
            self._grow(count)
        start = 0
        for keys, values in tail:
            stop = start + keys.shape[2]
            self.keys[:, :, start:stop] = keys
            self.values[:, :, start:stop] = values
            start = stop
        self.segments = self.segments[:-num_segments]
        self.num_prefix_tokens -= count
        self.num_suffix_tokens = count
        self.prompt_tail = list(tail)

    @property
    def prefix_keys(self) -> torch.Tensor:
        """The prefix's keys (1, H_kv, P, D), a copied prompt tail not included: the segment itself
        when there is one, else a copy."""
        return self.segments[0][0] if len(self.segments) == 1 else torch.cat([k for k, _ in self.segments], dim=2)

    @property
    def prefix_values(self) -> torch.Tensor:
        return self.segments[0][1] if len(self.segments) == 1 else torch.cat([v for _, v in self.segments], dim=2)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # Built initialised from the prefix; nothing to do lazily.
        return None

    def bind_suffix_buffers(self, keys: torch.Tensor, values: torch.Tensor,
                            on_grow: Callable[[int], None] | None = None) -> None:
        """Hold the suffix in ``keys``/``values`` (B, H_kv, capacity, D) from now on, their first
        ``num_suffix_tokens`` positions already filled; ``on_grow`` as the attribute says (None for
        buffers of the layer's own)."""
        self.keys, self.values, self.on_grow = keys, values, on_grow

    def reserve(self, capacity: int) -> None:
        """Make the suffix buffers hold at least ``capacity`` positions a row, allocated now."""
        if self.keys.shape[2] < capacity:
            self._grow(capacity)

    def _grow(self, needed: int) -> None:
        """Reallocate both suffix buffers with at least ``needed`` positions, or neither: out of memory
        for the second one, keys and values keep their old, equal capacity, and a retry writes both."""
        if self.on_grow is not None:
            self.on_grow(needed)
            if self.keys.shape[2] >= needed:
                return
        self.keys, self.values = self.resized_buffers(doubled_to(self.keys.shape[2], needed))

    def resized_buffers(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New suffix buffers (B, H_kv, ``capacity``, D) holding this layer's suffix, both allocated
        before anything is bound (the caller binds them)."""
        shape = (*self.keys.shape[:2], capacity, self.keys.shape[3])
        keys = torch.empty(shape, dtype=self.keys.dtype, device=self.keys.device)
        values = torch.empty(shape, dtype=self.values.dtype, device=self.values.device)
        self.copy_suffix_into(keys, values)
        return keys, values

    def copy_suffix_into(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy the suffix's filled positions to the front of ``keys``/``values`` (B, H_kv, >= S, D)."""
        used = self.num_suffix_tokens
        keys[:, :, :used] = self.keys[:, :, :used]
        values[:, :, :used] = self.values[:, :, :used]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' KV (B, H_kv, T, D) in place; return the suffix views (B, H_kv, S, D)."""
        start, num_new = self.num_suffix_tokens, key_states.shape[2]
        if key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(f"batch of {key_states.shape[0]} rows, but the cache holds {self.keys.shape[0]} branches")
        if start + num_new > self.keys.shape[2]:
            self._grow(start + num_new)
        self.keys[:, :, start:start + num_new] = key_states
        self.values[:, :, start:start + num_new] = value_states
        self.num_suffix_tokens = start + num_new
        return self.keys[:, :, : self.num_suffix_tokens], self.values[:, :, : self.num_suffix_tokens]

    def get_seq_length(self) -> int:
        return self.num_prefix_tokens + self.num_suffix_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the branches ``indices`` (the prefix is shared, so only the suffix moves).

        Only the filled part of the suffix is gathered, into the front rows of the same buffer, so
        dropping a finished branch costs its siblings' generated tokens, not the whole capacity."""
        used, kept = self.num_suffix_tokens, len(indices)
        # Both gathers (the allocations) before either write: out of memory in the second must not
        # leave the keys' rows selected and the values' not.
        gathered = [buffer[indices, :, :used] for buffer in (self.keys, self.values)]
        for buffer, rows in zip((self.keys, self.values), gathered):
            buffer[:kept, :, :used] = rows
        self.keys, self.values = self.keys[:kept], self.values[:kept]

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` suffix positions (the ``transformers`` >= 5
        convention), so a decode step that ran out of memory half-way can be retried without feeding a
        position twice. The buffers stay allocated; later steps overwrite the forgotten rows. The
        shared prefix, a copied prompt tail included, is never cropped."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        remove = -tokens_to_remove
        generated = self.num_suffix_tokens - self.num_copied_prompt_tokens
        if remove > generated:
            raise ValueError(f"cannot crop {remove} tokens from a {generated}-token suffix; "
                             "the shared prefix is not cropped")
        self.num_suffix_tokens -= remove

    def reset(self) -> None:
        self.num_suffix_tokens = self.num_copied_prompt_tokens


class SharedPrefixCache(SplitAttentionCache):
    """A ``transformers`` cache for ``B`` branches decoding after one shared prompt.

    Args:
        prefix_kv: Per layer, the prompt's ``(keys, values)``, each (1, H_kv, P, D); kept, not copied.
        num_branches: Rows of the batch that will decode.
        suffix_capacity: Tokens per branch to preallocate (the buffer doubles when full).
        fused: Use PyTorch's fused CPU attention kernel for the prefix where available.

    Example:
        >>> cache = SharedPrefixCache.from_dynamic_cache(prefilled_cache, num_branches=8)
        >>> with attention_implementation(model, ATTENTION_NAME):
        ...     out = model(input_ids=tokens, cache=cache, use_cache=True, **cache.forward_kwargs())
    """

    def __init__(
        self,
        prefix_kv: list[tuple[torch.Tensor, torch.Tensor]],
        num_branches: int,
        suffix_capacity: int = MIN_SUFFIX_CAPACITY,
        fused: bool = True,
    ) -> None:
        if num_branches < 1:
            raise ValueError(f"num_branches must be >= 1, got {num_branches}")
        layers = [SharedPrefixLayer([(k, v)], num_branches, suffix_capacity) for k, v in prefix_kv]
        super().__init__(layers, fused)
        # The ``SuffixPool`` that holds this cache's suffix rows, from slot ``pool_slot`` on
        # (``attach_pool_slot``), or None while the layers hold buffers of their own.
        self.suffix_pool: SuffixPool | None = None
        self.pool_slot: int | None = None

    @staticmethod
    def can_share(cache: Any) -> bool:
        """Whether ``cache`` is a batch-1 ``DynamicCache`` of plain layers, which ``from_dynamic_cache`` takes."""
        layers = getattr(cache, "layers", None)
        return bool(layers) and all(
            type(layer) is DynamicLayer and layer.keys is not None and layer.keys.dim() == 4 and layer.keys.shape[0] == 1
            for layer in layers
        )

    @classmethod
    def from_dynamic_cache(
        cls, cache: Any, num_branches: int, suffix_capacity: int = MIN_SUFFIX_CAPACITY, fused: bool = True
    ) -> SharedPrefixCache:
        """Share the KV of a batch-1 ``DynamicCache`` (the prefill's) among ``num_branches`` branches."""
        if not cls.can_share(cache):
            raise ValueError("the prefix must be a batch-1 DynamicCache of plain (non-sliding) layers")
        return cls([(layer.keys, layer.values) for layer in cache.layers], num_branches, suffix_capacity, fused)

    @classmethod
    def from_segments(
        cls, segments: list[list[tuple[torch.Tensor, torch.Tensor]]], num_branches: int,
        suffix_capacity: int = MIN_SUFFIX_CAPACITY, fused: bool = True,
        max_copied_tail: int = DEFAULT_MAX_COPIED_PROMPT_TAIL,
    ) -> SharedPrefixCache:
        """A cache whose prefix is read in place from ``segments[layer]`` (each (1, H_kv, P_i, D),
        in position order), e.g. the prompt's radix-cache nodes. The last segments that together hold
        at most ``max_copied_tail`` tokens, all but the first segment at most, are copied to the
        front of every branch's suffix (``SharedPrefixLayer.copy_prompt_tail``): short nodes that a
        few other prompts share (a topic, a few words) would each be one more read a layer. The choice
        depends on the segments alone, never on ``num_branches`` or the batch, so a branch computes
        the same alone or among others."""
        if max_copied_tail < 0:
            raise ValueError(f"max_copied_tail must be >= 0, got {max_copied_tail}")
        num_copied, tail = 0, 0
        for keys, _ in reversed(segments[0][1:]):
            if tail + keys.shape[2] > max_copied_tail:
                break
            num_copied, tail = num_copied + 1, tail + keys.shape[2]
        cache = cls([(segs[0][0], segs[0][1]) for segs in segments], num_branches, suffix_capacity + tail, fused)
        for layer, segs in zip(cache.layers, segments):
            layer.segments = list(segs)
            layer.num_prefix_tokens = sum(k.shape[2] for k, _ in segs)
            if num_copied:
                layer.copy_prompt_tail(num_copied)
        return cache

    def attend(self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               variant: AttentionVariant) -> torch.Tensor:
        """The branches' attention over the prompt's segments and each branch's own suffix (``key``,
        ``value`` (B, H_kv, S, D)): ``query`` (B, H, T, D) in, (B, T, H, D) out."""
        layer = self.layers[layer_index]
        if not variant.plain:
            partials = variant_partials(query, layer.segments, key, value, layer.num_prefix_tokens, scale, self.fused,
                                        variant)
            return combine([partials], query.shape, query.dtype)
        prefix = [segment_attention(prefix_rows(query, key.shape[1]), k, v, scale, self.fused, query.shape[0])
                  for k, v in layer.segments]
        return combine([request_partials(query, prefix, key, value, scale, self.fused)], query.shape, query.dtype)

    def attach_pool_slot(self, pool: SuffixPool, slot: int, key_views: list[torch.Tensor],
                         value_views: list[torch.Tensor]) -> None:
        """Hold the suffix in ``pool``'s slots from ``slot`` on: ``key_views``/``value_views`` are
        per layer the views (B, H_kv, capacity, D) of those slots, the suffix already copied in.

        Everything that reads or writes the suffix in place (``update``, ``crop``,
        ``batch_select_indices``, ``suffix_kv``) then works on the views; a write that needs more
        room asks the pool (``SuffixPool.make_room``) instead of reallocating the views."""
        self.suffix_pool, self.pool_slot = pool, slot
        make_room = _PoolRoom(pool, self)
        for layer, keys, values in zip(self.layers, key_views, value_views):
            layer.bind_suffix_buffers(keys, values, make_room)

    def detach_pool(self, keep_capacity: int | None = None) -> None:
        """Stop holding the suffix in the pool's slots. With ``keep_capacity``, the suffix is first
        copied into buffers of the cache's own with room for that many tokens a row (it goes on
        decoding); without, the layers are left without a suffix (the request is done). Out of
        memory, nothing has changed."""
        if keep_capacity is not None:  # every layer's buffers allocated before any is bound
            own = [layer.resized_buffers(doubled_to(layer.keys.shape[2], keep_capacity)) for layer in self.layers]
        else:  # fresh empty tensors: a view, even an empty one, would keep the pool's memory alive
            own = [(layer.keys.new_empty((*layer.keys.shape[:2], 0, layer.keys.shape[3])),
                    layer.values.new_empty((*layer.values.shape[:2], 0, layer.values.shape[3])))
                   for layer in self.layers]
        for layer, (keys, values) in zip(self.layers, own):
            layer.bind_suffix_buffers(keys, values)
        self.suffix_pool, self.pool_slot = None, None

    def suffix_kv(self, row: int) -> torch.Tensor:
        """Branch ``row``'s own generated tokens' KV as (L, 2, H_kv, S, D), the radix cache's layout
        (a copied prompt tail is the prompt's, not the branch's)."""
        return torch.stack([torch.stack((layer.keys[row, :, layer.num_copied_prompt_tokens:layer.num_suffix_tokens],
                                         layer.values[row, :, layer.num_copied_prompt_tokens:layer.num_suffix_tokens]))
                            for layer in self.layers])

    def prompt_segments(self) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per layer, the prompt's segments as ``from_segments`` took them (a later wave forks off them)."""
        return [list(layer.prompt_segments) for layer in self.layers]

    def stacked_kv(self, row: int) -> torch.Tensor:
        """Branch ``row``'s whole sequence (prefix + suffix) as (L, 2, H_kv, T, D), the radix cache's layout."""
        per_layer = []
        for layer in self.layers:
            s = layer.num_suffix_tokens
            keys = torch.cat([k[0] for k, _ in layer.segments] + [layer.keys[row, :, :s]], dim=1)  # (H_kv, P + s, D)
            values = torch.cat([v[0] for _, v in layer.segments] + [layer.values[row, :, :s]], dim=1)
            per_layer.append(torch.stack((keys, values)))
        return torch.stack(per_layer)


class _PoolRoom:
    """A pooled layer's ``on_grow``: asks the pool to make room for the layer's cache. The cache is
    held weakly, so its layers hold no reference cycle back to it."""

    def __init__(self, pool: SuffixPool, cache: SharedPrefixCache) -> None:
        self.pool, self.cache = pool, weakref.ref(cache)

    def __call__(self, needed: int) -> None:
        cache = self.cache()
        if cache is not None:
            self.pool.make_room(cache, needed)
