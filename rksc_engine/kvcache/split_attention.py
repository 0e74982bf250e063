"""Attention split into blocks whose partial softmaxes merge exactly.

Attention over a sequence of keys can be computed block by block: each block gives its normalised
output and the log-sum-exp of its scores, and two blocks merge exactly,
``out = lerp(o_a, o_b, sigmoid(lse_b - lse_a))``, ``lse = logaddexp(lse_a, lse_b)``. The shared-prefix
attention (``shared_prefix``) runs each prompt segment and each branch's own suffix as a block, so a
segment several branches or requests share is read once.

This module owns the block math: a block's partial attention (fused CPU kernel or unfused), the
merge of a request's blocks and of a whole batch's, the row layouts that read a segment once for
many query rows, and the attention variants ``transformers`` models ask for (sliding windows,
soft-capped scores, attention sinks). It is bit-careful: a row's result must not depend on which
other rows share its tensors (``VECTOR_ALIGNMENT``, ``ROW_ALIGNMENT``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# How errors from the variants name the attention they come from.
SPLIT_ATTENTION = "shared-prefix attention"


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
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The same as ``partial_attention``, through PyTorch's fused CPU flash kernel (the one SDPA
    uses), which also returns the log-sum-exp. ``mask``, if given, is additive (0 or -inf) and
    broadcasts to the scores. ``None`` where the kernel is unavailable."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or query.device.type != "cpu" or query.dim() != 4:
        return None
    if mask is None:
        output, lse = op(query, keys, values, 0.0, False, scale=scale)
    else:
        output, lse = op(query, keys, values, 0.0, False, attn_mask=mask, scale=scale)
    return output.float(), lse.float()


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
            raise NotImplementedError(f"{SPLIT_ATTENTION}: the layer has attention sinks it does not pass as s_aux")
        if window is not None and int(window) < 1:
            raise NotImplementedError(f"{SPLIT_ATTENTION}: sliding window {window} is not a positive token count")
        if window is None and softcap is None and sinks is None:
            return PLAIN_ATTENTION
        return cls(None if window is None else int(window), None if softcap is None else float(softcap), sinks)


PLAIN_ATTENTION = AttentionVariant()


def visible_segments(segments: list[tuple[torch.Tensor, torch.Tensor]], first_query: int, window: int | None
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


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None,
                 group: int) -> torch.Tensor | None:
    """Boolean (G*T, N) mask of which keys each query row sees (rows are (head in group, token)
    pairs, token fastest, as in ``request_partials``), or None when every row sees every key (always so
    for one query: ``visible_segments`` sliced its keys to the window)."""
    if len(query_positions) == 1:
        return None
    visible = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        visible &= key_positions[None, :] > query_positions[:, None] - window
    if bool(visible.all()):
        return None
    return visible.repeat(group, 1)


def empty_block(query: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block no query sees (output 0, log-sum-exp ``EMPTY_LSE``), shaped as ``request_partials``' blocks."""
    batch, num_heads, num_new, head_dim = query.shape
    rows = num_heads // num_kv_heads * num_new
    out = torch.zeros(batch, num_kv_heads, rows, head_dim, dtype=torch.float32, device=query.device)
    return out, torch.full((batch, num_kv_heads, rows), EMPTY_LSE, dtype=torch.float32, device=query.device)


