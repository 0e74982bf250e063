"""How one prompt's KV is computed, three ways, each through ``PrefixAccess`` (which holds the radix
cache's locks):

* ``prefill_exact``: token-exact. The longest cached prefix comes from the radix cache; the rest is
  computed in passes whose size the caller hands in between them, so long prompts are prefilled a
  step at a time while other requests decode.
* ``prefill_reusing_asks``: ASKS (``kvcache.asks``) reuses the KV of a cached sequence that the
  prompt realigns with after a short differing span.
* ``prefill_reusing_retrieved_chunks``: retrieved documents' KV (``kvcache.chunk_reuse``), cached
  each on its own, reused wherever they appear in a later prompt.

The two reuse paths are approximate, and answer None when they do not act, so the exact one runs.
Prompts prefilled together in one forward are ``packed_prefill``'s.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from ..kvcache import asks, chunk_reuse
from .prefix_access import Prefilled, PrefixAccess, run_to_end, stack_kv


def prefill_exact(access: PrefixAccess, token_ids: list[int], pass_tokens: int | None
                  ) -> Generator[int, int | None, Prefilled]:
    """Token-exact prefill of ``token_ids``: the longest cached prefix from the radix cache (always
    leaving the last token to compute, for its logits), the rest computed in passes, and the whole
    sequence's KV inserted into the radix cache (when it is on).

    A generator: after each pass but the last it yields the tokens that pass computed and receives
    the size of the next (``send(budget)``: at most that many new tokens; None, or ``next()``: all
    that is left). ``pass_tokens`` sizes the first pass the same way. It returns the ``Prefilled``.
    The matched prefix stays locked until it returns or is closed. It counts nothing: a prompt's
    prefill and a retrieved chunk cached for reuse are counted differently, by the callers."""
    cache, matched, node = access.cache_for_prefix(token_ids)
    # A snapshot is taken after all tokens but the last, as the radix cache leaves the last one
    # to compute: the pass that would cover that point stops there.
    snapshots = access.snapshots
    snapshot_at = len(token_ids) - 1 if snapshots is not None and matched < len(token_ids) - 1 else None
    try:
        position, limit = matched, pass_tokens
        while True:
            end = len(token_ids) if limit is None else min(len(token_ids), position + max(1, limit))
            if snapshot_at is not None and position < snapshot_at < end:
                end = snapshot_at
            with torch.inference_mode():
                input_ids = torch.tensor([token_ids[position:end]], device=access.runner.device)
                out = access.runner.forward(input_ids, cache, logits_to_keep=1)
            computed, position = end - position, end
            if snapshots is not None and position == snapshot_at:
                snapshots.insert(token_ids[:position], cache)
            if position == len(token_ids):
                break
            limit = yield computed  # outside inference_mode: the caller's code runs between passes
        with torch.inference_mode():
            if access.cacheable:
                access.prefix_cache.insert(token_ids, stack_kv(cache), computed_from=matched)
    finally:
        if node is not None:
            access.unlock(node)
    return Prefilled(token_ids, cache, out.logits[:, -1, :], matched)


def prefill_reusing_asks(access: PrefixAccess, prompt_ids: list[int]) -> Prefilled | None:
    """Prefill through ASKS (``config.asks``, ``kvcache.asks``) when the prompt realigns with a
    cached sequence after a short differing span; None when ASKS does not act (off, ``tau = 1``,
    unsupported model, or no realignment), so the token-exact path runs unchanged.

    Only the exact part of the prompt's KV is inserted into the radix cache: all of it after a
    fallback, the shared prefix and the request's own span after a reuse."""
    config, model, cache = access.asks_config, access.runner.model, access.prefix_cache
    if not (config.enabled and config.tau < 1.0 and access.cacheable and asks.supports_asks(model)):
        return None
    alignment = asks.find_alignment(cache, prompt_ids, config)
    if alignment is None:
        return None
    match = cache.match_prefix(list(alignment.cached_ids))
    needed = alignment.prefix_tokens + alignment.cached_span_tokens + alignment.remainder_tokens
    # ASKS computes the request's span at the shared prefix's end, whose window may reach KV
    # freed out of the cached sequence's own window.
    if match.num_tokens < needed or match.window_freed:
        return None
    with access.holding() as held:
        held.lock(match.last_node)
        result = asks.prefill_with_asks(prompt_ids, alignment, match.kv, access.runner.forward, model, config)
        exact_kv = stack_kv(result.cache)[:, :, :, :result.num_exact_tokens]  # (L, 2, H_kv, T, D)
        cache.insert(prompt_ids[:result.num_exact_tokens], exact_kv)
    decision = result.decision
    access.count_prefill(result.num_computed_tokens, result.num_reused_tokens)
    count = access.counters.count
    count("asks_checks")
    count("asks_reuses", int(decision.reused))
    count("asks_reused_tokens", decision.reused_tokens)
    count("asks_recomputed_tokens", decision.recomputed_tokens)
    count("asks_check_tokens", decision.check_tokens)
    return Prefilled(prompt_ids, result.cache, result.last_logits, result.num_reused_tokens,
                     exact=result.exact, asks=decision)


