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
forward's keyword arguments, which ``transformers`` models hand down to their attention calls.
Sliding windows, soft-capping and attention sinks (``AttentionVariant``) are applied as the model's
own attention applies them. The block math (a block's partial attention, the exact merges, the
variants) lives in ``split_attention``; this module owns the caches and the routing of rows. Not every model passes what its attention needs, so ``probe`` checks a
model once, numerically against the plain path, and the engine falls back to ``DynamicCache`` when
it fails.

Exactness: in float32 the split attention equals eager attention over the concatenated KV to
rounding (``tests/unit/test_shared_prefix.py`` bounds it), and on the tiny test models the decoded
tokens equal the plain path's token for token.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from ..config import DEFAULT_MAX_COPIED_PROMPT_TAIL
from .cache_layers import has_sliding_layers, keeps_token_kv, layer_types, new_kv_cache
from .split_attention import (
    PLAIN_ATTENTION,
    AttentionVariant,
    combine,
    empty_block,
    masked_block,
    prefix_rows,
    request_partials,
    rows_to_branches,
    same_segment_runs,
    segment_attention,
    shared_segments_of,
    sink_block,
    variant_partials,
    visible_segments,
)
from .suffix_pool import SuffixPool, doubled_to, pooled_suffix_attention, suffix_mask

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
    ``AttentionInterface`` functions). ``key``/``value`` are what ``SharedPrefixCache.update``
    returned for this layer: the branches' suffixes, new tokens included.

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
    if not isinstance(cache, SharedPrefixCache | BatchDecodeCache):
        raise RuntimeError(f"{ATTENTION_NAME} attention needs the cache passed as the {CACHE_KWARG!r} keyword")
    if attention_mask is not None or dropout:
        raise NotImplementedError(f"{ATTENTION_NAME} takes no attention mask and no dropout")
    variant = AttentionVariant.of(module, kwargs)
    cache.num_attention_calls += 1
    head_dim = query.shape[-1]
    scale = head_dim**-0.5 if scaling is None else float(scaling)
    fused = cache.fused
    if isinstance(cache, SharedPrefixCache):
        layer = cache.layers[module.layer_idx]
        if not variant.plain:
            partials = variant_partials(query, layer.segments, key, value, layer.num_prefix_tokens, scale, fused,
                                         variant)
            return combine([partials], query.shape, query.dtype), None
        prefix = [segment_attention(prefix_rows(query, key.shape[1]), k, v, scale, fused, query.shape[0])
                  for k, v in layer.segments]
        return combine([request_partials(query, prefix, key, value, scale, fused)], query.shape, query.dtype), None
    layer = cache.layers[module.layer_idx]
    if not layer.prompt_spans:
        return _batch_attention(query, key.shape[1], layer, cache.row_ranges, scale, fused, variant), None
    # A step that also prefills prompts runs one flattened row (1, H, rows + prompt tokens, D): the
    # decoding rows' queries first, one token each, then each prompt's new tokens.
    rows = cache.num_rows
    batch_heads = query.shape[1]
    outputs = [_batch_attention(query[:, :, :rows].transpose(0, 2), key.shape[1], layer, cache.row_ranges, scale,
                                fused, variant).reshape(1, rows, batch_heads, head_dim)]
    for (start, stop), prefix, (new_keys, new_values) in zip(layer.prompt_spans, layer.prompt_prefixes,
                                                              layer.prompt_new):
        outputs.append(_prompt_attention(query[:, :, start:stop], prefix, new_keys, new_values, scale, fused,
                                         variant))
    return torch.cat(outputs, dim=1), None


