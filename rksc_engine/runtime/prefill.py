"""Prefill: a prompt's KV, computed once, its longest cached prefix served by the radix cache.

This module owns every path into and out of the radix cache while requests run, and so every radix
lock: the token-exact prefill (chunked or whole), ASKS and retrieved-chunk reuse, the prompt a
running request reads in place, the prefix lent to a verifier pass, and a finished answer's KV
kept for the next turn of a chat. A node locked here is unlocked here.

Callers hold the engine lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..config import ASKSConfig
from ..kvcache import asks, chunk_reuse
from ..kvcache.cache_layers import has_sliding_layers
from ..kvcache.memory import ForwardOutOfMemoryError, is_out_of_memory
from ..kvcache.probe import logit_tolerance
from ..kvcache.radix import RadixPrefixCache
from ..kvcache.shared_prefix import SharedPrefixCache
from ..kvcache.state_snapshots import StateSnapshots
from ..results import ASKSDecision, ChunkReuseDecision
from .model_runner import ModelRunner
from .stats import Counters

T = TypeVar("T")
# A chunk budget: tokens per pass, None for one pass, or a callable asked before each pass.
ChunkTokens = int | Callable[[], int] | None


class PackedPrefillMismatch(RuntimeError):
    """A packed prefill's logits differed from the same prompt prefilled alone (the model does not
    honour the packed mask or positions); packing is then off for the engine."""


@dataclass
class Prefilled:
    """A prompt whose KV is computed: the batch-1 cache and the logits of its last position.

    Attributes:
        prompt_ids: The prompt's token ids.
        cache: A batch-1 ``transformers`` ``DynamicCache`` holding the whole prompt's KV (the
            caller's own; the prefix cache keeps its own copy of the exact part).
        last_logits: (1, V) next-token logits after the prompt.
        num_cached_tokens: Prompt tokens served by the prefix cache instead of computed.
        exact: False when ASKS reused approximate KV.
        asks: What ASKS did, None when it did not act.
    """

    prompt_ids: list[int]
    cache: Any  # transformers DynamicCache, batch 1
    last_logits: torch.Tensor  # (1, V)
    num_cached_tokens: int
    # False when ASKS reused approximate KV: then nothing past the prompt's exact part, and nothing
    # decoded on top of it, may go into the token-exact prefix cache.
    exact: bool = True
    asks: ASKSDecision | ChunkReuseDecision | None = None  # what ASKS did, None when it did not act


@dataclass
class PromptInPlace:
    """A running request's prompt read in place from the radix cache (see ``Prefiller.read_in_place``).

    Attributes:
        segments: Per layer, the prompt's KV segments ``(keys, values)``, each (1, H_kv, t, D).
        locked_node: The radix node locked for the request's life (``Prefiller.unlock`` it).
        num_private_segments: Trailing segments the request holds itself (a tail the cache had no room for).
    """

    segments: list[list[tuple[torch.Tensor, torch.Tensor]]]
    locked_node: Any
    num_private_segments: int


class CachedPrefix:
    """What ``Prefiller.lend`` lends: a cache holding a prompt's cached prefix.

    Attributes:
        cache: A batch-1 ``transformers`` cache of the matched prefix (the caller may repeat its rows).
        num_tokens: Tokens of the prefix it holds.
        computed_tokens / reused_tokens: What the caller's passes computed and reused; counted when
            the block ends.
    """

    def __init__(self, runner: ModelRunner, cache: Any, num_tokens: int) -> None:
        self._runner = runner
        self.cache = cache
        self.num_tokens = num_tokens
        self.computed_tokens = 0
        self.reused_tokens = 0

    def run_decoder(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder body (no LM head) over ``input_ids`` (B, T) after the cache; returns the final
        hidden states (B, T, hidden). Out of memory: rolled back and retried like any engine pass."""
        return self._runner.run_decoder(input_ids, self.cache)


