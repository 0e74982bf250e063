"""Several requests decoding in one forward: the cross-request view of their shared-prefix caches.

The scheduler batches the decode steps of every running request into one model forward. Each
request keeps its own ``SharedPrefixCache`` (its prompt once, its branches' suffixes);
``BatchDecodeCache`` is built afresh for each step over those caches and routes each request's rows
to its own layers, copying nothing. Its attention (``BatchDecodeCache.attend``, reached through
``shared_prefix_attention``):

* reads a prefix segment (a radix-cache node) that several requests share once, with all their
  queries in one product, and merges each request's segments in its own order, so a row sees
  exactly the operations it would see alone (the batch only widens the linear layers);
* reads the suffixes of requests held in consecutive slots of a ``SuffixPool`` with one call
  (``PooledRows``, ``PooledRun``) and every other request's with one of its own;
* with prompts to prefill in the same forward (mixed prefill), attends each prompt's new tokens to
  its cached prefix and causally to each other, as the model's own SDPA prefill does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from .shared_prefix import SharedPrefixCache, SharedPrefixLayer, SplitAttentionCache
from .split_attention import (
    PLAIN_ATTENTION,
    AttentionVariant,
    combine,
    empty_block,
    masked_block,
    prefix_rows,
    prompt_attention,
    request_partials,
    rows_to_branches,
    same_segment_runs,
    segment_attention,
    shared_segments_of,
    sink_block,
    variant_partials,
    visible_segments,
)
from .suffix_pool import SuffixPool, pooled_suffix_attention, suffix_mask


# -- attention ----------------------------------------------------------------------------------
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


# -- the cache ----------------------------------------------------------------------------------
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


class BatchDecodeCache(SplitAttentionCache):
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
        super().__init__(layers, fused)
        self._pooled: PooledRows | None = None
        self._pooled_known = False

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

    def attend(self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               variant: AttentionVariant) -> torch.Tensor:
        """Layer ``layer_index``'s attention for every row of the batch: ``query`` (B, H, T, D), or
        with prompts (1, H, rows + prompt tokens, D); returns (B, T, H, D), or (1, N, H, D)."""
        layer = self.layers[layer_index]
        if not layer.prompt_spans:
            return _batch_attention(query, key.shape[1], layer, self.row_ranges, scale, self.fused, variant)
        # A step that also prefills prompts runs one flattened row (1, H, rows + prompt tokens, D): the
        # decoding rows' queries first, one token each, then each prompt's new tokens.
        rows = self.num_rows
        batch_heads, head_dim = query.shape[1], query.shape[-1]
        outputs = [_batch_attention(query[:, :, :rows].transpose(0, 2), key.shape[1], layer, self.row_ranges, scale,
                                    self.fused, variant).reshape(1, rows, batch_heads, head_dim)]
        for (start, stop), prefix, (new_keys, new_values) in zip(layer.prompt_spans, layer.prompt_prefixes,
                                                                  layer.prompt_new):
            outputs.append(prompt_attention(query[:, :, start:stop], prefix, new_keys, new_values, scale, self.fused,
                                             variant))
        return torch.cat(outputs, dim=1)
