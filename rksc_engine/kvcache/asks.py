"""ASKS: reuse cached KV across prompts that differ in wording, gated by hidden-state similarity.

Token-exact prefix caching stops at the first differing token. ASKS looks further: when a request
matches a cached sequence token for token up to position ``k``, differs for a short span, then
realigns with the cached tokens, the cached KV of the realigned remainder is reused if the two
differing spans "mean the same" to the model.

The mechanism, for a request ``R`` and a cached sequence ``C``:

1. **Alignment** (``align_after_prefix``): ``R[:k] == C[:k]``; the request's span ``R[k:k+a]`` and the
   cached span ``C[k:k+b]`` (``1 <= a, b <= max_span_tokens``) are followed by a remainder
   ``R[k+a:k+a+m] == C[k+b:k+b+m]`` with ``m >= min_reuse_tokens``. Candidates are the cached
   root-to-leaf sequences that branch off the request's path (``candidate_sequences``), nearest
   branch first; the one with the longest remainder wins, and only if it serves at least
   ``min_reuse_tokens`` more tokens than the token-exact match (exact KV is never displaced).
   A pure insertion or deletion (an empty span on one side) has nothing to compare and is left alone.
2. **Similarity** (``span_similarity``): both spans are run over the exact cached KV ``[:k]`` with every
   layer's hidden states read out. The cached span's hidden states are *recomputed* (at most
   ``max_span_tokens`` tokens, discarded afterwards) rather than stored, so the radix cache holds KV
   only. Each layer's states are mean-pooled over its span, and
   ``sigma = sum_l w_l cos(mean h_req_l, mean h_cached_l) / sum_l w_l`` with ``w_l = exp(alpha l / L)``
   over the decoder layers ``l = 1..L`` (the embedding layer is left out: it only says which tokens
   differ, which alignment already knows).
3. **Reuse** (``sigma >= tau``): the request's own span KV (exact) is followed by the cached remainder's
   KV, its keys re-rotated by ``a - b`` positions (``rerotate_keys``; RoPE is a rotation by position,
   so this is exact for the position part), and only the tail after the remainder is prefilled.
   Otherwise the request computes its remainder itself, which is exact.
4. **Repair** (``recompute_selection="deviation"``, the default; CacheBlend's idea): before reusing,
   the remainder runs through the first two decoder layers only (``run_first_layers``, 2 of L
   layers' cost). The first layer's KV of a token depends on nothing but the token and its position,
   so it is exact either way; the second is the first to carry the changed span's influence, and
   its exact KV against the reused one gives each remainder token's deviation (``kv_deviation``).
   Both layers keep the exact KV. The ``recompute_fraction`` most-deviating tokens are then
   recomputed through every layer in one pass at their scattered positions under a custom 4D mask
   (``recompute_positions``), and a remainder whose mean deviation exceeds ``max_mean_deviation``
   is computed exactly instead. ``"nearest"`` recomputes the tokens right after the span, unprobed
   (also what a model of at most two layers gets, where the probe would be a whole pass).

What goes into the token-exact radix cache: only exact KV. After a reuse that is the shared prefix
plus the request's own span; the approximate remainder and anything decoded after it are never
inserted (``ASKSPrefill.num_exact_tokens``), so a later request that matches the cache token for
token is still served exact KV. A fallback computes everything exactly and caches the whole prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ASKSConfig
from ..decoder_parts import decoder_parts
from ..results import ASKSDecision
from .cache_layers import new_kv_cache
from .memory import roll_back
from .prefix_match import common_prefix_length

# RoPE variants whose frequencies depend on the sequence length: a fixed re-rotation is not exact.
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})
# Families whose RoPE rotates interleaved pairs rather than the two halves (and Cohere 2's global
# layers have no RoPE at all), so ``rerotate_keys`` would move their keys wrongly.
_INTERLEAVED_ROPE_MODEL_TYPES = frozenset({"cohere", "cohere2"})


# -- alignment ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Alignment:
    """Where a request and a cached sequence differ and where they realign.

    Attributes:
        cached_ids: The cached sequence (a root-to-leaf path of the radix tree).
        prefix_tokens: ``k``: both sequences agree on their first ``k`` tokens.
        request_span_tokens: ``a``: the request's differing span is ``R[k:k+a]``.
        cached_span_tokens: ``b``: the cached sequence's differing span is ``C[k:k+b]``.
        remainder_tokens: ``m``: ``R[k+a:k+a+m] == C[k+b:k+b+m]``, never covering the request's last token.
    """

    cached_ids: tuple[int, ...]
    prefix_tokens: int
    request_span_tokens: int
    cached_span_tokens: int
    remainder_tokens: int

    @property
    def position_shift(self) -> int:
        """How many positions the remainder moves from the cached sequence to the request (``a - b``)."""
        return self.request_span_tokens - self.cached_span_tokens


def align_after_prefix(
    request_ids: Sequence[int], cached_ids: Sequence[int], max_span_tokens: int, min_reuse_tokens: int
) -> Alignment | None:
    """Align ``request_ids`` with ``cached_ids`` past their common prefix.

    Among spans ``1 <= a, b <= max_span_tokens`` it picks the realignment with the longest remainder
    (ties: the shortest spans). The remainder stops one token before the end of the request, since the
    last prompt token is always computed to get the next-token logits.

    Returns:
        The alignment, or None when the sequences never realign for ``min_reuse_tokens`` tokens.

    Example:
        >>> align_after_prefix([1, 2, 7, 7, 3, 4, 5, 6], [1, 2, 9, 3, 4, 5, 6], 4, 3)
        Alignment(cached_ids=(1, 2, 9, 3, 4, 5, 6), prefix_tokens=2, request_span_tokens=2, cached_span_tokens=1, remainder_tokens=3)
    """
    prefix = common_prefix_length(request_ids, cached_ids)
    reusable_end = len(request_ids) - 1  # exclusive: the last request token is never reused
    anchor = max(1, min(min_reuse_tokens, 8))
    # Positions b of every anchor n-gram in the cached sequence's candidate realignment window.
    starts: dict[tuple[int, ...], list[int]] = {}
    for b in range(1, max_span_tokens + 1):
        gram = tuple(cached_ids[prefix + b:prefix + b + anchor])
        if len(gram) < anchor:
            break
        starts.setdefault(gram, []).append(b)
    best: tuple[int, int, int, int] | None = None  # (m, -(a + b), a, b)
    for a in range(1, max_span_tokens + 1):
        if prefix + a + anchor > reusable_end:
            break
        for b in starts.get(tuple(request_ids[prefix + a:prefix + a + anchor]), ()):
            m = common_prefix_length(request_ids, cached_ids, a_start=prefix + a, b_start=prefix + b,
                                     limit=reusable_end - prefix - a)
            key = (m, -(a + b), a, b)
            if m >= min_reuse_tokens and (best is None or key > best):
                best = key
    if best is None:
        return None
    m, _, a, b = best
    return Alignment(tuple(cached_ids), prefix, a, b, m)


def _path_tokens(node: Any) -> list[int]:
    """Token ids from the root down to and including ``node``."""
    pieces = []
    while node is not None and node.parent is not None:
        pieces.append(node.token_ids)
        node = node.parent
    return [t for piece in reversed(pieces) for t in piece]


def _leaves(node: Any) -> Iterator[Any]:
    # Lazy, so a large subtree costs only the leaves actually examined.
    stack = [node]
    while stack:
        current = stack.pop()
        if current.children:
            stack.extend(current.children.values())
        else:
            yield current


def exact_match_length(prefix_cache: Any, request_ids: Sequence[int]) -> int:
    """Tokens of ``request_ids`` the radix tree holds token for token (a read-only walk)."""
    node, depth = prefix_cache.root, 0
    while depth < len(request_ids):
        child = node.children.get(request_ids[depth])
        if child is None:
            break
        common = common_prefix_length(child.token_ids, request_ids, b_start=depth)
        depth += common
        if common < len(child.token_ids):
            break
        node = child
    return depth


def candidate_sequences(prefix_cache: Any, request_ids: Sequence[int], max_candidates: int) -> list[tuple[int, ...]]:
    """Cached root-to-leaf sequences that branch off the request's path, deepest branch point first.

    Walks the radix tree over its public surface only (``root``, ``children``, ``token_ids``, ``parent``)
    and never changes it. At most ``max_candidates`` sequences are returned.
    """
    branches: list[tuple[int, Any]] = []  # (depth where the subtree leaves the request's path, subtree)
    node, depth = prefix_cache.root, 0
    while True:
        follow = node.children.get(request_ids[depth]) if depth < len(request_ids) else None
        branches.extend((depth, child) for child in node.children.values() if child is not follow)
        if follow is None:
            break
        common = common_prefix_length(follow.token_ids, request_ids, b_start=depth)
        if common < len(follow.token_ids):
            branches.append((depth + common, follow))  # the request leaves this edge part-way
            break
        depth += common
        node = follow
    out: list[tuple[int, ...]] = []
    for _, subtree in sorted(branches, key=lambda item: -item[0]):
        for leaf in _leaves(subtree):
            out.append(tuple(_path_tokens(leaf)))
            if len(out) >= max_candidates:
                return out
    return out


def find_alignment(
    prefix_cache: Any, request_ids: Sequence[int], config: ASKSConfig
) -> Alignment | None:
    """The best realignment of ``request_ids`` against any cached sequence (longest remainder).

    None unless it serves at least ``min_reuse_tokens`` more prompt tokens from the cache than the
    token-exact match does, so a prompt the cache already holds exactly keeps its exact KV.
    """
    best: Alignment | None = None
    for cached in candidate_sequences(prefix_cache, request_ids, config.max_candidates):
        found = align_after_prefix(request_ids, cached, config.max_span_tokens, config.min_reuse_tokens)
        if found is not None and (best is None or found.remainder_tokens > best.remainder_tokens):
            best = found
    if best is None:
        return None
    exact = min(exact_match_length(prefix_cache, request_ids), len(request_ids) - 1)
    if best.prefix_tokens + best.remainder_tokens - exact < config.min_reuse_tokens:
        return None
    return best


# -- similarity -----------------------------------------------------------------------------------
def layer_weights(num_layers: int, alpha: float) -> torch.Tensor:
    """``w_l = exp(alpha * l / L)`` for decoder layers ``l = 1..L``, shape ``(L,)``."""
    layers = torch.arange(1, num_layers + 1, dtype=torch.float64)
    return torch.exp(alpha * layers / num_layers)


def span_similarity(
    request_hidden: Sequence[torch.Tensor], cached_hidden: Sequence[torch.Tensor], alpha: float
) -> float:
    """Layer-weighted cosine similarity of two spans' mean-pooled hidden states.

    Args:
        request_hidden: Per decoder layer, the request span's states ``(1, a, d)`` or ``(a, d)``.
        cached_hidden: Per decoder layer, the cached span's states ``(1, b, d)`` or ``(b, d)``.
        alpha: Depth emphasis; 0 weighs all layers equally, larger values favour deeper layers.

    Returns:
        ``sigma`` in [-1, 1]; 1 when both spans pool to parallel states at every layer.
    """
    if len(request_hidden) != len(cached_hidden) or not request_hidden:
        raise ValueError("both spans need hidden states for the same, non-zero number of layers")
    cosines = []
    for h_req, h_cached in zip(request_hidden, cached_hidden):
        pooled_req = h_req.reshape(-1, h_req.shape[-1]).double().mean(0)  # (d,)
        pooled_cached = h_cached.reshape(-1, h_cached.shape[-1]).double().mean(0)
        cosines.append(torch.nn.functional.cosine_similarity(pooled_req, pooled_cached, dim=0))
    weights = layer_weights(len(cosines), alpha)
    return float((weights * torch.stack(cosines).cpu()).sum() / weights.sum())


# -- rotary re-rotation ---------------------------------------------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding_of(model: Any) -> Any | None:
    """The model's shared rotary embedding module (``model.model.rotary_emb``), or None."""
    inner = getattr(model, "model", None)
    return getattr(inner, "rotary_emb", None) or getattr(model, "rotary_emb", None)