def prefill_reusing_retrieved_chunks(access: PrefixAccess, prompt_ids: list[int],
                                     context_spans: Sequence[tuple[int, int]]) -> Prefilled | None:
    """Prefill with retrieved chunks' KV reused at their positions in this prompt
    (``kvcache.chunk_reuse``); None when no chunk can be reused, so the other paths run.

    ``context_spans`` tile the prompt, cut at ``asks.chunk_separator``. Each span between the first
    and the last is a chunk, cached as ``header + chunk`` (the header being the prompt's first span)
    in the radix cache and prefilled that way the first time it is seen. The last span (the
    question) may start with a cached chunk; that part is reused too. Only the exact part, the
    prompt up to the first reused chunk, is inserted."""
    config, model, cache = access.asks_config, access.runner.model, access.prefix_cache
    if not (config.enabled and config.reuse_chunks and access.cacheable and asks.supports_asks(model)):
        return None
    if len(context_spans) < 3 or config.recompute_fraction >= 1.0:  # nothing between header and question, or exact
        return None
    anchor = prompt_ids[:context_spans[0][1]]  # the header: chunks are cached as computed right after it
    last = len(prompt_ids) - 1  # the last prompt token is always computed: it gives the logits
    candidates = [(start, min(end, last)) for start, end in context_spans[1:]
                  if min(end, last) - start >= config.min_reuse_tokens]
    cached_tokens = 0
    cached_chunks = 0
    for start, end in candidates:
        if end <= context_spans[-1][0]:  # a middle span: cache it on its own the first time it is seen
            computed = cache_sequence(access, anchor + prompt_ids[start:end])
            cached_tokens += computed
            cached_chunks += computed > 0
    # The first chunk is now a token-exact continuation of the header; whatever the radix cache
    # matches exactly is served exact, and only the chunks after it are reused.
    exact = cache.match_prefix(prompt_ids, max_tokens=last)
    if exact.window_freed:  # the chunks' passes read the prefix at every position, not its last window
        return None
    candidates = [(start, end) for start, end in candidates if start >= exact.num_tokens]
    count = access.counters.count
    count("prompt_tokens_computed", cached_tokens)
    count("chunk_tokens_cached", cached_tokens)
    with access.holding() as held:
        chunks = []
        for start, end in candidates:
            found = cache.match_prefix(anchor + prompt_ids[start:end])
            size = found.num_tokens - len(anchor)
            if size < config.min_reuse_tokens or found.window_freed:
                # Evicted since, a question span that does not start with a chunk, or a chunk
                # whose sliding-window KV was freed: it is read at other positions, in full.
                continue
            held.lock(found.last_node)
            chunks.append(chunk_reuse.ReusedChunk(start, found.kv[:, :, :, len(anchor):], len(anchor)))
        if not chunks:
            return None
        prefix, matched, node = access.cache_for_prefix(prompt_ids[:chunks[0].start + 1])
        held.keep(node)
        result = chunk_reuse.prefill_with_chunks(
            prompt_ids, prefix, chunks, access.runner.forward, model, config,
            num_segments=len(context_spans), num_cached_chunks=cached_chunks)
        exact_kv = stack_kv(result.cache)[:, :, :, :result.num_exact_tokens]
        cache.insert(prompt_ids[:result.num_exact_tokens], exact_kv)
    decision = result.decision
    reused = matched + decision.reused_tokens
    access.count_prefill(result.num_computed_tokens, reused)
    count("chunk_reuse_prompts", int(decision.reused))
    count("chunks_reused", decision.chunks_reused)
    count("chunk_recomputed_tokens", decision.recomputed_tokens)
    count("chunk_probe_tokens", decision.probe_tokens)
    return Prefilled(prompt_ids, result.cache, result.last_logits, reused, exact=result.exact, asks=decision)


def cache_sequence(access: PrefixAccess, token_ids: list[int]) -> int:
    """Make sure the radix cache holds ``token_ids`` (prefilling what it lacks on top of what it
    has); returns the tokens computed. Only the KV is wanted, not the logits."""
    if access.prefix_cache.match_prefix(token_ids).num_tokens == len(token_ids):
        return 0
    # At least the last token is missing, so the exact prefill's match, which always leaves the
    # last token to compute, still reuses everything the cache holds of ``token_ids``.
    prefilled = run_to_end(prefill_exact(access, token_ids, None))
    return len(token_ids) - prefilled.num_cached_tokens