def _batch_attention(query: torch.Tensor, num_kv_heads: int, layer: BatchDecodeLayer,
                     row_ranges: list[tuple[int, int]], scale: float, fused: bool,
                     variant: AttentionVariant = PLAIN_ATTENTION) -> torch.Tensor:
    """The decoding rows of several requests: ``query`` (B, H, T, D); returns (B, T, H, D).

    A prefix segment (a radix-cache node) that several requests share is read once, with all their
    queries in one product; each request then merges its own segments in its own order and attends
    to its own suffixes, so every row sees exactly the operations it would see alone (the batch
    only widens the linear layers)."""
    if not variant.plain:
        return _variant_batch_attention(query, num_kv_heads, layer, row_ranges, scale, fused, variant)
    out_s, lse_s = _suffix_partials(query, num_kv_heads, layer, row_ranges, scale, fused)
    if len(layer.group_layers) == 1:  # one request: nothing to share, skip the bookkeeping
        prefix = [segment_attention(prefix_rows(query, num_kv_heads), k, v, scale, fused, query.shape[0])
                  for k, v in layer.group_layers[0].segments]
        return combine([(prefix, out_s, lse_s)], query.shape, query.dtype)
    # Consecutive requests with the same segments (their prompts' shared radix nodes) make one run:
    # its rows are contiguous, so each segment's partials come out for the whole run at once, in the
    # layout the merge takes, instead of being cut per request and put back together.
    runs = same_segment_runs([g.segments for g in layer.group_layers])
    run_rows = [(row_ranges[first][0], row_ranges[last - 1][1]) for first, last in runs]
    per_run = _read_segments_once(query, num_kv_heads, run_rows, [layer.group_layers[first].segments
                                                                  for first, _ in runs], scale, fused, None)
    partials = [(prefix, out_s[start:stop], lse_s[start:stop]) for (start, stop), prefix in zip(run_rows, per_run)]
    return combine(partials, query.shape, query.dtype)