def supports_asks(model: Any) -> bool:
    """Whether cached keys of ``model`` can be moved to new positions by a fixed rotation.

    Needs one shared rotary embedding over the whole head (``rotate_half`` layout, as in Llama,
    Mistral, Qwen and SmolLM) whose frequencies do not depend on the sequence length.
    """
    rotary = rotary_embedding_of(model)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return False
    if getattr(model.config, "model_type", "") in _INTERLEAVED_ROPE_MODEL_TYPES:
        return False
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return False
    return getattr(rotary, "rope_type", "default") not in _LENGTH_DEPENDENT_ROPE


def rerotate_keys(keys: torch.Tensor, shift: int, rotary_emb: Any) -> torch.Tensor:
    """Move post-RoPE keys ``shift`` positions along (negative moves them back).

    A key rotated for position ``p`` becomes the key rotated for ``p + shift``: RoPE rotates each
    frequency pair by ``position * inv_freq``, and rotations compose, so this is exact up to rounding.

    Args:
        keys: Post-RoPE keys ``(..., T, D)``.
        shift: Positions to add.
        rotary_emb: The model's rotary embedding module, called as ``rotary_emb(x, position_ids)``.
    """
    if shift == 0:
        return keys
    probe = torch.empty(0, device=keys.device, dtype=torch.float32)
    cos, sin = rotary_emb(probe, torch.tensor([[shift]], device=keys.device))  # (1, 1, D) each
    # The module folds an attention scaling into cos/sin; a pure rotation must leave it out, since
    # the cached keys already carry it once.
    scale = float(getattr(rotary_emb, "attention_scaling", 1.0) or 1.0)
    cos, sin = cos[0, 0] / scale, sin[0, 0] / scale  # (D,)
    rotated = keys.float() * cos + _rotate_half(keys.float()) * sin
    return rotated.to(keys.dtype)


