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
own attention applies them. Not every model passes what its attention needs, so ``probe`` checks a
model once, numerically against the plain path, and the engine falls back to ``DynamicCache`` when
it fails.

Exactness: in float32 the split attention equals eager attention over the concatenated KV to
rounding (``tests/unit/test_shared_prefix.py`` bounds it), and on the tiny test models the decoded
tokens equal the plain path's token for token.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from .cache_layers import has_sliding_layers, keeps_token_kv, layer_types, new_kv_cache

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
def partial_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one block of keys, returning the output and its log-sum-exp.

    Args:
        query: (..., M, D).
        keys: (..., N, D).
        values: (..., N, D).
        scale: Multiplier of the dot products.
        mask: Optional boolean (M, N), True where a key is visible. A query row that sees no key
            gets output 0 and log-sum-exp ``EMPTY_LSE``, which merges as no mass.
        softcap: Soft-capping of the scaled scores, ``softcap * tanh(score / softcap)`` (Gemma 2).

    Returns:
        ``(output (..., M, D), lse (..., M))``, both in float32: the block's normalised output and
        ``log(sum(exp(scores)))`` over the block, which is what merging two blocks needs.
    """
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scale  # (..., M, N)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (..., M)
    if mask is not None:
        lse = lse.clamp_min(EMPTY_LSE)
    weights = torch.exp(scores - lse[..., None])
    return torch.matmul(weights, values.float()), lse


# The log-sum-exp of a block no query row can see: finite, so that merging two such blocks gives no
# NaN, and so small that exp(EMPTY_LSE - lse) is exactly 0 against any real block.
EMPTY_LSE = -1e30


def fused_cpu_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The same as ``partial_attention`` without a mask, through PyTorch's fused CPU flash kernel
    (the one SDPA uses), which also returns the log-sum-exp. ``None`` where it is unavailable."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or query.device.type != "cpu" or query.dim() != 4:
        return None
    output, lse = op(query, keys, values, 0.0, False, scale=scale)
    return output.float(), lse.float()


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
            partials = _variant_partials(query, layer.segments, key, value, layer.num_prefix_tokens, scale, fused,
                                         variant)
            return _combine([partials], query.shape, query.dtype), None
        prefix = [_segment_attention(_prefix_rows(query, key.shape[1]), k, v, scale, fused, query.shape[0])
                  for k, v in layer.segments]
        return _combine([_partials(query, prefix, key, value, scale, fused)], query.shape, query.dtype), None
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


@dataclass(frozen=True)
class AttentionVariant:
    """What a layer's attention does beyond plain causal softmax attention, as ``transformers``
    model code passes it to an attention function.

    Attributes:
        window: Sliding window: a query sees a key at most ``window - 1`` positions before it
            (``transformers``' sliding-window mask). None for full attention.
        softcap: Scores are soft-capped, ``softcap * tanh(score / softcap)`` (Gemma 2).
        sinks: (H,) per-head sink logits (gpt-oss): one more softmax term per head whose value is
            zero, so it only takes mass from the keys.
    """

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None and self.sinks is None

    @classmethod
    def of(cls, module: torch.nn.Module, kwargs: dict[str, Any]) -> AttentionVariant:
        """The variant a model's attention module asks for in its attention call's ``kwargs``."""
        window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
        if sinks is None and getattr(module, "sinks", None) is not None:
            raise NotImplementedError(f"{ATTENTION_NAME}: the layer has attention sinks it does not pass as s_aux")
        if window is not None and int(window) < 1:
            raise NotImplementedError(f"{ATTENTION_NAME}: sliding window {window} is not a positive token count")
        if window is None and softcap is None and sinks is None:
            return _PLAIN
        return cls(None if window is None else int(window), None if softcap is None else float(softcap), sinks)


_PLAIN = AttentionVariant()


def _visible_segments(segments: list[tuple[torch.Tensor, torch.Tensor]], first_query: int, window: int | None
                      ) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """The parts of a prefix's segments (in position order, the first at position 0) that a query at
    absolute position ``first_query`` or later may see: ``(keys, values, first position)`` each, views
    of the segments, sliced to the window's start when ``window`` is set."""
    low = 0 if window is None else first_query - window + 1
    visible, start = [], 0
    for keys, values in segments:
        stop = start + keys.shape[2]
        if stop > low:
            skip = max(0, low - start)
            visible.append((keys[:, :, skip:], values[:, :, skip:], start + skip))
        start = stop
    return visible


def _window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None,
                 group: int) -> torch.Tensor | None:
    """Boolean (G*T, N) mask of which keys each query row sees (rows are (head in group, token)
    pairs, token fastest, as in ``_partials``), or None when every row sees every key (always so
    for one query: ``_visible_segments`` sliced its keys to the window)."""
    if len(query_positions) == 1:
        return None
    visible = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        visible &= key_positions[None, :] > query_positions[:, None] - window
    if bool(visible.all()):
        return None
    return visible.repeat(group, 1)