def _suffix_partials(query: torch.Tensor, num_kv_heads: int, layer: BatchDecodeLayer,
                     row_ranges: list[tuple[int, int]], scale: float, fused: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's attention over its own suffix, in batch order: (B, H_kv, G*T, D) and (B, H_kv, G*T).
    The requests of a pooled run (consecutive slots of one ``SuffixPool``) take one call together;
    every other request takes one of its own."""
    _, num_heads, num_new, head_dim = query.shape
    runs = {run.first: run for run in layer.pooled_runs} if num_new == 1 else {}
    pieces = []
    group = 0
    while group < len(row_ranges):
        run = runs.get(group)
        if run is None:
            start, stop = row_ranges[group]
            keys, values = layer.view(group)
            _, out, lse = request_partials(query[start:stop], [], keys, values, scale, fused)
            pieces.append((out, lse))
            group += 1
            continue
        start, stop = run.rows
        q = query[start:stop].reshape(stop - start, num_kv_heads, num_heads // num_kv_heads, head_dim)
        padded = run.mask.shape[-1]
        keys = layer.pool_keys[run.slots[0]:run.slots[1], :, :padded]
        values = layer.pool_values[run.slots[0]:run.slots[1], :, :padded]
        pieces.append(pooled_suffix_attention(q, keys, values, run.mask, scale, fused))
        group = run.last
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat([out for out, _ in pieces]), torch.cat([lse for _, lse in pieces])


def _read_segments_once(query: torch.Tensor, num_kv_heads: int, row_ranges: list[tuple[int, int]],
                        segment_lists: list[list[tuple[torch.Tensor, torch.Tensor]]], scale: float, fused: bool,
                        softcap: float | None) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each request's prefix segments' partial results (``segment_lists[g]`` for the rows
    ``row_ranges[g]`` of ``query`` (B, H, 1, D)), a segment that several requests list (the same
    memory) read once with all their rows in one product. Per request, in its own segment order,
    ``(out, lse)`` shaped per branch (``rows_to_branches``)."""
    per_group: list[list] = [[None] * len(segments) for segments in segment_lists]
    for (seg_k, seg_v), users in shared_segments_of(segment_lists):
        rows = [query[row_ranges[g][0]:row_ranges[g][1]] for g, _ in users]
        q = torch.cat([prefix_rows(r, num_kv_heads) for r in rows], dim=2) if len(rows) > 1 else \
            prefix_rows(rows[0], num_kv_heads)
        out, lse = segment_attention(q, seg_k, seg_v, scale, fused, None, softcap)  # (1, H_kv, R, D), (1, H_kv, R)
        offset = 0
        for (g, position), r in zip(users, rows):
            width = r.shape[0] * (r.shape[1] // num_kv_heads) * r.shape[2]
            per_group[g][position] = rows_to_branches(out[:, :, offset:offset + width],
                                                      lse[:, :, offset:offset + width], r.shape[0])
            offset += width
    return per_group


def _variant_batch_attention(query: torch.Tensor, num_kv_heads: int, layer: BatchDecodeLayer,
                             row_ranges: list[tuple[int, int]], scale: float, fused: bool,
                             variant: AttentionVariant) -> torch.Tensor:
    """``_batch_attention`` for a layer with a sliding window, soft-capping or sinks (one new token
    per row). Each request sees the part of its prefix inside its own window; requests whose
    visible parts are the same memory (a shared radix node inside both windows) read it once. Each
    row sees the operations of ``variant_partials`` alone."""
    if query.shape[2] != 1:  # several new tokens a row: each request on its own, with its masks
        partials = [variant_partials(query[start:stop], group_layer.segments, *layer.view(g),
                                      group_layer.num_prefix_tokens, scale, fused, variant)
                    for g, ((start, stop), group_layer) in enumerate(zip(row_ranges, layer.group_layers))]
        return combine(partials, query.shape, query.dtype)
    visible = []
    for group_layer in layer.group_layers:
        first_query = group_layer.num_prefix_tokens + group_layer.num_suffix_tokens - 1
        visible.append([(k, v) for k, v, _ in visible_segments(group_layer.segments, first_query, variant.window)])
    per_group = _read_segments_once(query, num_kv_heads, row_ranges, visible, scale, fused, variant.softcap)
    partials = []
    for g, (start, stop) in enumerate(row_ranges):
        keys, values = layer.view(g)
        rows = query[start:stop]
        blocks = [] if variant.sinks is None else [sink_block(rows, num_kv_heads, variant.sinks)]
        blocks += per_group[g]
        if not blocks:
            blocks.append(empty_block(rows, num_kv_heads))
        suffix_len = keys.shape[2]
        skip = 0 if variant.window is None else max(0, suffix_len - variant.window)
        out_s, lse_s = masked_block(rows, keys[:, :, skip:], values[:, :, skip:], scale, fused, None,
                                     variant.softcap, prefix=False)
        partials.append((blocks, out_s, lse_s))
    return combine(partials, query.shape, query.dtype)


def _prompt_attention(query: torch.Tensor, prefix: tuple[torch.Tensor, torch.Tensor] | None,
                      new_keys: torch.Tensor, new_values: torch.Tensor, scale: float, fused: bool,
                      variant: AttentionVariant = PLAIN_ATTENTION) -> torch.Tensor:
    """A prompt's new tokens, prefilled in a decode step: ``query`` (1, H, T, D) over the prompt's
    cached prefix (1, H_kv, P, D), if any, and causally over its own new KV (1, H_kv, T, D), as
    the model's SDPA prefill computes it. Returns (1, T, H, D)."""
    num_new = query.shape[2]
    if not variant.plain:
        segments = [] if prefix is None else [prefix]
        num_prefix = 0 if prefix is None else prefix[0].shape[2]
        partials = variant_partials(query, segments, new_keys, new_values, num_prefix, scale, fused, variant)
        return combine([partials], query.shape, query.dtype)
    if prefix is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, new_keys, new_values, is_causal=True,
                                                               scale=scale, enable_gqa=True)
    else:
        num_prefix = prefix[0].shape[2]
        keys = torch.cat([prefix[0], new_keys], dim=2)
        values = torch.cat([prefix[1], new_values], dim=2)
        visible = torch.arange(num_prefix + num_new, device=query.device)[None, :] <= (
            torch.arange(num_new, device=query.device)[:, None] + num_prefix)  # (T, P + T)
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scale,
                                                               enable_gqa=True)
    return out.transpose(1, 2)


AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)


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
        # Set while the suffix buffers are views of a ``SuffixPool``'s slots: called with the
        # positions a write needs, it makes the room (the pool grows, or gives the cache buffers of
        # its own), so the layer never reallocates its views itself.
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