# -- the prefill ----------------------------------------------------------------------------------
@dataclass
class ASKSPrefill:
    """A prompt prefilled by ASKS (reused or fallen back).

    Attributes:
        cache: Batch-1 ``DynamicCache`` holding the whole prompt's KV.
        last_logits: Logits of the last prompt position ``(1, V)``.
        decision: What ASKS did, for the completion and the counters.
        num_exact_tokens: Leading prompt tokens whose KV is exact (token-exact with a full recompute);
            only these may go into the radix cache.
        num_computed_tokens: Prompt tokens run through the model for this request.
        num_reused_tokens: Prompt tokens whose KV came from the cache (exact prefix plus reused remainder).
    """

    cache: Any
    last_logits: torch.Tensor
    decision: ASKSDecision
    num_exact_tokens: int
    num_computed_tokens: int
    num_reused_tokens: int

    @property
    def exact(self) -> bool:
        return self.num_exact_tokens == self.cache.get_seq_length()


Forward = Callable[..., Any]


def _cache_from_layers(layers: list[tuple[torch.Tensor, torch.Tensor]], model_config: Any) -> Any:
    return new_kv_cache(model_config, layers or None)


def _decoder_hidden(out: Any) -> list[torch.Tensor]:
    # hidden_states = (embeddings, layer 1, ..., layer L); keep the decoder layers' outputs.
    return list(out.hidden_states[1:])