def _empty_partial(query: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block no query sees (output 0, log-sum-exp ``EMPTY_LSE``), shaped as ``_partials``' blocks."""
    batch, num_heads, num_new, head_dim = query.shape
    rows = num_heads // num_kv_heads * num_new
    out = torch.zeros(batch, num_kv_heads, rows, head_dim, dtype=torch.float32, device=query.device)
    return out, torch.full((batch, num_kv_heads, rows), EMPTY_LSE, dtype=torch.float32, device=query.device)


def _sink_partial(query: torch.Tensor, num_kv_heads: int, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention sinks as one more block: each head's sink logit as its log-sum-exp, and zero
    output (a sink has no value), shaped as ``_partials``' blocks."""
    batch, num_heads, num_new, head_dim = query.shape
    group = num_heads // num_kv_heads
    lse = sinks.float().reshape(num_kv_heads, group, 1).expand(num_kv_heads, group, num_new)
    lse = lse.reshape(1, num_kv_heads, group * num_new).expand(batch, -1, -1)
    out = torch.zeros(batch, num_kv_heads, group * num_new, head_dim, dtype=torch.float32, device=query.device)
    return out, lse


def _variant_partials(query: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]], key: torch.Tensor,
                      value: torch.Tensor, num_prefix: int, scale: float, fused: bool, variant: AttentionVariant
                      ) -> Partials:
    """``_partials`` for a layer with a sliding window, soft-capping or sinks: one request's
    branches (``query`` (B, H, T, D)) over its prefix segments (positions from 0) and its suffix
    (``key``/``value`` (B, H_kv, S, D), the T new tokens last, positions from ``num_prefix``).

    Out-of-window keys are sliced off (or masked, for the earlier of several new tokens); a
    segment no query sees is left out; the sinks are one more block."""
    batch, num_heads, num_new, head_dim = query.shape
    num_kv_heads, suffix_len = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    device = query.device
    first_query = num_prefix + suffix_len - num_new
    query_positions = torch.arange(first_query, first_query + num_new, device=device)
    blocks = [] if variant.sinks is None else [_sink_partial(query, num_kv_heads, variant.sinks)]
    for seg_keys, seg_values, start in _visible_segments(segments, first_query, variant.window):
        positions = torch.arange(start, start + seg_keys.shape[2], device=device)
        mask = _window_mask(query_positions, positions, variant.window, group)
        blocks.append(_masked_block(query, seg_keys, seg_values, scale, fused, mask, variant.softcap, prefix=True))
    if not blocks:
        blocks.append(_empty_partial(query, num_kv_heads))
    skip = 0 if variant.window is None else max(0, first_query - variant.window + 1 - num_prefix)
    positions = torch.arange(num_prefix + skip, num_prefix + suffix_len, device=device)
    mask = _window_mask(query_positions, positions, variant.window, group)
    out_s, lse_s = _masked_block(query, key[:, :, skip:], value[:, :, skip:], scale, fused, mask, variant.softcap,
                                 prefix=False)
    return blocks, out_s, lse_s


