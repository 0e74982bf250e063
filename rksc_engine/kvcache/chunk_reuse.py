"""Retrieved-context reuse: each chunk's KV cached on its own and reused wherever it sits in a prompt.

A retrieval-augmented prompt is a header, k retrieved chunks and a question, and from one query to the
next the same chunks come back in another order and combination. Token-exact prefix caching stops at
the first chunk that differs, so most of the context is recomputed every time. Here (the idea of
CacheBlend, EuroSys '25) the prompt is cut into context spans at a text separator, and every span
between the first and the last is a *chunk*. (A span is a piece of the prompt's tokens; a KV
*segment*, elsewhere in this package, is a block of cached KV read in place.)

1. **Spans** (``segment_spans``): the prompt is tokenised once, as the full-recompute reference
   tokenises it, and the cuts are placed on token boundaries found through the tokenizer's character
   offsets. A chunk is therefore a run of the reference's own token ids: cutting never changes
   how a prompt is tokenised, and a chunk whose tokens differ in another prompt (a separator merged
   into a neighbouring token) simply does not match.
2. **Chunk KV**: a chunk is cached as the token sequence ``anchor + chunk`` in the token-exact radix
   cache, where ``anchor`` is the prompt's first token (the chat template's opening token). That KV
   is exactly what a prefill of that sequence gives, so it is valid token-exact cache content, it is
   counted in the RSBCM budget and evicted like any other node, and the chunk's tokens saw a real
   first token (the attention sink) rather than being their own. A chunk not yet cached is
   prefilled that way once, the first time it is seen.
3. **Assembly** (``prefill_with_chunks``): the prompt up to its first reused chunk is prefilled exactly
   (served by the radix cache as far as it matches). Each reused chunk's KV is appended with its keys
   re-rotated from its cached positions to its positions in this prompt (RoPE is a rotation by
   position). Text between chunks that is not reused is computed in place.
4. **Repair**: every reused token runs through the first two decoder layers only, at its own position
   under a 4D mask (``probe_positions``), which makes those layers' KV exact (the first layer's KV
   depends only on the token and its position; the second is the first to see the other chunks) and
   measures how far each token's reused KV of the second layer is from the exact one. The
   ``recompute_fraction`` most-deviating tokens are recomputed through every layer
   (``asks.recompute_positions``); a prompt whose mean deviation exceeds ``max_mean_deviation`` is
   computed exactly instead. The question after the last chunk is then prefilled on top.

Only the exact part (the prompt up to its first reused chunk) enters the token-exact radix cache;
nothing approximate ever does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ASKSConfig
from ..results import ChunkReuseDecision
from .asks import (
    PROBE_LAYER,
    kv_deviation,
    recompute_positions,
    rerotate_keys,
    rotary_embedding_of,
    scattered_mask,
    stop_after_layer,
)
from .memory import roll_back

Forward = Callable[..., Any]


# -- context spans --------------------------------------------------------------------------------
def segment_spans(text: str, offsets: Sequence[tuple[int, int]], separator: str) -> list[tuple[int, int]]:
    """Token spans ``[start, end)`` that tile the prompt, cut after each occurrence of ``separator``.

    ``offsets`` are the tokenizer's ``(start_char, end_char)`` per token of ``text``. A cut goes before
    the first token that starts at or after the separator's end, so a separator merged into a longer
    token (three newlines as one token) moves the cut to after that token: the spans only ever group
    the reference's own tokens. Each separator stays at the end of the span it closes.
    """
    if not separator or not offsets:
        return [(0, len(offsets))] if offsets else []
    cuts: list[int] = []
    token = 0
    found = text.find(separator)
    while found != -1:
        cut_char = found + len(separator)
        while token < len(offsets) and (offsets[token][0] < cut_char or offsets[token] == (0, 0) and token):
            token += 1
        if 0 < token < len(offsets) and (not cuts or cuts[-1] != token):
            cuts.append(token)
        found = text.find(separator, cut_char)
    bounds = [0, *cuts, len(offsets)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


# -- the prefill ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReusedChunk:
    """A cached chunk placed in the prompt.

    Attributes:
        start: The chunk's first position in the prompt.
        kv: Its cached KV, ``(L, 2, H_kv, n, D)`` for prompt positions ``start .. start + n - 1``.
        cached_start: The position its first token had where it was computed (after the anchor).
    """

    start: int
    kv: torch.Tensor
    cached_start: int

    @property
    def end(self) -> int:
        return self.start + self.kv.shape[3]


@dataclass
class ChunkPrefill:
    """A prompt prefilled with reused chunks.

    Attributes:
        cache: Batch-1 ``DynamicCache`` holding the whole prompt's KV.
        last_logits: Logits of the last prompt position ``(1, V)``.
        decision: What was reused and repaired.
        num_exact_tokens: Leading prompt tokens whose KV is exact; only these may enter the radix cache.
        num_computed_tokens: Prompt tokens run through every layer for this prompt (the exact part
            not served by the radix cache, text between chunks, recomputed tokens, the question).
    """

    cache: Any
    last_logits: torch.Tensor
    decision: ChunkReuseDecision
    num_exact_tokens: int
    num_computed_tokens: int

    @property
    def exact(self) -> bool:
        return self.num_exact_tokens == self.cache.get_seq_length()


def _append_kv(cache: Any, kv: torch.Tensor, shift: int, rotary: Any) -> None:
    """Append ``kv`` ``(L, 2, H_kv, n, D)`` to every layer of ``cache``, keys re-rotated by ``shift``."""
    for index, layer in enumerate(cache.layers):
        keys = rerotate_keys(kv[index, 0][None], shift, rotary).to(layer.keys.dtype)
        layer.keys = torch.cat((layer.keys, keys), dim=-2)
        layer.values = torch.cat((layer.values, kv[index, 1][None].to(layer.values.dtype)), dim=-2)


def probe_positions(forward: Forward, model: Any, prompt_ids: Sequence[int], positions: torch.Tensor,
                    cache: Any, last_layer: int) -> torch.Tensor:
    """Re-run the tokens at ``positions`` through decoder layers ``0..last_layer`` only, write their
    (now exact) KV of those layers over the cached one, and return each token's relative KV deviation
    at ``last_layer`` before the write, ``(r,)``."""
    length = cache.get_seq_length()
    dtype = next(model.parameters()).dtype
    mask = scattered_mask(length, positions, dtype)
    ids = torch.tensor([[prompt_ids[p] for p in positions.tolist()]], device=positions.device)

    with stop_after_layer(model, last_layer):
        forward(ids, cache, logits_to_keep=1, position_ids=positions[None], attention_mask=mask)
    probe = cache.layers[last_layer]
    deviation = kv_deviation(probe.keys[0, :, length:], probe.values[0, :, length:],
                             probe.keys[0, :, positions], probe.values[0, :, positions])
    for layer in cache.layers[:last_layer + 1]:
        layer.keys[:, :, positions] = layer.keys[:, :, length:]
        layer.values[:, :, positions] = layer.values[:, :, length:]
    roll_back(cache, [length] * len(cache.layers))
    return deviation


@torch.inference_mode()
def prefill_with_chunks(
    prompt_ids: list[int],
    cache: Any,
    chunks: list[ReusedChunk],
    forward: Forward,
    model: Any,
    config: ASKSConfig,
    *,
    num_segments: int,
    num_cached_chunks: int,
) -> ChunkPrefill:
    """Prefill ``prompt_ids`` on top of ``cache`` (its exact cached prefix) with ``chunks`` reused.

    Args:
        prompt_ids: The request's token ids.
        cache: Batch-1 ``DynamicCache`` holding the prompt's first ``cache.get_seq_length()`` tokens
            (exact); it is extended in place.
        chunks: The reused chunks in prompt order, non-overlapping, all after the cached prefix and
            ending before the last prompt token.
        forward: ``forward(input_ids (1, T), cache, **kwargs)`` running the model on top of ``cache``.
        model: The ``transformers`` model (its config, rotary embedding and decoder layers).
        config: ASKS settings (``recompute_fraction``, ``recompute_selection``, ``max_mean_deviation``).
        num_segments, num_cached_chunks: For the decision record: context spans in the prompt, and chunks
            that had to be prefilled on their own for this prompt.
    """
    device = next(model.parameters()).device
    matched = cache.get_seq_length()

    def run(start: int, end: int) -> Any:
        return forward(torch.tensor([prompt_ids[start:end]], device=device), cache, logits_to_keep=1)

    exact_end = chunks[0].start
    computed = exact_end - matched
    if computed:
        run(matched, exact_end)
    rotary = rotary_embedding_of(model)
    position, reused = exact_end, []
    for chunk in chunks:
        if chunk.start > position:  # text between chunks: computed in place
            run(position, chunk.start)
            computed += chunk.start - position
        _append_kv(cache, chunk.kv, chunk.start - chunk.cached_start, rotary)
        reused.extend(range(chunk.start, chunk.end))
        position = chunk.end
    positions = torch.tensor(reused, device=device)
    count = positions.numel()
    num_recomputed = min(count, int(round(config.recompute_fraction * count)))
    probe: dict[str, float] = {}
    probing = config.recompute_selection == "deviation" and len(cache.layers) > PROBE_LAYER + 1
    if num_recomputed == count or probing:
        if num_recomputed < count:
            deviation = probe_positions(forward, model, prompt_ids, positions, cache, PROBE_LAYER)
            probe.update(mean=float(deviation.mean()), max=float(deviation.max()))
        if num_recomputed == count or probe["mean"] > config.max_mean_deviation:
            # Too far from exact to trust (or all of it asked back): compute everything after the exact part.
            roll_back(cache, [exact_end] * len(cache.layers))
            out = run(exact_end, len(prompt_ids))
            decision = ChunkReuseDecision(
                reused=False, segments=num_segments, chunks_reused=0, chunks_cached=num_cached_chunks,
                prefix_tokens=matched, reused_tokens=0, recomputed_tokens=count, probe_tokens=count if probe else 0,
                mean_deviation=probe.get("mean"), max_deviation=probe.get("max"))
            return ChunkPrefill(cache, out.logits[:, -1, :], decision, len(prompt_ids), len(prompt_ids) - matched)
        chosen = torch.topk(deviation, num_recomputed).indices.sort().values
    else:  # "nearest" (or a model too shallow to probe): the first tokens of each chunk
        picks, index = [], 0
        for chunk in chunks:
            size = chunk.end - chunk.start
            picks.extend(range(index, index + round(config.recompute_fraction * size)))
            index += size
        chosen = torch.tensor(picks, dtype=torch.long, device=device)
        num_recomputed = len(picks)
    if num_recomputed:
        recompute_positions(forward, model, prompt_ids, positions[chosen], cache)
    out = run(position, len(prompt_ids))
    computed += num_recomputed + len(prompt_ids) - position
    decision = ChunkReuseDecision(
        reused=True, segments=num_segments, chunks_reused=len(chunks), chunks_cached=num_cached_chunks,
        prefix_tokens=matched, reused_tokens=count - num_recomputed, recomputed_tokens=num_recomputed,
        probe_tokens=count if probe else 0, mean_deviation=probe.get("mean"), max_deviation=probe.get("max"))
    return ChunkPrefill(cache, out.logits[:, -1, :], decision, exact_end, computed)