class Prefiller:
    """Computes prompts' KV through the radix cache (see the module docstring).

    Args:
        runner: Runs the passes.
        prefix_cache: The radix cache.
        asks_config: ASKS and retrieved-chunk reuse settings.
        cacheable: Whether the radix cache is in use (configured on, and the model's cache layers allow it).
        counters: Where prompt tokens computed and reused, hits and ASKS decisions are counted.
        snapshots: Prompt-state snapshots for a model the radix cache cannot hold, or None.
    """

    def __init__(self, runner: ModelRunner, prefix_cache: RadixPrefixCache, asks_config: ASKSConfig,
                 cacheable: bool, counters: Counters, snapshots: StateSnapshots | None = None) -> None:
        self.runner = runner
        self.prefix_cache = prefix_cache
        # For a model the radix cache cannot hold (recurrent layers): its prompts' states.
        self.snapshots = snapshots
        self.asks_config = asks_config
        self.cacheable = cacheable
        self.counters = counters
        self._packs_prompts: bool | None = None
        self._packing_checked = False

    # -- prompts --------------------------------------------------------------------------------
    def prefill(self, prompt_ids: list[int]) -> Prefilled:
        """The whole prompt's KV in one pass (its cached prefix served by the radix cache)."""
        return run_to_end(self.prefill_steps(prompt_ids, None))

    def warm(self, prompt_ids: list[int]) -> int:
        """Compute ``prompt_ids``' KV into the radix cache; returns the prompt tokens computed."""
        before = self.counters.totals.prompt_tokens_computed
        self.prefill(prompt_ids)
        return self.counters.totals.prompt_tokens_computed - before

    def prefill_steps(self, prompt_ids: list[int], chunk_tokens: ChunkTokens,
                      segments: Sequence[tuple[int, int]] | None = None) -> Generator[int, None, Prefilled]:
        """Prefill ``prompt_ids`` in passes of at most ``chunk_tokens`` new tokens (one pass when None;
        a callable is asked before each pass, so the scheduler can hand each pass what is left of its
        step's token budget).

        A generator: it yields the tokens each pass computed, between passes, so the scheduler can
        decode other requests in between, and returns the ``Prefilled``. The matched prefix stays
        locked until it returns or is closed (``close()`` on a cancelled request unlocks it).
        ``segments`` (the prompt cut at ``asks.chunk_separator``) let retrieved chunks be reused."""
        with torch.inference_mode():
            prefilled = self._prefill_with_chunks(prompt_ids, segments) if segments else None
            if prefilled is None:
                prefilled = self._prefill_with_asks(prompt_ids)
        if prefilled is not None:
            return prefilled
        prefilled = yield from self._prefill_exact(prompt_ids, chunk_tokens)
        matched = prefilled.num_cached_tokens
        self._count_prefill(len(prompt_ids) - matched, matched)
        return prefilled

    def _count_prefill(self, computed: int, reused: int) -> None:
        """Count one prompt's prefill: its tokens computed and reused, and a cache hit or miss."""
        count = self.counters.count
        count("prefills")
        count("prompt_tokens_computed", computed)
        count("prompt_tokens_reused", reused)
        count("cache_hits" if reused else "cache_misses")

    def _prefill_exact(self, token_ids: list[int], chunk_tokens: ChunkTokens) -> Generator[int, None, Prefilled]:
        """Token-exact prefill of ``token_ids``: the longest cached prefix from the radix cache (always
        leaving the last token to compute, for its logits), the rest computed in passes of at most
        ``chunk_tokens`` new tokens (one pass when None), and the whole sequence's KV inserted into the
        radix cache (when it is on).

        A generator like ``prefill_steps``. It counts nothing: a prompt's prefill and a retrieved
        chunk cached for reuse are counted differently, by the callers."""
        cache, matched, node = self.cache_for_prefix(token_ids)
        # A snapshot is taken after all tokens but the last, as the radix cache leaves the last one
        # to compute: the pass that would cover that point stops there.
        snapshot_at = len(token_ids) - 1 if self.snapshots is not None and matched < len(token_ids) - 1 else None
        try:
            position = matched
            while True:
                limit = chunk_tokens() if callable(chunk_tokens) else chunk_tokens
                end = len(token_ids) if limit is None else min(len(token_ids), position + max(1, limit))
                if snapshot_at is not None and position < snapshot_at < end:
                    end = snapshot_at
                with torch.inference_mode():
                    input_ids = torch.tensor([token_ids[position:end]], device=self.runner.device)
                    out = self.runner.forward(input_ids, cache, logits_to_keep=1)
                computed, position = end - position, end
                if position == snapshot_at:
                    self.snapshots.insert(token_ids[:position], cache)
                if position == len(token_ids):
                    break
                yield computed  # outside inference_mode: the caller's code runs between passes
            with torch.inference_mode():
                if self.cacheable:
                    self.prefix_cache.insert(token_ids, stack_kv(cache), computed_from=matched)
        finally:
            if node is not None:
                self.prefix_cache.unlock(node)
        return Prefilled(token_ids, cache, out.logits[:, -1, :], matched)

    def packs_prompts(self) -> bool:
        """Whether ``prefill_packed`` may serve prompts here: every prompt takes the token-exact path
        (ASKS cannot act), the model's cache layers keep the whole prefix, and no layer has a sliding
        window (the packed mask is one for every layer, so it cannot carry a window)."""
        if self._packs_prompts is None:  # the model and the settings are fixed for the engine's life
            config = self.asks_config
            asks_may_act = config.enabled and config.tau < 1.0 and self.cacheable
            self._packs_prompts = (not asks_may_act and self.runner.supports_prefix_cache()
                                   and not has_sliding_layers(self.runner.model.config))
        return self._packs_prompts

    def prefill_packed(self, prompts: Sequence[list[int]], max_context_tokens: int | None = None) -> list[Prefilled]:
        """Several prompts' KV in one forward: each prompt's longest cached prefix served by the radix
        cache, and every prompt's remaining tokens packed into one row, each token attending to its
        own prompt only (a block-diagonal causal mask) at its own positions. The linear layers read
        their weights once for all prompts instead of once per prompt.

        Token-exact like ``prefill``; the bits may differ from a prompt prefilled alone, as a batched
        matmul's do. Counted like as many ``prefill`` calls. Callers use it only where
        ``packs_prompts()`` holds and give prompts that share no uncached prefix (each would compute
        it again).

        The first packed forward is checked against the first prompt prefilled alone: a model that
        does not honour the mask or the positions gets a ``PackedPrefillMismatch``, and packing is
        off for this engine from then on (``packs_prompts()`` turns False); so it is after a packed
        forward fails for any reason but running out of memory.

        ``max_context_tokens`` bounds what one forward attends to (the prompts' cached prefixes, a
        prefix several prompts share counted once, plus their new tokens): the mask and the packed
        copy of the prefixes grow with it. Prompts beyond it go into further forwards."""
        if len(prompts) < 1:
            raise ValueError("prefill_packed needs at least one prompt")
        if max_context_tokens is not None and max_context_tokens < 1:
            raise ValueError(f"max_context_tokens must be >= 1, got {max_context_tokens}")
        prompts = [list(p) for p in prompts]
        matches = self.match_prompts(prompts)
        prefilled: list[Prefilled] = []
        try:
            with torch.inference_mode():
                for group in _context_groups(prompts, matches, max_context_tokens):
                    try:
                        results = self._packed_pass([prompts[i] for i in group], [matches[i] for i in group])
                    except Exception as error:
                        if not isinstance(error, ForwardOutOfMemoryError) and not is_out_of_memory(error):
                            # the model cannot take a packed pass: stop trying
                            self._packs_prompts = False
                            self.counters.count("packed_prefill_disabled")
                        raise
                    if not self._packing_checked:
                        self._check_packing(results[0])
                    prefilled += results
                    self.counters.count("packed_prefills")
                self._cache_and_count(prefilled)
        finally:
            self.release_prompts(matches)
        return prefilled

    def _cache_and_count(self, prefilled: Sequence[Prefilled]) -> None:
        """Insert prompts prefilled together into the radix cache (while their matched nodes are still
        locked), then count each as a ``prefill`` call."""
        if self.cacheable:
            for result in prefilled:
                self.prefix_cache.insert(result.prompt_ids, stack_kv(result.cache),
                                         computed_from=result.num_cached_tokens)
        for result in prefilled:
            self._count_prefill(len(result.prompt_ids) - result.num_cached_tokens, result.num_cached_tokens)

    def _check_packing(self, packed: Prefilled) -> None:
        """Compare one packed prompt's last logits with the same prompt prefilled alone, once."""
        diff, tolerance = self.difference_from_alone(packed)
        if not diff <= tolerance:  # also catches NaN
            self._packs_prompts = False
            self.counters.count("packed_prefill_disabled")
            raise PackedPrefillMismatch(
                f"packed prefill changed the logits by {diff:.3g} (> {tolerance:.3g}): this model does not honour "
                "a packed mask or positions, so prompts are prefilled one by one from now on")
        self._packing_checked = True

    def difference_from_alone(self, prefilled: Prefilled) -> tuple[float, float]:
        """How far ``prefilled``'s last logits are from its prompt prefilled alone in a fresh cache,
        and how far rounding alone may take them (``logit_tolerance``)."""
        alone = self.runner.forward(torch.tensor([prefilled.prompt_ids], device=self.runner.device),
                                    self.runner.new_cache(), logits_to_keep=1)
        want, got = alone.logits[:, -1].float(), prefilled.last_logits.float()
        return float((got - want).abs().max()), logit_tolerance(want, self.runner.dtype)

    # -- prompts prefilled inside a decode step ---------------------------------------------------
    def match_prompts(self, prompts: Sequence[list[int]]) -> list[tuple[Any, int, Any]]:
        """Each prompt's longest cached prefix (``cache_for_prefix``: cache, tokens, node), for a
        caller that computes the rest in a forward of its own (the scheduler's decode step). The
        nodes stay locked until ``release_prompts``."""
        matches: list[tuple[Any, int, Any]] = []
        try:
            for prompt_ids in prompts:
                matches.append(self.cache_for_prefix(list(prompt_ids)))
        except BaseException:
            self.release_prompts(matches)
            raise
        return matches

    def release_prompts(self, matches: Sequence[tuple[Any, int, Any]]) -> None:
        """Unlock what ``match_prompts`` locked."""
        for _, _, node in matches:
            if node is not None:
                self.prefix_cache.unlock(node)

    def finish_prompts(self, prompts: Sequence[list[int]], matches: Sequence[tuple[Any, int, Any]],
                       new_kv: Sequence[list[tuple[torch.Tensor, torch.Tensor]]], last_logits: torch.Tensor
                       ) -> list[Prefilled]:
        """The ``Prefilled`` of prompts whose uncached tokens another forward computed: each prompt's
        cached prefix (``matches``) joined with its new KV (``new_kv``, per layer (1, H_kv, T, D)),
        inserted into the radix cache and counted like ``prefill``. ``last_logits`` (prompts, V)."""
        results = []
        for index, (prompt_ids, (cached, matched, _), layers) in enumerate(zip(prompts, matches, new_kv)):
            if matched:
                kv = [(torch.cat([old.keys, keys], dim=2), torch.cat([old.values, values], dim=2))
                      for old, (keys, values) in zip(cached.layers, layers)]
            else:  # a copy: the new KV is a view of the whole step's projections
                kv = [(keys.clone(), values.clone()) for keys, values in layers]
            cache = self.runner.new_cache(kv)
            results.append(Prefilled(list(prompt_ids), cache, last_logits[index:index + 1], matched))
        self._cache_and_count(results)
        return results

    def _packed_pass(self, prompts: list[list[int]], matches: list[tuple[Any, int, Any]]) -> list[Prefilled]:
        device, dtype = self.runner.device, self.runner.dtype
        matched = [m for _, m, _ in matches]
        new_tokens = [prompt[m:] for prompt, m in zip(prompts, matched)]
        # The packed cache: the prompts' cached prefixes one after another, a prefix that several
        # prompts matched to the same radix node held once.
        prefix_starts: list[int] = []
        unique: dict[tuple[int, int], int] = {}
        sources: list[Any] = []
        num_prefix = 0
        for cache, m, node in matches:
            key = (id(node), m)
            if m and key not in unique:
                unique[key] = num_prefix
                sources.append(cache)
                num_prefix += m
            prefix_starts.append(unique.get(key, 0))
        num_new = sum(len(t) for t in new_tokens)
        if sources:
            num_layers = len(sources[0].layers)
            layers = [(torch.cat([c.layers[i].keys for c in sources], dim=2),
                       torch.cat([c.layers[i].values for c in sources], dim=2)) for i in range(num_layers)]
            packed = self.runner.new_cache(layers)
        else:
            packed = self.runner.new_cache()
        visible = torch.zeros(num_new, num_prefix + num_new, dtype=torch.bool, device=device)
        positions, last_rows = [], []
        new_start = 0
        for m, tokens, prefix_start in zip(matched, new_tokens, prefix_starts):
            rows = slice(new_start, new_start + len(tokens))
            visible[rows, prefix_start:prefix_start + m] = True
            visible[rows, num_prefix + new_start:num_prefix + new_start + len(tokens)] = torch.ones(
                len(tokens), len(tokens), dtype=torch.bool, device=device).tril()
            positions.append(torch.arange(m, m + len(tokens), device=device))
            last_rows.append(new_start + len(tokens) - 1)
            new_start += len(tokens)
        mask = torch.zeros(1, 1, num_new, num_prefix + num_new, dtype=dtype, device=device)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        input_ids = torch.tensor([[t for tokens in new_tokens for t in tokens]], device=device)
        out = self.runner.forward(input_ids, packed, logits_to_keep=torch.tensor(last_rows, device=device),
                                  position_ids=torch.cat(positions)[None], attention_mask=mask)
        logits = out.logits[0]  # (prompts, V)
        results = []
        new_start = 0
        for index, (prompt, m, tokens, prefix_start) in enumerate(zip(prompts, matched, new_tokens, prefix_starts)):
            spans = [(prefix_start, prefix_start + m), (num_prefix + new_start, num_prefix + new_start + len(tokens))]
            layers = [(torch.cat([layer.keys[:, :, a:b] for a, b in spans if b > a], dim=2),
                       torch.cat([layer.values[:, :, a:b] for a, b in spans if b > a], dim=2))
                      for layer in packed.layers]
            cache = self.runner.new_cache(layers)
            results.append(Prefilled(prompt, cache, logits[index:index + 1], m))
            new_start += len(tokens)
        return results

    def _prefill_with_chunks(self, prompt_ids: list[int], segments: Sequence[tuple[int, int]]) -> Prefilled | None:
        """Prefill with retrieved chunks' KV reused at their positions in this prompt
        (``kvcache.chunk_reuse``); None when no chunk can be reused, so the other paths run.

        Each segment between the first and the last is a chunk, cached as ``header + chunk`` (the
        header being the prompt's first segment) in the radix cache and prefilled that way the first
        time it is seen. The last segment (the question) may start with a cached chunk; that part
        is reused too. Only the exact part, the prompt up to the first reused chunk, is inserted."""
        config, model = self.asks_config, self.runner.model
        if not (config.enabled and config.reuse_chunks and self.cacheable and asks.supports_asks(model)):
            return None
        if len(segments) < 3 or config.recompute_fraction >= 1.0:  # nothing between header and question, or exact
            return None
        anchor = prompt_ids[:segments[0][1]]  # the header: chunks are cached as computed right after it
        last = len(prompt_ids) - 1  # the last prompt token is always computed: it gives the logits
        candidates = [(start, min(end, last)) for start, end in segments[1:]
                      if min(end, last) - start >= config.min_reuse_tokens]
        cached_tokens = 0
        cached_chunks = 0
        for start, end in candidates:
            if end <= segments[-1][0]:  # a middle segment: cache it on its own the first time it is seen
                computed = self._cache_sequence(anchor + prompt_ids[start:end])
                cached_tokens += computed
                cached_chunks += computed > 0
        # The first chunk is now a token-exact continuation of the header; whatever the radix cache
        # matches exactly is served exact, and only the chunks after it are reused.
        exact = self.prefix_cache.match_prefix(prompt_ids, max_tokens=last)
        if exact.window_freed:  # the chunks' passes read the prefix at every position, not its last window
            return None
        exact_tokens = exact.num_tokens
        candidates = [(start, end) for start, end in candidates if start >= exact_tokens]
        count = self.counters.count
        count("prompt_tokens_computed", cached_tokens)
        count("chunk_tokens_cached", cached_tokens)
        locked, chunks = [], []
        try:
            for start, end in candidates:
                found = self.prefix_cache.match_prefix(anchor + prompt_ids[start:end])
                size = found.num_tokens - len(anchor)
                if size < config.min_reuse_tokens or found.window_freed:
                    # Evicted since, a question segment that does not start with a chunk, or a chunk
                    # whose sliding-window KV was freed: it is read at other positions, in full.
                    continue
                self.prefix_cache.lock(found.last_node)
                locked.append(found.last_node)
                chunks.append(chunk_reuse.ReusedChunk(start, found.kv[:, :, :, len(anchor):], len(anchor)))
            if not chunks:
                return None
            cache, matched, node = self.cache_for_prefix(prompt_ids[:chunks[0].start + 1])
            if node is not None:
                locked.append(node)
            result = chunk_reuse.prefill_with_chunks(
                prompt_ids, cache, chunks, self.runner.forward, model, config,
                num_segments=len(segments), num_cached_chunks=cached_chunks)
            exact_kv = stack_kv(result.cache)[:, :, :, :result.num_exact_tokens]
            self.prefix_cache.insert(prompt_ids[:result.num_exact_tokens], exact_kv)
        finally:
            for held in locked:
                self.prefix_cache.unlock(held)
        decision = result.decision
        reused = matched + decision.reused_tokens
        self._count_prefill(result.num_computed_tokens, reused)
        count("chunk_reuse_prompts", int(decision.reused))
        count("chunks_reused", decision.chunks_reused)
        count("chunk_recomputed_tokens", decision.recomputed_tokens)
        count("chunk_probe_tokens", decision.probe_tokens)
        return Prefilled(prompt_ids, result.cache, result.last_logits, reused, exact=result.exact, asks=decision)

    def _cache_sequence(self, token_ids: list[int]) -> int:
        """Make sure the radix cache holds ``token_ids`` (prefilling what it lacks on top of what it
        has); returns the tokens computed. Only the KV is wanted, not the logits."""
        if self.prefix_cache.match_prefix(token_ids).num_tokens == len(token_ids):
            return 0
        # At least the last token is missing, so the exact prefill's match, which always leaves the
        # last token to compute, still reuses everything the cache holds of ``token_ids``.
        prefilled = run_to_end(self._prefill_exact(token_ids, None))
        return len(token_ids) - prefilled.num_cached_tokens

    def _prefill_with_asks(self, prompt_ids: list[int]) -> Prefilled | None:
        """Prefill through ASKS (``config.asks``, ``kvcache.asks``) when the prompt realigns with a
        cached sequence after a short differing span; None when ASKS does not act (off, ``tau = 1``,
        unsupported model, or no realignment), so the token-exact path runs unchanged.

        Only the exact part of the prompt's KV is inserted into the radix cache: all of it after a
        fallback, the shared prefix and the request's own span after a reuse."""
        config, model = self.asks_config, self.runner.model
        if not (config.enabled and config.tau < 1.0 and self.cacheable and asks.supports_asks(model)):
            return None
        alignment = asks.find_alignment(self.prefix_cache, prompt_ids, config)
        if alignment is None:
            return None
        match = self.prefix_cache.match_prefix(list(alignment.cached_ids))
        needed = alignment.prefix_tokens + alignment.cached_span_tokens + alignment.remainder_tokens
        # ASKS computes the request's span at the shared prefix's end, whose window may reach KV
        # freed out of the cached sequence's own window.
        if match.num_tokens < needed or match.window_freed:
            return None
        self.prefix_cache.lock(match.last_node)
        try:
            result = asks.prefill_with_asks(prompt_ids, alignment, match.kv, self.runner.forward, model, config)
            exact_kv = stack_kv(result.cache)[:, :, :, :result.num_exact_tokens]  # (L, 2, H_kv, T, D)
            self.prefix_cache.insert(prompt_ids[:result.num_exact_tokens], exact_kv)
        finally:
            self.prefix_cache.unlock(match.last_node)
        decision = result.decision
        self._count_prefill(result.num_computed_tokens, result.num_reused_tokens)
        count = self.counters.count
        count("asks_checks")
        count("asks_reuses", int(decision.reused))
        count("asks_reused_tokens", decision.reused_tokens)
        count("asks_recomputed_tokens", decision.recomputed_tokens)
        count("asks_check_tokens", decision.check_tokens)
        return Prefilled(prompt_ids, result.cache, result.last_logits, result.num_reused_tokens,
                         exact=result.exact, asks=decision)

    # -- the radix cache's prefixes, lent and read in place -----------------------------------------
    def cache_for_prefix(self, prompt_ids: list[int]) -> tuple[Any, int, Any]:
        """A batch-1 DynamicCache holding the longest cached prefix of ``prompt_ids`` (always leaving
        the last token to compute). Returns ``(cache, matched_tokens, locked_node_or_None)``; the
        caller unlocks the node (``unlock``) when done."""
        if self.cacheable:
            match = self.prefix_cache.match_prefix(prompt_ids, max_tokens=len(prompt_ids) - 1)
            if match.num_tokens:
                self.prefix_cache.lock(match.last_node)
                kv = match.kv  # (L, 2, H_kv, T, D)
                layers = [(kv[i, 0][None], kv[i, 1][None]) for i in range(kv.shape[0])]
                return self.runner.new_cache(layers), match.num_tokens, match.last_node
        if self.snapshots is not None:
            cache, matched = self.snapshots.match(prompt_ids, len(prompt_ids) - 1)
            if cache is not None:
                return cache, matched, None
        return self.runner.new_cache(), 0, None

    def unlock(self, node: Any) -> None:
        """Let go of a node this module locked (``cache_for_prefix``, ``read_in_place``)."""
        self.prefix_cache.unlock(node)

    @contextlib.contextmanager
    def lend(self, prefix_ids: Sequence[int]) -> Iterator[CachedPrefix]:
        """Lend a batch-1 cache holding the longest cached prefix of ``prefix_ids`` (always leaving its
        last token to compute) for a caller that runs its own passes (the verifier's batched Yes/No
        pass); what it computed and reused is counted, and the prefix unlocked, when the block ends."""
        cache, matched, node = self.cache_for_prefix(list(prefix_ids))
        lent = CachedPrefix(self.runner, cache, matched)
        try:
            yield lent
        finally:
            if node is not None:
                self.unlock(node)
            self.counters.count("prompt_tokens_computed", lent.computed_tokens)
            self.counters.count("prompt_tokens_reused", lent.reused_tokens)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes the prompt-state snapshots hold (0 when there are none)."""
        return self.snapshots.total_bytes if self.snapshots is not None else 0

    def clear_snapshots(self) -> None:
        if self.snapshots is not None:
            self.snapshots.clear()

    def cached_prefix_length(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` the radix cache holds KV for (0 when it is off)."""
        if not self.cacheable:
            return 0
        return self.prefix_cache.match_prefix(list(token_ids)).num_tokens

    def read_in_place(self, prompt_ids: list[int], cache: Any) -> PromptInPlace | None:
        """The prompt's KV as segments read in place from the radix cache, which its exact prefill has
        just filled; its matched nodes stay locked for the request's life (``unlock`` when it ends),
        so a prompt prefix shared by many running requests is held, and read per step, once. Only a
        tail the cache could not hold is copied out of ``cache`` (the request's batch-1 DynamicCache).
        None when the cache is off or holds none of the prompt."""
        if not self.cacheable:
            return None
        match = self.prefix_cache.match_prefix(prompt_ids)
        if match.num_tokens == 0:
            return None
        self.prefix_cache.lock(match.last_node)
        private = match.num_tokens < len(prompt_ids)  # the part the cache had no room for
        per_layer = []
        for index, layer in enumerate(cache.layers):
            segments = [(k[None], v[None]) for k, v in match.layer_kv(index)]  # (1, H_kv, t, D)
            if private:
                segments.append((layer.keys[:, :, match.num_tokens:].clone(),
                                 layer.values[:, :, match.num_tokens:].clone()))
            per_layer.append(segments)
        return PromptInPlace(per_layer, match.last_node, int(private))

    def cache_generated(self, prompt_ids: list[int], token_ids: list[int], cache: Any) -> None:
        """Keep a single completion's KV too, the way SGLang caches finished requests: an agent's
        next prompt usually repeats this answer, so it is served from the cache instead of recomputed."""
        # The last generated token was never fed back, so its KV does not exist.
        sequence = prompt_ids + token_ids[:-1]
        if not self.cacheable or len(sequence) <= len(prompt_ids):
            return
        if isinstance(cache, SharedPrefixCache):
            # Only the generated part is new: the prompt is (or is not, if it did not fit) in the cache.
            suffix = cache.suffix_kv(0)
            if suffix.shape[3] == len(sequence) - len(prompt_ids):
                self.prefix_cache.insert(sequence, suffix, kv_offset=len(prompt_ids))
            return
        kv_all = stack_kv(cache)
        if kv_all.shape[3] == len(sequence):
            self.prefix_cache.insert(sequence, kv_all)

    def annotate(self, token_ids: Sequence[int], *, start: int, branch_score: float, depth: int) -> int:
        """Set RSBCM's ``branch_score`` and ``depth`` on the cached KV of ``token_ids[start:]``; returns
        the cached tokens annotated (0 when the cache is off)."""
        if not self.cacheable:
            return 0
        return self.prefix_cache.annotate(list(token_ids), start=start, branch_score=branch_score, depth=depth)


def _context_groups(prompts: list[list[int]], matches: list[tuple[Any, int, Any]],
                    max_context_tokens: int | None) -> list[list[int]]:
    """Indices of ``prompts`` in order, cut into groups whose packed forward attends to at most
    ``max_context_tokens`` (cached prefixes, a shared one counted once, plus new tokens); a prompt
    over the bound on its own gets a group of its own."""
    groups: list[list[int]] = []
    seen: set[tuple[int, int]] = set()
    size = 0
    for index, (prompt, (_, matched, node)) in enumerate(zip(prompts, matches)):
        key = (id(node), matched)
        cost = len(prompt) - matched + (matched if key not in seen else 0)
        if groups and max_context_tokens is not None and size + cost > max_context_tokens:
            groups.append([])
            seen, size = set(), 0
            cost = len(prompt)
        if not groups:
            groups.append([])
        groups[-1].append(index)
        seen.add(key)
        size += cost
    return groups


def run_to_end(steps: Generator[Any, None, T]) -> T:
    """Run a generator through all its yields and return what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def stack_kv(cache: Any) -> torch.Tensor:
    """Row 0 of a DynamicCache as one tensor (L, 2, H_kv, T, D), the radix cache's layout."""
    return torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers])