def _prefix_cache(cached_kv: torch.Tensor, num_tokens: int, model_config: Any) -> Any:
    """A fresh cache holding the first ``num_tokens`` positions of ``cached_kv`` (L, 2, H_kv, T, D)."""
    return _cache_from_layers([(cached_kv[i, 0, :, :num_tokens][None], cached_kv[i, 1, :, :num_tokens][None])
                               for i in range(cached_kv.shape[0])], model_config)


def _run(forward: Forward, ids: Sequence[int], cache: Any, device: torch.device, **kwargs: Any) -> Any:
    return forward(torch.tensor([list(ids)], device=device), cache, logits_to_keep=1, **kwargs)


@dataclass(frozen=True)
class _DeviationProbe:
    """What the deviation probe measured over the remainder; zero tokens when it did not run."""

    tokens: int = 0
    mean: float | None = None
    max: float | None = None


_NOT_PROBED = _DeviationProbe()


@dataclass(frozen=True)
class _Attempt:
    """A request's prefill against one alignment once its span and the cached span are compared:
    what each way of finishing it (exactly, or reusing the remainder) reads."""

    prompt_ids: list[int]
    alignment: Alignment
    cached_kv: torch.Tensor  # (L, 2, H_kv, T, D), the cached sequence's KV
    forward: Forward
    model: Any
    config: ASKSConfig
    sigma: float

    def run(self, ids: Sequence[int], cache: Any) -> Any:
        """Run ``ids`` on top of ``cache``; the output's logits are the last position's."""
        return _run(self.forward, ids, cache, self.cached_kv.device)

    def reused_kv(self, layer: int, rotary: Any, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached remainder's KV (1, H_kv, T, D) from ``offset`` on, keys moved to the request's positions."""
        start = self.alignment.prefix_tokens + self.alignment.cached_span_tokens  # in the cached sequence
        stop = start + self.alignment.remainder_tokens
        keys = rerotate_keys(self.cached_kv[layer, 0, :, start + offset:stop][None], self.alignment.position_shift,
                             rotary)
        return keys, self.cached_kv[layer, 1, :, start + offset:stop][None]

    def decision(self, reused: bool, reused_tokens: int, recomputed_tokens: int,
                 probe: _DeviationProbe = _NOT_PROBED) -> ASKSDecision:
        alignment = self.alignment
        return ASKSDecision(
            reused=reused, sigma=self.sigma, tau=self.config.tau, prefix_tokens=alignment.prefix_tokens,
            request_span_tokens=alignment.request_span_tokens, cached_span_tokens=alignment.cached_span_tokens,
            remainder_tokens=alignment.remainder_tokens, position_shift=alignment.position_shift,
            reused_tokens=reused_tokens, recomputed_tokens=recomputed_tokens, check_tokens=alignment.cached_span_tokens,
            probe_tokens=probe.tokens, mean_deviation=probe.mean, max_deviation=probe.max,
        )


@torch.inference_mode()
def prefill_with_asks(
    prompt_ids: list[int],
    alignment: Alignment,
    cached_kv: torch.Tensor,
    forward: Forward,
    model: Any,
    config: ASKSConfig,
) -> ASKSPrefill:
    """Prefill ``prompt_ids`` against the cached sequence of ``alignment``.

    The request's span is computed exactly whatever happens; then the remainder is computed exactly
    (``_compute_rest_exactly``), or reused and repaired nearest-first (``_repair_nearest``) or where
    it deviates most (``_repair_by_deviation``).

    Args:
        prompt_ids: The request's token ids.
        alignment: Its realignment with a cached sequence (``find_alignment``).
        cached_kv: KV of the cached sequence, ``(L, 2, H_kv, T, D)`` with ``T >= k + b + m``.
        forward: ``forward(input_ids (1, T), cache, **kwargs)`` running the model on top of ``cache``.
        model: The ``transformers`` model (for its config and rotary embedding).
        config: ASKS settings (``tau``, ``alpha``, ``recompute_fraction``).
    """
    k, a, b, m = (alignment.prefix_tokens, alignment.request_span_tokens,
                  alignment.cached_span_tokens, alignment.remainder_tokens)
    device = cached_kv.device
    # The cached span's hidden states, recomputed over the exact shared prefix; its KV is thrown away.
    check_cache = _prefix_cache(cached_kv, k, model.config)
    cached_hidden = _decoder_hidden(_run(forward, alignment.cached_ids[k:k + b], check_cache, device,
                                         output_hidden_states=True))
    del check_cache
    # The request's span: exact KV that the request keeps whatever the decision.
    cache = _prefix_cache(cached_kv, k, model.config)
    out = _run(forward, prompt_ids[k:k + a], cache, device, output_hidden_states=True)
    sigma = span_similarity(_decoder_hidden(out), cached_hidden, config.alpha)
    attempt = _Attempt(prompt_ids, alignment, cached_kv, forward, model, config, sigma)
    if max(sigma, 0.0) < config.tau:  # a negative similarity counts as 0, so tau = 0 always reuses
        return _compute_rest_exactly(attempt, cache)
    num_recomputed = min(m, int(round(config.recompute_fraction * m)))
    if num_recomputed == m:  # recomputing all of it is the exact path
        return _compute_rest_exactly(attempt, cache)
    # On a model of at most two layers the probe would be a whole pass: repair nearest-first there.
    if config.recompute_selection == "nearest" or len(cache.layers) <= PROBE_LAYER + 1:
        return _repair_nearest(attempt, cache, num_recomputed)
    return _repair_by_deviation(attempt, cache, num_recomputed)


def _compute_rest_exactly(attempt: _Attempt, cache: Any, probe: _DeviationProbe = _NOT_PROBED) -> ASKSPrefill:
    """The fallback: the rest of the prompt computed exactly on top of the exact prefix and span in
    ``cache``; the whole prompt's KV is exact."""
    prompt_ids, k = attempt.prompt_ids, attempt.alignment.prefix_tokens
    out = attempt.run(prompt_ids[k + attempt.alignment.request_span_tokens:], cache)
    decision = attempt.decision(False, 0, attempt.alignment.remainder_tokens, probe)
    return ASKSPrefill(cache, out.logits[:, -1, :], decision, len(prompt_ids), len(prompt_ids) - k, k)


def _repair_nearest(attempt: _Attempt, cache: Any, num_recomputed: int) -> ASKSPrefill:
    """Reuse the remainder, its first ``num_recomputed`` tokens (those right after the span)
    recomputed exactly, unprobed."""
    prompt_ids, k, a = attempt.prompt_ids, attempt.alignment.prefix_tokens, attempt.alignment.request_span_tokens
    if num_recomputed:
        attempt.run(prompt_ids[k + a:k + a + num_recomputed], cache)
    rotary = rotary_embedding_of(attempt.model)
    layers = []
    for i, layer in enumerate(cache.layers):
        keys, values = attempt.reused_kv(i, rotary, num_recomputed)
        layers.append((torch.cat((layer.keys, keys), dim=-2), torch.cat((layer.values, values), dim=-2)))
    cache = _cache_from_layers(layers, attempt.model.config)
    return _prefill_after_remainder(attempt, cache, num_recomputed, k + a + num_recomputed, _NOT_PROBED)


def _repair_by_deviation(attempt: _Attempt, cache: Any, num_recomputed: int) -> ASKSPrefill:
    """Run the remainder through the layers up to ``PROBE_LAYER`` (their KV exact), measure each
    token's deviation there, and recompute the ``num_recomputed`` most-deviating tokens through every
    layer; a remainder that deviates too much on average is computed exactly instead."""
    prompt_ids, k, a = attempt.prompt_ids, attempt.alignment.prefix_tokens, attempt.alignment.request_span_tokens
    m = attempt.alignment.remainder_tokens
    rotary = rotary_embedding_of(attempt.model)
    run_first_layers(attempt.forward, attempt.model, prompt_ids[k + a:k + a + m], cache, PROBE_LAYER)
    fresh_keys, fresh_values = (t[0, :, k + a:] for t in (cache.layers[PROBE_LAYER].keys,
                                                          cache.layers[PROBE_LAYER].values))
    old_keys, old_values = (t[0] for t in attempt.reused_kv(PROBE_LAYER, rotary))
    deviation = kv_deviation(fresh_keys, fresh_values, old_keys, old_values)  # (m,)
    probe = _DeviationProbe(m, float(deviation.mean()), float(deviation.max()))
    if probe.mean > attempt.config.max_mean_deviation:
        roll_back(cache, [k + a] * len(cache.layers))  # forget the probed layers' remainder
        return _compute_rest_exactly(attempt, cache, probe)
    # Layers up to the probe now hold the remainder's exact KV; the deeper ones take the reused KV.
    layers = []
    for i, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values
        if i > PROBE_LAYER:
            reused_keys, reused_values = attempt.reused_kv(i, rotary)
            keys, values = torch.cat((keys, reused_keys), dim=-2), torch.cat((values, reused_values), dim=-2)
        layers.append((keys, values))
    cache = _cache_from_layers(layers, attempt.model.config)
    if num_recomputed:
        chosen = torch.topk(deviation, num_recomputed).indices.sort().values + (k + a)  # positions
        recompute_positions(attempt.forward, attempt.model, prompt_ids, chosen, cache)
    return _prefill_after_remainder(attempt, cache, num_recomputed, k + a, probe)


def _prefill_after_remainder(attempt: _Attempt, cache: Any, num_recomputed: int, num_exact_tokens: int,
                             probe: _DeviationProbe) -> ASKSPrefill:
    """Prefill the prompt's tail after the remainder on top of ``cache``, which holds the exact prefix
    and span and the (repaired) reused remainder."""
    prompt_ids, alignment = attempt.prompt_ids, attempt.alignment
    k, m = alignment.prefix_tokens, alignment.remainder_tokens
    reused = m - num_recomputed
    out = attempt.run(prompt_ids[k + alignment.request_span_tokens + m:], cache)
    return ASKSPrefill(cache, out.logits[:, -1, :], attempt.decision(True, reused, num_recomputed, probe),
                       num_exact_tokens, len(prompt_ids) - k - reused, k + reused)


# -- deviation probe and selective recompute ------------------------------------------------------
# The first decoder layer's KV depends only on each token and its position, so reused KV is exact
# there; the second layer's is the first that carries the changed span's influence.
PROBE_LAYER = 1


class _StopAfterLayer(Exception):
    """Raised from a layer hook to end a forward pass once the layers it needs have run."""


@contextmanager
def stop_after_layer(model: Any, last_layer: int) -> Iterator[None]:
    """Within the block, a forward pass of ``model`` ends quietly after decoder layer ``last_layer``:
    the layers up to it have run (and cached their KV), the deeper ones have not."""

    def stop(*_: Any) -> None:
        raise _StopAfterLayer

    handle = decoder_parts(model)[0][last_layer].register_forward_hook(stop)
    try:
        yield
    except _StopAfterLayer:
        pass
    finally:
        handle.remove()


def run_first_layers(forward: Forward, model: Any, ids: Sequence[int], cache: Any, last_layer: int) -> None:
    """Run ``ids`` on top of ``cache`` through decoder layers ``0..last_layer`` only; those layers of
    ``cache`` gain the tokens' (exact) KV, the deeper layers are left as they were."""
    with stop_after_layer(model, last_layer):
        forward(torch.tensor([list(ids)], device=cache.layers[0].keys.device), cache, logits_to_keep=1)


def kv_deviation(
    keys: torch.Tensor, values: torch.Tensor, reused_keys: torch.Tensor, reused_values: torch.Tensor
) -> torch.Tensor:
    """Per token, ``||kv_reused - kv_exact|| / ||kv_exact||`` over all KV heads; inputs ``(H_kv, T, D)``,
    output ``(T,)``."""
    exact = keys.double().square().sum((0, 2)) + values.double().square().sum((0, 2))
    diff = (reused_keys.double() - keys.double()).square().sum((0, 2)) \
        + (reused_values.double() - values.double()).square().sum((0, 2))
    return (diff / exact.clamp_min(1e-30)).sqrt()


def recompute_positions(forward: Forward, model: Any, prompt_ids: Sequence[int], positions: torch.Tensor,
                        cache: Any) -> None:
    """Recompute the KV of the prompt tokens at ``positions`` (sorted, all inside ``cache``) through
    every layer and write it over the cached KV there.

    The tokens run as one pass at their own positions. A custom 4D mask lets each see the cache
    before its position, except the old KV of the tokens being recomputed (their new KV, appended
    after the cache by the pass, takes its place), so the result is what a left-to-right prefill
    would give if the rest of the cache were exact."""
    length = cache.get_seq_length()
    mask = scattered_mask(length, positions, next(model.parameters()).dtype)
    ids = torch.tensor([[prompt_ids[p] for p in positions.tolist()]], device=positions.device)
    forward(ids, cache, logits_to_keep=1, position_ids=positions[None], attention_mask=mask)
    for layer in cache.layers:
        layer.keys[:, :, positions] = layer.keys[:, :, length:]
        layer.values[:, :, positions] = layer.values[:, :, length:]
    roll_back(cache, [length] * len(cache.layers))  # drop the appended copies


def scattered_mask(length: int, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 4D additive mask for re-running the tokens at ``positions`` (sorted, inside a cache of
    ``length``) as one pass appended after the cache: each sees the cache before its position except
    the old KV of the re-run tokens, whose new KV (appended after the cache) takes its place."""
    count, device = positions.numel(), positions.device
    before = torch.arange(length, device=device)[None, :] < positions[:, None]  # (r, T)
    before[:, positions] = False
    among_new = positions[None, :] <= positions[:, None]  # (r, r)
    visible = torch.cat((before, among_new), dim=1)
    mask = torch.zeros(1, 1, count, length + count, dtype=dtype, device=device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)