def _masked_block(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, fused: bool,
                  mask: torch.Tensor | None, softcap: float | None, *, prefix: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's partial result for ``_variant_partials``: a prefix segment (``prefix``: keys
    (1, H_kv, N, D), read once for all branches, as ``_segment_attention``) or the branches' own
    suffixes (keys (B, H_kv, N, D)). Returns (B, H_kv, G*T, D) and (B, H_kv, G*T)."""
    batch, num_heads, num_new, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    if prefix and mask is None:
        return _segment_attention(_prefix_rows(query, num_kv_heads), keys, values, scale, fused, batch, softcap)
    q = query.reshape(batch, num_kv_heads, num_heads // num_kv_heads * num_new, head_dim)
    result = fused_cpu_attention(q, keys, values, scale) if fused and mask is None and softcap is None else None
    return result if result is not None else partial_attention(q, keys, values, scale, mask, softcap)


def _batch_attention(query: torch.Tensor, num_kv_heads: int, layer: BatchDecodeLayer,
                     row_ranges: list[tuple[int, int]], scale: float, fused: bool,
                     variant: AttentionVariant = _PLAIN) -> torch.Tensor:
    """The decoding rows of several requests: ``query`` (B, H, T, D); returns (B, T, H, D).

    A prefix segment (a radix-cache node) that several requests share is read once, with all their
    queries in one product; each request then merges its own segments in its own order and attends
    to its own suffixes, so every row sees exactly the operations it would see alone (the batch
    only widens the linear layers)."""
    if not variant.plain:
        return _variant_batch_attention(query, num_kv_heads, layer, row_ranges, scale, fused, variant)
    if len(layer.group_layers) == 1:  # one request: nothing to share, skip the bookkeeping
        (keys, values), group_layer = layer.views[0], layer.group_layers[0]
        prefix = [_segment_attention(_prefix_rows(query, num_kv_heads), k, v, scale, fused, query.shape[0])
                  for k, v in group_layer.segments]
        return _combine([_partials(query, prefix, keys, values, scale, fused)], query.shape, query.dtype)
    per_group: list[list] = [[None] * len(g.segments) for g in layer.group_layers]
    for (seg_k, seg_v), users in layer.shared_segments():
        rows = [query[row_ranges[g][0]:row_ranges[g][1]] for g, _ in users]
        q = torch.cat([_prefix_rows(r, num_kv_heads) for r in rows], dim=2) if len(rows) > 1 else \
            _prefix_rows(rows[0], num_kv_heads)
        out, lse = _segment_attention(q, seg_k, seg_v, scale, fused, None)  # (1, H_kv, R, D), (1, H_kv, R)
        offset = 0
        for (g, position), r in zip(users, rows):
            width = r.shape[0] * (r.shape[1] // num_kv_heads) * r.shape[2]
            per_group[g][position] = _rows_to_branches(out[:, :, offset:offset + width], lse[:, :, offset:offset + width],
                                                      r.shape[0])
            offset += width
    partials = [_partials(query[start:stop], per_group[g], keys, values, scale, fused)
                for g, ((start, stop), (keys, values)) in enumerate(zip(row_ranges, layer.views))]
    return _combine(partials, query.shape, query.dtype)


def _variant_batch_attention(query: torch.Tensor, num_kv_heads: int, layer: BatchDecodeLayer,
                             row_ranges: list[tuple[int, int]], scale: float, fused: bool,
                             variant: AttentionVariant) -> torch.Tensor:
    """``_batch_attention`` for a layer with a sliding window, soft-capping or sinks (one new token
    per row). Each request sees the part of its prefix inside its own window; requests whose
    visible parts are the same memory (a shared radix node inside both windows) read it once. Each
    row sees the operations of ``_variant_partials`` alone."""
    if query.shape[2] != 1:  # several new tokens a row: each request on its own, with its masks
        partials = [_variant_partials(query[start:stop], group_layer.segments, keys, values,
                                      group_layer.num_prefix_tokens, scale, fused, variant)
                    for (start, stop), (keys, values), group_layer in zip(row_ranges, layer.views, layer.group_layers)]
        return _combine(partials, query.shape, query.dtype)
    visible = []
    for group_layer in layer.group_layers:
        first_query = group_layer.num_prefix_tokens + group_layer.num_suffix_tokens - 1
        visible.append([(k, v) for k, v, _ in _visible_segments(group_layer.segments, first_query, variant.window)])
    per_group: list[list] = [[None] * len(segments) for segments in visible]
    for (seg_k, seg_v), users in _shared_segments(visible):
        rows = [query[row_ranges[g][0]:row_ranges[g][1]] for g, _ in users]
        q = torch.cat([_prefix_rows(r, num_kv_heads) for r in rows], dim=2) if len(rows) > 1 else \
            _prefix_rows(rows[0], num_kv_heads)
        out, lse = _segment_attention(q, seg_k, seg_v, scale, fused, None, variant.softcap)
        offset = 0
        for (g, position), r in zip(users, rows):
            width = r.shape[0] * (r.shape[1] // num_kv_heads) * r.shape[2]
            per_group[g][position] = _rows_to_branches(out[:, :, offset:offset + width],
                                                      lse[:, :, offset:offset + width], r.shape[0])
            offset += width
    partials = []
    for g, ((start, stop), (keys, values)) in enumerate(zip(row_ranges, layer.views)):
        rows = query[start:stop]
        blocks = [] if variant.sinks is None else [_sink_partial(rows, num_kv_heads, variant.sinks)]
        blocks += per_group[g]
        if not blocks:
            blocks.append(_empty_partial(rows, num_kv_heads))
        suffix_len = keys.shape[2]
        skip = 0 if variant.window is None else max(0, suffix_len - variant.window)
        out_s, lse_s = _masked_block(rows, keys[:, :, skip:], values[:, :, skip:], scale, fused, None,
                                     variant.softcap, prefix=False)
        partials.append((blocks, out_s, lse_s))
    return _combine(partials, query.shape, query.dtype)


def _prompt_attention(query: torch.Tensor, prefix: tuple[torch.Tensor, torch.Tensor] | None,
                      new_keys: torch.Tensor, new_values: torch.Tensor, scale: float, fused: bool,
                      variant: AttentionVariant = _PLAIN) -> torch.Tensor:
    """A prompt's new tokens, prefilled in a decode step: ``query`` (1, H, T, D) over the prompt's
    cached prefix (1, H_kv, P, D), if any, and causally over its own new KV (1, H_kv, T, D), as
    the model's SDPA prefill computes it. Returns (1, T, H, D)."""
    num_new = query.shape[2]
    if not variant.plain:
        segments = [] if prefix is None else [prefix]
        num_prefix = 0 if prefix is None else prefix[0].shape[2]
        partials = _variant_partials(query, segments, new_keys, new_values, num_prefix, scale, fused, variant)
        return _combine([partials], query.shape, query.dtype)
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