class SharedPrefixCache(Cache):
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
        super().__init__(layers=layers)
        self.fused = fused
        self.num_attention_calls = 0  # how often shared_prefix_attention ran; `probe` checks it
        # Set by a ``SuffixPool`` that holds this cache's suffix rows, from slot ``pool_slot`` on.
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

    def forward_kwargs(self) -> dict[str, Any]:
        """The keyword arguments a model forward needs to reach ``shared_prefix_attention``."""
        return {CACHE_KWARG: self}

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


class BatchDecodeLayer(CacheLayerMixin):
    """One layer of a ``BatchDecodeCache``: routes each request's rows to that request's own layer."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, group_layers: list[SharedPrefixLayer], row_ranges: list[tuple[int, int]],
                 prompt_prefixes: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
                 prompt_spans: list[tuple[int, int]] | None = None,
                 pooled_rows: Callable[[], PooledRows | None] | None = None, layer_index: int = 0) -> None:
        super().__init__()
        self.group_layers = group_layers
        self.row_ranges = row_ranges
        # Per group, its suffixes after the update (None for a pooled group: ``view`` slices it).
        self.views: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.pooled_rows = pooled_rows
        self.layer_index = layer_index
        # Prompts prefilled in the same forward: each one's cached prefix (1, H_kv, P, D) or None,
        # its tokens' span in the flattened row, and, after the update, its new KV (1, H_kv, T, D).
        self.prompt_prefixes = prompt_prefixes or []
        self.prompt_spans = prompt_spans or []
        self.prompt_new: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Per group, its suffix length before the latest ``update``, which ``crop`` returns to.
        self._lengths_before_update: list[int] | None = None
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    @property
    def pooled(self) -> PooledRows | None:
        return self.pooled_rows() if self.pooled_rows is not None else None

    @property
    def pooled_runs(self) -> list[PooledRun]:
        pooled = self.pooled
        return pooled.runs if pooled is not None else []

    @property
    def pool_keys(self) -> torch.Tensor:
        return self.pooled.pool.keys[self.layer_index]

    @property
    def pool_values(self) -> torch.Tensor:
        return self.pooled.pool.values[self.layer_index]

    def view(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Group ``group``'s suffixes (B_g, H_kv, S, D) after the update."""
        view = self.views[group]
        if view is None:
            layer = self.group_layers[group]
            view = layer.keys[:, :, :layer.num_suffix_tokens], layer.values[:, :, :layer.num_suffix_tokens]
        return view

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each request's rows of the new KV (B, H_kv, T, D) into its own layer; the attention
        function reads the per-request suffixes from ``views``, so the new KV itself is returned.
        The rows of pooled requests are written with one indexed copy into the pool.

        Out of memory part-way (a request's buffer failing to grow), the requests before it have
        their new positions and the rest do not; ``crop`` undoes exactly that."""
        self._lengths_before_update = [layer.num_suffix_tokens for layer in self.group_layers]
        if self.prompt_spans:  # one flattened row (1, H_kv, N, D): the decoding rows' tokens come first
            self.prompt_new = [(key_states[:, :, start:stop], value_states[:, :, start:stop])
                               for start, stop in self.prompt_spans]
            rows = self.row_ranges[-1][1]
            key_states = key_states[:, :, :rows].transpose(0, 2)  # (B, H_kv, 1, D)
            value_states = value_states[:, :, :rows].transpose(0, 2)
        pooled = self.pooled if key_states.shape[2] == 1 else None
        if pooled is not None:
            new_keys, new_values = key_states[:, :, 0], value_states[:, :, 0]  # (B, H_kv, D)
            if pooled.row_index is not None:
                new_keys, new_values = new_keys[pooled.row_index], new_values[pooled.row_index]
            self.pool_keys[pooled.slot_index, :, pooled.position_index] = new_keys
            self.pool_values[pooled.slot_index, :, pooled.position_index] = new_values
            for group in pooled.groups:
                self.group_layers[group].num_suffix_tokens += 1
        in_pool = pooled.groups if pooled is not None else frozenset()
        self.views = [
            None if group in in_pool else layer.update(key_states[start:stop], value_states[start:stop])
            for group, (layer, (start, stop)) in enumerate(zip(self.group_layers, self.row_ranges))
        ]
        return key_states, value_states

    def get_seq_length(self) -> int:
        # The sum over requests: every request grows by the same T per forward, so a pass that fails
        # half-way shows up here as ``T * num_groups`` and ``crop`` can undo it.
        return sum(layer.num_suffix_tokens for layer in self.group_layers)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Forget ``-tokens_to_remove`` positions, counted over all requests as ``get_seq_length``
        counts them (OOM roll-back).

        When that is what the latest ``update`` added, each request goes back to its own length
        before it, however far the update got; otherwise every request loses an equal share."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        remove = -tokens_to_remove
        if self._lengths_before_update is not None:
            added = [layer.num_suffix_tokens - length
                     for layer, length in zip(self.group_layers, self._lengths_before_update)]
            if min(added) >= 0 and sum(added) == remove:
                for layer, count in zip(self.group_layers, added):
                    layer.crop(-count)
                return
        if remove % len(self.group_layers):
            raise ValueError(f"cannot crop {remove} tokens evenly from {len(self.group_layers)} requests, "
                             "and the latest update did not add that many")
        for layer in self.group_layers:
            layer.crop(-(remove // len(self.group_layers)))

    def reset(self) -> None:
        for layer in self.group_layers:
            layer.reset()


@dataclass(frozen=True)
class PooledRun:
    """Consecutive requests of a batch, ``[first, last)``, whose rows are consecutive slots of a
    ``SuffixPool``: their suffixes are one padded tensor, read with one call and ``mask``."""

    first: int
    last: int
    rows: tuple[int, int]  # their rows in the batch
    slots: tuple[int, int]  # their slots in the pool
    mask: torch.Tensor  # (R, 1, 1, L), each row's keys after this step's token


@dataclass(frozen=True)
class PooledRows:
    """Where a decode step writes and reads the rows of its pooled requests (one new token each)."""

    pool: SuffixPool
    runs: list[PooledRun]
    groups: frozenset[int]  # the pooled requests' indices in the batch
    slot_index: torch.Tensor  # (P,) each pooled row's slot, in batch order
    position_index: torch.Tensor  # (P,) the position its new token goes to
    row_index: torch.Tensor | None  # (P,) its row in the batch; None when every row is pooled

    @classmethod
    def of(cls, caches: list[SharedPrefixCache], row_ranges: list[tuple[int, int]]) -> PooledRows | None:
        """The pooled rows of a batch of ``caches``, room made for one more token each (the pool
        grows, or a request past its limit leaves it). None when no request is pooled."""
        pool = next((c.suffix_pool for c in caches if c.suffix_pool is not None), None)  # a scheduler has one
        if pool is None:
            return None
        for cache in caches:
            if cache.suffix_pool is pool:
                pool.make_room(cache, cache.layers[0].num_suffix_tokens + 1)
        runs: list[list] = []  # [first, last, slot_start, slot_stop]
        for group, cache in enumerate(caches):
            if cache.suffix_pool is not pool:
                continue
            slot, rows = cache.pool_slot, row_ranges[group][1] - row_ranges[group][0]
            if runs and runs[-1][1] == group and runs[-1][3] == slot:
                runs[-1][1], runs[-1][3] = group + 1, slot + rows
            else:
                runs.append([group, group + 1, slot, slot + rows])
        if not runs:  # the only pooled requests outgrew the pool
            return None
        device = pool.keys[0].device
        built, slots, positions, batch_rows, groups = [], [], [], [], set()
        for first, last, slot_start, slot_stop in runs:
            lengths = []
            for group in range(first, last):
                length = caches[group].layers[0].num_suffix_tokens
                count = row_ranges[group][1] - row_ranges[group][0]
                lengths += [length + 1] * count
                positions += [length] * count
                groups.add(group)
            rows = (row_ranges[first][0], row_ranges[last - 1][1])
            built.append(PooledRun(first, last, rows, (slot_start, slot_stop),
                                   suffix_mask(lengths, device, pool.keys[0].dtype)))
            slots += range(slot_start, slot_stop)
            batch_rows += range(*rows)
        every_row = batch_rows == list(range(row_ranges[-1][1]))
        return cls(pool, built, frozenset(groups), torch.tensor(slots, device=device),
                   torch.tensor(positions, device=device),
                   None if every_row else torch.tensor(batch_rows, device=device))


class BatchDecodeCache(Cache):
    """The rows of several requests decoding in one forward, each request with its own
    ``SharedPrefixCache`` (its prompt once, its branches' suffixes).

    Rows ``row_ranges[i]`` of the batch belong to ``caches[i]``. Built afresh for each decode step by
    the scheduler (it only references the requests' caches; nothing is copied). Positions differ from
    request to request, so the forward must be given ``position_ids`` (see ``position_ids``).

    With ``prompts``, the same forward also prefills prompts: the input is one flattened row, the
    decoding rows' next tokens (one each, in batch order) and then each prompt's new tokens
    (``input_ids`` and ``position_ids`` of shape (1, rows + prompt tokens)). A prompt's tokens
    attend to its cached prefix and causally to each other; its new KV is in ``prompt_kv`` after
    the forward.

    Args:
        caches: One per request, in batch order.
        fused: Use PyTorch's fused CPU attention kernel where available.
        prompts: Per prompt, ``(prefix, num_new_tokens)``: the cached prefix's per-layer
            ``(keys, values)`` (each (1, H_kv, P, D)), or None when nothing of it is cached.
    """

    def __init__(self, caches: list[SharedPrefixCache], fused: bool = True,
                 prompts: list[tuple[list[tuple[torch.Tensor, torch.Tensor]] | None, int]] | None = None) -> None:
        if not caches:
            raise ValueError("a batch needs at least one request")
        prompts = prompts or []
        if any(num_new < 1 for _, num_new in prompts):
            raise ValueError("a prompt prefilled in a decode step needs at least one new token")
        self.caches = caches
        self.row_ranges: list[tuple[int, int]] = []
        start = 0
        for cache in caches:
            rows = cache.layers[0].keys.shape[0]
            self.row_ranges.append((start, start + rows))
            start += rows
        self.num_rows = start
        self.prompt_spans: list[tuple[int, int]] = []
        for _, num_new in prompts:
            self.prompt_spans.append((start, start + num_new))
            start += num_new
        layers = [BatchDecodeLayer([c.layers[i] for c in caches], self.row_ranges,
                                   [prefix[i] if prefix is not None else None for prefix, _ in prompts],
                                   self.prompt_spans, self.pooled_rows, i)
                  for i in range(len(caches[0].layers))]
        super().__init__(layers=layers)
        self._pooled: PooledRows | None = None
        self._pooled_known = False
        self.fused = fused
        self.num_attention_calls = 0

    def pooled_rows(self) -> PooledRows | None:
        """The pooled requests' rows (``PooledRows.of``), worked out when the forward first needs
        them: making their room may run out of memory, and inside the forward that is retried."""
        if not self._pooled_known:
            self._pooled = PooledRows.of(self.caches, self.row_ranges)
            self._pooled_known = True
        return self._pooled

    def position_ids(self, device: torch.device, prompt_starts: list[int] | None = None) -> torch.Tensor:
        """(B, 1) absolute position of each row's next token; with prompts, (1, B + prompt tokens),
        each prompt's new tokens numbered from its ``prompt_starts`` entry (its cached tokens)."""
        positions = []
        for cache, (start, stop) in zip(self.caches, self.row_ranges):
            positions += [cache.layers[0].get_seq_length()] * (stop - start)
        if not self.prompt_spans:
            return torch.tensor(positions, device=device)[:, None]
        for first, (start, stop) in zip(prompt_starts or [0] * len(self.prompt_spans), self.prompt_spans):
            positions += range(first, first + stop - start)
        return torch.tensor(positions, device=device)[None, :]

    def prompt_kv(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Prompt ``index``'s new tokens' KV per layer, (1, H_kv, T, D) each, after the forward."""
        return [layer.prompt_new[index] for layer in self.layers]

    def forward_kwargs(self) -> dict[str, Any]:
        return {CACHE_KWARG: self}


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


# -- support check ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeResult:
    """Whether a model decodes correctly through the shared-prefix path, and why not if not."""

    supported: bool
    reason: str = ""
    max_abs_logit_diff: float = 0.0
    # True when the probe could not run (an exception other than an unsupported feature): it says
    # nothing about the model, so the engine probes again on a later request.
    inconclusive: bool = False


def logit_tolerance(want: torch.Tensor, dtype: torch.dtype) -> float:
    """How far logits computed another exact way may stray from ``want`` by rounding alone, for a
    model of ``dtype``: relative to the largest logit (at least 1)."""
    return (1e-4 if dtype == torch.float32 else 5e-2) * max(float(want.abs().max()), 1.0)


# Prompt tokens the probe prefills: past a sliding window of up to this many minus two tokens, so that
# the window bites in the probe's decode step; a longer window is checked by the test suite's
# tiny models instead of by a long probe at load.
MAX_PROBE_PROMPT_TOKENS = 64


def probe(model: Any, forward: Any) -> ProbeResult:
    """Check once, numerically, that ``model`` decodes the same through ``SharedPrefixCache``.

    It prefills a short prompt (past the model's sliding window where that is short), decodes one
    step for two branches both through the model's own ``DynamicCache`` (repeated rows) and
    through the shared-prefix path, and requires every attention layer to have gone through
    ``shared_prefix_attention`` and the logits to agree to the model dtype's rounding.

    Args:
        model: A ``transformers`` causal LM.
        forward: ``forward(input_ids, cache, **kwargs)`` returning an output with ``.logits``.
    """
    from transformers import DynamicCache

    try:
        config = model.config
        if not keeps_token_kv(config):
            return ProbeResult(False, f"the model has layers without per-token KV: {sorted(set(layer_types(config)))}")
        layers = layer_types(config)
        device = next(model.parameters()).device
        text_config = config.get_text_config()
        vocab = int(text_config.vocab_size)
        length = 4
        if has_sliding_layers(config):
            length = max(length, min(int(getattr(text_config, "sliding_window", 0) or 0) + 2,
                                     MAX_PROBE_PROMPT_TOKENS))
        prompt = torch.tensor([[3 + (5 * i) % max(vocab - 3, 1) for i in range(length)]], device=device)
        step = torch.tensor([[min(7, vocab - 1)], [min(11, vocab - 1)]], device=device)
        with torch.inference_mode():
            plain = DynamicCache(config=config)  # the model's own cache: the reference
            forward(prompt, plain)
            kept = new_kv_cache(config)  # every token's KV, as rksc keeps it
            forward(prompt, kept)
            shared = SharedPrefixCache.from_dynamic_cache(kept, num_branches=2, suffix_capacity=2)
            plain.batch_repeat_interleave(2)
            want = forward(step, plain).logits[:, -1].float()
            with attention_implementation(model, ATTENTION_NAME):
                got = forward(step, shared, **shared.forward_kwargs()).logits[:, -1].float()
    except NotImplementedError as error:  # a layer the split attention refuses
        return ProbeResult(False, f"shared-prefix forward is not supported: {error}")
    except Exception as error:  # out of memory, an interrupted kernel...: try again later
        return ProbeResult(False, f"shared-prefix probe failed: {type(error).__name__}: {error}", inconclusive=True)
    if shared.num_attention_calls != len(layers):
        return ProbeResult(
            False, f"the model ran shared_prefix_attention in {shared.num_attention_calls} of {len(layers)} layers"
        )
    diff = float((got - want).abs().max())
    tolerance = logit_tolerance(want, model.dtype)
    if not math.isfinite(diff) or diff > tolerance:
        return ProbeResult(False, f"logits differ from the plain path by {diff:.3g} (> {tolerance:.3g})", diff)
    return ProbeResult(True, "", diff)