def sink_block(query: torch.Tensor, num_kv_heads: int, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention sinks as one more block: each head's sink logit as its log-sum-exp, and zero
    output (a sink has no value), shaped as ``request_partials``' blocks."""
    batch, num_heads, num_new, head_dim = query.shape
    group = num_heads // num_kv_heads
    lse = sinks.float().reshape(num_kv_heads, group, 1).expand(num_kv_heads, group, num_new)
    lse = lse.reshape(1, num_kv_heads, group * num_new).expand(batch, -1, -1)
    out = torch.zeros(batch, num_kv_heads, group * num_new, head_dim, dtype=torch.float32, device=query.device)
    return out, lse


def variant_partials(query: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]], key: torch.Tensor,
                      value: torch.Tensor, num_prefix: int, scale: float, fused: bool, variant: AttentionVariant
                      ) -> Partials:
    """``request_partials`` for a layer with a sliding window, soft-capping or sinks: one request's
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
    blocks = [] if variant.sinks is None else [sink_block(query, num_kv_heads, variant.sinks)]
    for seg_keys, seg_values, start in visible_segments(segments, first_query, variant.window):
        positions = torch.arange(start, start + seg_keys.shape[2], device=device)
        mask = window_mask(query_positions, positions, variant.window, group)
        blocks.append(masked_block(query, seg_keys, seg_values, scale, fused, mask, variant.softcap, prefix=True))
    if not blocks:
        blocks.append(empty_block(query, num_kv_heads))
    skip = 0 if variant.window is None else max(0, first_query - variant.window + 1 - num_prefix)
    positions = torch.arange(num_prefix + skip, num_prefix + suffix_len, device=device)
    mask = window_mask(query_positions, positions, variant.window, group)
    out_s, lse_s = masked_block(query, key[:, :, skip:], value[:, :, skip:], scale, fused, mask, variant.softcap,
                                 prefix=False)
    return blocks, out_s, lse_s


def masked_block(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, fused: bool,
                  mask: torch.Tensor | None, softcap: float | None, *, prefix: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's partial result for ``variant_partials``: a prefix segment (``prefix``: keys
    (1, H_kv, N, D), read once for all branches, as ``segment_attention``) or the branches' own
    suffixes (keys (B, H_kv, N, D)). Returns (B, H_kv, G*T, D) and (B, H_kv, G*T)."""
    batch, num_heads, num_new, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    if prefix and mask is None:
        return segment_attention(prefix_rows(query, num_kv_heads), keys, values, scale, fused, batch, softcap)
    q = query.reshape(batch, num_kv_heads, num_heads // num_kv_heads * num_new, head_dim)
    result = fused_cpu_attention(q, keys, values, scale) if fused and mask is None and softcap is None else None
    return result if result is not None else partial_attention(q, keys, values, scale, mask, softcap)


def merge_blocks(prefix: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's prefix segments' partial results (in position order) merged into one."""
    out_p, lse_p = prefix[0]
    for out_i, lse_i in prefix[1:]:  # exact merge of two partial softmaxes (see ``combine``)
        out_p = torch.lerp(out_p, out_i, vector_aligned(torch.sigmoid, lse_i - lse_p)[..., None])
        lse_p = vector_aligned(torch.logaddexp, lse_p, lse_i)
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


def vector_aligned(fn: Any, *tensors: torch.Tensor) -> torch.Tensor:
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


def combine(partials: list[Partials], query_shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Each request's partial softmaxes (``request_partials``, in batch order) merged into the attention
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
    out_p, lse_p = merge_blocks(segments)
    out = torch.lerp(out_p, out_s, vector_aligned(torch.sigmoid, lse_s - lse_p)[..., None])
    out = out.reshape(batch, num_heads, num_new, head_dim).to(dtype)
    return out.transpose(1, 2).contiguous()


def prefix_rows(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, H, T, D) queries as one row block per KV head, (1, H_kv, B*G*T, D): every branch's (and
    every GQA head's) queries against the prefix in one product."""
    batch, num_heads, num_new, head_dim = query.shape
    group = num_heads // num_kv_heads
    q = query.reshape(batch, num_kv_heads, group * num_new, head_dim)
    return q.transpose(0, 1).reshape(1, num_kv_heads, batch * group * num_new, head_dim)


def rows_to_branches(out: torch.Tensor, lse: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Undo ``prefix_rows`` on a segment's result: (1, H_kv, B*G*T, D) -> (B, H_kv, G*T, D)."""
    num_kv_heads, rows, head_dim = out.shape[1], out.shape[2], out.shape[3]
    out = out.reshape(num_kv_heads, batch, rows // batch, head_dim).transpose(0, 1)
    lse = lse.reshape(num_kv_heads, batch, rows // batch).transpose(0, 1)
    return out, lse


def segment_attention(q_prefix: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, fused: bool,
                       batch: int | None, softcap: float | None = None) -> Any:
    """Attention of prefix-shaped queries (1, H_kv, R, D) over one prefix segment (1, H_kv, P, D).
    Returns ``(out, lse)`` as (1, H_kv, R, D), (1, H_kv, R), or per branch (``rows_to_branches``)
    when ``batch`` is given."""
    rows = q_prefix.shape[2]
    pad = -rows % ROW_ALIGNMENT if q_prefix.device.type == "cpu" else 0
    if pad:
        q_prefix = torch.nn.functional.pad(q_prefix, (0, 0, 0, pad))
    result = fused_cpu_attention(q_prefix, keys, values, scale) if fused and softcap is None else None
    out, lse = result if result is not None else partial_attention(q_prefix, keys, values, scale, softcap=softcap)
    if pad:
        out, lse = out[:, :, :rows], lse[:, :, :rows]
    return rows_to_branches(out, lse, batch) if batch is not None else (out, lse)


def request_partials(
    query: torch.Tensor, prefix: list[tuple[torch.Tensor, torch.Tensor]], key: torch.Tensor, value: torch.Tensor,
    scale: float, fused: bool,
) -> Partials:
    """One request's attention as partial softmaxes, for ``combine``: its prefix segments' partial
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


def segment_key(keys: torch.Tensor, values: torch.Tensor) -> tuple:
    """What makes two segments the same memory: start addresses, shape and strides."""
    return keys.data_ptr(), tuple(keys.shape), keys.stride(), values.data_ptr()


def same_segment_runs(segment_lists: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[tuple[int, int]]:
    """``[first, last)`` index ranges of consecutive entries of ``segment_lists`` that list the same
    segments (``segment_key``) in the same order."""
    keys = [tuple(segment_key(k, v) for k, v in segments) for segments in segment_lists]
    runs, first = [], 0
    for index in range(1, len(keys) + 1):
        if index == len(keys) or keys[index] != keys[first]:
            runs.append((first, index))
            first = index
    return runs


def shared_segments_of(segment_lists: list[list[tuple[torch.Tensor, torch.Tensor]]]
                     ) -> list[tuple[tuple[torch.Tensor, torch.Tensor], list[tuple[int, int]]]]:
    """Each distinct segment of the requests' ``segment_lists`` with its users ``(request, position
    in its list)``; two requests share a segment when it is the same memory (same start address,
    shape and strides), such as a radix-cache node both prompts begin with."""
    found: dict[tuple, tuple[tuple[torch.Tensor, torch.Tensor], list[tuple[int, int]]]] = {}
    for g, segments in enumerate(segment_lists):
        for position, (k, v) in enumerate(segments):
            key = segment_key(k, v)
            entry = found.get(key)
            if entry is None:
                found[key] = ((k, v), [(g, position)])
            else:
                entry[1].append((g, position))
    return list(found.values())


def prompt_attention(query: torch.Tensor, prefix: tuple[torch.Tensor, torch.Tensor] | None,
                     new_keys: torch.Tensor, new_values: torch.Tensor, scale: float, fused: bool,
                     variant: AttentionVariant = PLAIN_ATTENTION) -> torch.Tensor:
    """One prompt's new tokens, prefilled in a forward that holds other rows or prompts too:
    ``query`` (1, H, T, D) over the prompt's cached prefix (1, H_kv, P, D), if any, and causally
    over its own new KV (1, H_kv, T, D), as the model's SDPA prefill computes it; it never sees
    another prompt's keys. Returns (1, T, H, D)."""
    num_new = query.shape[2]
    if variant.softcap is not None or variant.sinks is not None:  # beyond what SDPA computes
        segments = [] if prefix is None else [prefix]
        num_prefix = 0 if prefix is None else prefix[0].shape[2]
        partials = variant_partials(query, segments, new_keys, new_values, num_prefix, scale, fused, variant)
        return combine([partials], query.shape, query.dtype)
    if prefix is None and variant.window is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, new_keys, new_values, is_causal=True,
                                                               scale=scale, enable_gqa=True)
        return out.transpose(1, 2)
    num_prefix = 0 if prefix is None else prefix[0].shape[2]
    keys = new_keys if prefix is None else torch.cat([prefix[0], new_keys], dim=2)
    values = new_values if prefix is None else torch.cat([prefix[1], new_values], dim=2)
    key_positions = torch.arange(num_prefix + num_new, device=query.device)[None, :]
    query_positions = torch.arange(num_new, device=query.device)[:, None] + num_prefix
    visible = key_positions <= query_positions  # (T, P + T)
    if variant.window is not None:  # a query sees the window's last keys, itself included
        visible &= key_positions > query_positions - variant.window
    out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scale,
                                                           enable_gqa=True)
    return out.transpose(1, 2)