def _merge_prefix_segments(prefix: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's prefix segments' partial results (in position order) merged into one."""
    out_p, lse_p = prefix[0]
    for out_i, lse_i in prefix[1:]:  # exact merge of two partial softmaxes (see ``_combine``)
        out_p = torch.lerp(out_p, out_i, _vector_aligned(torch.sigmoid, lse_i - lse_p)[..., None])
        lse_p = _vector_aligned(torch.logaddexp, lse_p, lse_i)
    return out_p, lse_p


# PyTorch's CPU elementwise kernels run whole SIMD vectors and finish a tensor's last few elements
# with scalar code, and for transcendental functions (sigmoid, logaddexp) the two can differ in the
# last bit. Which elements are last depends on how many rows share the tensor, so a row's result
# would depend on its batch. Padding to a multiple of every vector width sends every element through
# the vector code, whatever the batch.
VECTOR_ALIGNMENT = 64


# The same holds for matrix products on some CPUs (AVX-512 ones among them): a product of a few
# query rows takes another kernel than one of many, so a prefix segment read once for all of a
# step's rows would give a row other bits than when its request runs alone. Padded with zero rows to
# a multiple of this, every row goes through the same kernel tiles whatever the row count (measured
# on AVX-512 for 8 to 1,100 rows, fused and unfused).
ROW_ALIGNMENT = 8


def _vector_aligned(fn: Any, *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(*tensors)`` (elementwise, same shapes) computed so that an element's value does not
    depend on the other elements of the tensor (see ``VECTOR_ALIGNMENT``)."""
    if tensors[0].device.type != "cpu":
        return fn(*tensors)
    count = tensors[0].numel()
    pad = -count % VECTOR_ALIGNMENT
    flat = [torch.nn.functional.pad(t.reshape(-1), (0, pad)) for t in tensors]
    return fn(*flat)[:count].reshape(tensors[0].shape)


# One request's attention as partial softmaxes: its prefix segments' (output, log-sum-exp) pairs in
# position order, then its suffix's output and log-sum-exp.
Partials = tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]


def _combine(partials: list[Partials], query_shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Each request's partial softmaxes (``_partials``, in batch order) merged into the attention
    output (B, T, H, D) of the whole batch, in one set of operations for all requests: a step of
    many small requests pays for the merge once, not once per request.

    A request with fewer prefix segments than another is padded with empty ones (no mass: output 0,
    log-sum-exp -inf), which leave its partials exactly as they are. The suffix's share of the total
    softmax mass is exp(lse_s) / (exp(lse_p) + exp(lse_s)) = sigmoid(lse_s - lse_p), so the merged
    output is a lerp (three ops per layer instead of six, which matters at ~60 small ops per layer
    per step)."""
    batch, num_heads, num_new, head_dim = query_shape
    if len(partials) == 1:
        segments, out_s, lse_s = partials[0]
    else:
        segments = []
        for position in range(max(len(prefix) for prefix, _, _ in partials)):
            outs, lses = [], []
            for prefix, _, _ in partials:
                if position < len(prefix):
                    out_i, lse_i = prefix[position]
                else:
                    out_i = torch.zeros_like(prefix[0][0])
                    lse_i = torch.full_like(prefix[0][1], float("-inf"))
                outs.append(out_i)
                lses.append(lse_i)
            segments.append((torch.cat(outs), torch.cat(lses)))
        out_s = torch.cat([out for _, out, _ in partials])
        lse_s = torch.cat([lse for _, _, lse in partials])
    out_p, lse_p = _merge_prefix_segments(segments)
    out = torch.lerp(out_p, out_s, _vector_aligned(torch.sigmoid, lse_s - lse_p)[..., None])
    out = out.reshape(batch, num_heads, num_new, head_dim).to(dtype)
    return out.transpose(1, 2).contiguous()


def _prefix_rows(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, H, T, D) queries as one row block per KV head, (1, H_kv, B*G*T, D): every branch's (and
    every GQA head's) queries against the prefix in one product."""
    batch, num_heads, num_new, head_dim = query.shape
    group = num_heads // num_kv_heads
    q = query.reshape(batch, num_kv_heads, group * num_new, head_dim)
    return q.transpose(0, 1).reshape(1, num_kv_heads, batch * group * num_new, head_dim)


def _rows_to_branches(out: torch.Tensor, lse: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Undo ``_prefix_rows`` on a segment's result: (1, H_kv, B*G*T, D) -> (B, H_kv, G*T, D)."""
    num_kv_heads, rows, head_dim = out.shape[1], out.shape[2], out.shape[3]
    out = out.reshape(num_kv_heads, batch, rows // batch, head_dim).transpose(0, 1)
    lse = lse.reshape(num_kv_heads, batch, rows // batch).transpose(0, 1)
    return out, lse


def _segment_attention(q_prefix: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, fused: bool,
                       batch: int | None, softcap: float | None = None) -> Any:
    """Attention of prefix-shaped queries (1, H_kv, R, D) over one prefix segment (1, H_kv, P, D).
    Returns ``(out, lse)`` as (1, H_kv, R, D), (1, H_kv, R), or per branch (``_rows_to_branches``)
    when ``batch`` is given."""
    rows = q_prefix.shape[2]
    pad = -rows % ROW_ALIGNMENT if q_prefix.device.type == "cpu" else 0
    if pad:
        q_prefix = torch.nn.functional.pad(q_prefix, (0, 0, 0, pad))
    result = fused_cpu_attention(q_prefix, keys, values, scale) if fused and softcap is None else None
    out, lse = result if result is not None else partial_attention(q_prefix, keys, values, scale, softcap=softcap)
    if pad:
        out, lse = out[:, :, :rows], lse[:, :, :rows]
    return _rows_to_branches(out, lse, batch) if batch is not None else (out, lse)


def _partials(
    query: torch.Tensor, prefix: list[tuple[torch.Tensor, torch.Tensor]], key: torch.Tensor, value: torch.Tensor,
    scale: float, fused: bool,
) -> Partials:
    """One request's attention as partial softmaxes, for ``_combine``: its prefix segments' partial
    results (``prefix``, in position order, each (B, H_kv, G*T, D) and (B, H_kv, G*T)), and its
    branches' attention over their own suffixes.

    ``query`` (B, H, T, D); ``key``/``value`` (B, H_kv, S, D), the suffixes with the T new tokens
    last. Returns ``(prefix, out_s, lse_s)``, the suffix's shaped as the segments'."""
    batch, num_heads, num_new, head_dim = query.shape
    num_kv_heads, suffix_len = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads  # GQA: head h reads KV head h // group
    # Query rows of one KV head: its group's heads of every branch and new token.
    q = query.reshape(batch, num_kv_heads, group * num_new, head_dim)  # (B, H_kv, G*T, D)
    # Suffix: each branch against its own tokens; new token i sees suffix positions <= S - T + i.
    # One new token sees the whole suffix, so the fused kernel needs no mask (the decode case).
    fused_out = fused_cpu_attention(q, key, value, scale) if fused and num_new == 1 else None
    if fused_out is not None:
        out_s, lse_s = fused_out
    else:
        mask = None
        if num_new > 1:
            visible = torch.arange(suffix_len, device=query.device)[None, :] <= (
                torch.arange(num_new, device=query.device)[:, None] + suffix_len - num_new
            )  # (T, S)
            mask = visible.repeat(group, 1)  # rows of q are (group, token) pairs, token fastest
        out_s, lse_s = partial_attention(q, key, value, scale, mask)  # (B, H_kv, G*T, D), (B, H_kv, G*T)

    return prefix, out_s, lse_s


AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)


# -- the cache ----------------------------------------------------------------------------------
class SharedPrefixLayer(CacheLayerMixin):
    """One layer's KV: the shared prefix once, and a preallocated per-branch suffix.

    The prefix is a list of segments in position order, each ``(keys, values)`` of shape
    (1, H_kv, P_i, D) and never written: one segment for a prompt held privately, or the prompt's
    radix-cache nodes themselves, read in place. ``keys``/``values`` are the suffix buffers
    (B, H_kv, capacity, D); only the first ``num_suffix_tokens`` positions hold data.
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
        self.is_initialized = True

    @property
    def prefix_keys(self) -> torch.Tensor:
        """The whole prefix's keys (1, H_kv, P, D): the segment itself when there is one, else a copy."""
        return self.segments[0][0] if len(self.segments) == 1 else torch.cat([k for k, _ in self.segments], dim=2)

    @property
    def prefix_values(self) -> torch.Tensor:
        return self.segments[0][1] if len(self.segments) == 1 else torch.cat([v for _, v in self.segments], dim=2)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # Built initialised from the prefix; nothing to do lazily.
        return None

    def _grow(self, needed: int) -> None:
        """Reallocate both suffix buffers with at least ``needed`` positions, or neither: out of memory
        for the second one, keys and values keep their old, equal capacity, and a retry writes both."""
        capacity = self.keys.shape[2]
        while capacity < needed:
            capacity *= 2
        used = self.num_suffix_tokens
        shape = (*self.keys.shape[:2], capacity, self.keys.shape[3])
        keys = torch.empty(shape, dtype=self.keys.dtype, device=self.device)
        values = torch.empty(shape, dtype=self.values.dtype, device=self.device)
        keys[:, :, :used] = self.keys[:, :, :used]
        values[:, :, :used] = self.values[:, :, :used]
        self.keys, self.values = keys, values

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
        shared prefix is never cropped."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        remove = -tokens_to_remove
        if remove > self.num_suffix_tokens:
            raise ValueError(f"cannot crop {remove} tokens from a {self.num_suffix_tokens}-token suffix; "
                             "the shared prefix is not cropped")
        self.num_suffix_tokens -= remove

    def reset(self) -> None:
        self.num_suffix_tokens = 0


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
    ) -> SharedPrefixCache:
        """A cache whose prefix is read in place from ``segments[layer]`` (each (1, H_kv, P_i, D),
        in position order), e.g. the prompt's radix-cache nodes."""
        cache = cls([(segs[0][0], segs[0][1]) for segs in segments], num_branches, suffix_capacity, fused)
        for layer, segs in zip(cache.layers, segments):
            layer.segments = list(segs)
            layer.num_prefix_tokens = sum(k.shape[2] for k, _ in segs)
        return cache

    def forward_kwargs(self) -> dict[str, Any]:
        """The keyword arguments a model forward needs to reach ``shared_prefix_attention``."""
        return {CACHE_KWARG: self}

    def suffix_kv(self, row: int) -> torch.Tensor:
        """Branch ``row``'s own generated tokens' KV as (L, 2, H_kv, S, D), the radix cache's layout."""
        return torch.stack([torch.stack((layer.keys[row, :, :layer.num_suffix_tokens],
                                         layer.values[row, :, :layer.num_suffix_tokens])) for layer in self.layers])

    def stacked_kv(self, row: int) -> torch.Tensor:
        """Branch ``row``'s whole sequence (prefix + suffix) as (L, 2, H_kv, T, D), the radix cache's layout."""
        per_layer = []
        for layer in self.layers:
            s = layer.num_suffix_tokens
            keys = torch.cat([k[0] for k, _ in layer.segments] + [layer.keys[row, :, :s]], dim=1)  # (H_kv, P + s, D)
            values = torch.cat([v[0] for _, v in layer.segments] + [layer.values[row, :, :s]], dim=1)
            per_layer.append(torch.stack((keys, values)))
        return torch.stack(per_layer)


def _shared_segments(segment_lists: list[list[tuple[torch.Tensor, torch.Tensor]]]
                     ) -> list[tuple[tuple[torch.Tensor, torch.Tensor], list[tuple[int, int]]]]:
    """Each distinct segment of the requests' ``segment_lists`` with its users ``(request, position
    in its list)``; two requests share a segment when it is the same memory (same start address,
    shape and strides), such as a radix-cache node both prompts begin with."""
    found: dict[tuple, tuple[tuple[torch.Tensor, torch.Tensor], list[tuple[int, int]]]] = {}
    for g, segments in enumerate(segment_lists):
        for position, (k, v) in enumerate(segments):
            key = (k.data_ptr(), tuple(k.shape), k.stride(), v.data_ptr())
            entry = found.get(key)
            if entry is None:
                found[key] = ((k, v), [(g, position)])
            else:
                entry[1].append((g, position))
    return list(found.values())


class BatchDecodeLayer(CacheLayerMixin):
    """One layer of a ``BatchDecodeCache``: routes each request's rows to that request's own layer."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, group_layers: list[SharedPrefixLayer], row_ranges: list[tuple[int, int]],
                 prompt_prefixes: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
                 prompt_spans: list[tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.group_layers = group_layers
        self.row_ranges = row_ranges
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []  # per group, its suffixes after the update
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

    def shared_segments(self) -> list[tuple[tuple[torch.Tensor, torch.Tensor], list[tuple[int, int]]]]:
        """Each distinct prefix segment of this layer with its users (``_shared_segments``)."""
        return _shared_segments([layer.segments for layer in self.group_layers])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each request's rows of the new KV (B, H_kv, T, D) into its own layer; the attention
        function reads the per-request suffixes from ``views``, so the new KV itself is returned.

        Out of memory part-way (a request's buffer failing to grow), the requests before it have
        their new positions and the rest do not; ``crop`` undoes exactly that."""
        self._lengths_before_update = [layer.num_suffix_tokens for layer in self.group_layers]
        if self.prompt_spans:  # one flattened row (1, H_kv, N, D): the decoding rows' tokens come first
            self.prompt_new = [(key_states[:, :, start:stop], value_states[:, :, start:stop])
                               for start, stop in self.prompt_spans]
            rows = self.row_ranges[-1][1]
            key_states = key_states[:, :, :rows].transpose(0, 2)  # (B, H_kv, 1, D)
            value_states = value_states[:, :, :rows].transpose(0, 2)
        self.views = [
            layer.update(key_states[start:stop], value_states[start:stop])
            for layer, (start, stop) in zip(self.group_layers, self.row_ranges)
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
                                   self.prompt_spans)
                  for i in range(len(caches[0].layers))]
        super().__init__(layers=layers)
        self.fused = fused
        self.num_attention_calls = 0

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
