"""The running requests' door to the radix prefix cache: every lock taken on it while requests run,
and every write to it.

``PrefixAccess`` is the one owner of the radix cache's locks: the prefix a prefill reuses
(``cache_for_prefix``, ``holding``), the prompts a decode step prefills (``match_prompts``), the
prompt a running request reads in place (``read_in_place``) and the prefix lent to a verifier pass
(``lend``). A node locked through it is unlocked through it. The prefill strategies
(``prefill_strategies``, ``packed_prefill``) reach the cache through it; the ``Prefiller``
(``prefill``) is one, and chooses among them.

Callers hold the engine lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from transformers.cache_utils import Cache

from ..config import ASKSConfig
from ..kvcache.radix import RadixNode, RadixPrefixCache
from ..kvcache.shared_prefix import SharedPrefixCache
from ..kvcache.state_snapshots import StateSnapshots
from ..kvcache.static_rows import StaticRows
from ..results import ASKSDecision, ChunkReuseDecision
from .model_runner import ModelRunner
from .stats import Counters

T = TypeVar("T")
# Per layer, a prompt's KV as segments ``(keys, values)``, each (1, H_kv, t, D), in position order.
PromptSegments = list[list[tuple[torch.Tensor, torch.Tensor]]]
# A prompt's longest cached prefix, locked: (a batch-1 cache holding it, its tokens, the locked node or None).
LockedPrefix = tuple[Cache, int, RadixNode | None]


@dataclass
class Prefilled:
    """A prompt whose KV is computed: the batch-1 cache and the logits of its last position.

    Attributes:
        prompt_ids: The prompt's token ids.
        cache: A batch-1 ``transformers`` ``DynamicCache`` holding the whole prompt's KV (the
            caller's own; the prefix cache keeps its own copy of the exact part).
        last_logits: (1, V) next-token logits after the prompt.
        num_cached_tokens: Prompt tokens served by the prefix cache instead of computed.
        exact: False when approximate reuse (ASKS, retrieved chunks) reused KV: then nothing past
            the prompt's exact part, and nothing decoded on top of it, may go into the token-exact
            prefix cache.
        asks: What approximate reuse (ASKS, or retrieved chunks) did, None when it did not act.
    """

    prompt_ids: list[int]
    cache: Cache | None
    last_logits: torch.Tensor  # (1, V)
    num_cached_tokens: int
    exact: bool = True
    asks: ASKSDecision | ChunkReuseDecision | None = None


@dataclass
class PromptInPlace:
    """A running request's prompt read in place from the radix cache (see ``PrefixAccess.read_in_place``).

    Attributes:
        segments: Per layer, the prompt's KV segments ``(keys, values)``, each (1, H_kv, t, D).
        locked_node: The radix node locked for the request's life (``PrefixAccess.unlock`` it).
        num_private_segments: Trailing segments the request holds itself (a tail the cache had no room for).
    """

    segments: PromptSegments
    locked_node: RadixNode
    num_private_segments: int


class CachedPrefix:
    """What ``PrefixAccess.lend`` lends: a cache holding a prompt's cached prefix.

    Attributes:
        cache: A batch-1 ``transformers`` cache of the matched prefix (the caller may repeat its rows).
        num_tokens: Tokens of the prefix it holds.
        computed_tokens / reused_tokens: What the caller's passes computed and reused; counted when
            the block ends.
    """

    def __init__(self, runner: ModelRunner, cache: Cache, num_tokens: int) -> None:
        self._runner = runner
        self.cache = cache
        self.num_tokens = num_tokens
        self.computed_tokens = 0
        self.reused_tokens = 0

    def run_decoder(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder body (no LM head) over ``input_ids`` (B, T) after the cache; returns the final
        hidden states (B, T, hidden). Out of memory: rolled back and retried like any engine pass."""
        return self._runner.run_decoder(input_ids, self.cache)


class HeldNodes:
    """Radix nodes held for one block of ``PrefixAccess.holding``."""

    def __init__(self, prefix_cache: RadixPrefixCache) -> None:
        self._prefix_cache = prefix_cache
        self._nodes: list[RadixNode] = []

    def lock(self, node: RadixNode) -> None:
        """Lock ``node`` until the block ends."""
        self._prefix_cache.lock(node)
        self._nodes.append(node)

    def keep(self, node: RadixNode | None) -> None:
        """Unlock ``node``, locked already (``cache_for_prefix``), when the block ends."""
        if node is not None:
            self._nodes.append(node)

    def release(self) -> None:
        nodes, self._nodes = self._nodes, []
        for node in nodes:
            self._prefix_cache.unlock(node)


class PrefixAccess:
    """Reads, locks and writes the radix cache for the running requests (see the module docstring).

    Args:
        runner: Runs the passes.
        prefix_cache: The radix cache.
        asks_config: ASKS and retrieved-chunk reuse settings.
        cacheable: Whether the radix cache is in use (configured on, and the model's cache layers allow it).
        counters: Where prompt tokens computed and reused, hits and reuse decisions are counted.
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

    def count_prefill(self, computed: int, reused: int) -> None:
        """Count one prompt's prefill: its tokens computed and reused, and a cache hit or miss."""
        count = self.counters.count
        count("prefills")
        count("prompt_tokens_computed", computed)
        count("prompt_tokens_reused", reused)
        count("cache_hits" if reused else "cache_misses")

    def insert_and_count(self, prefilled: Sequence[Prefilled]) -> None:
        """Insert prompts prefilled together into the radix cache (while their matched nodes are still
        locked), then count each as a prefill."""
        if self.cacheable:
            for result in prefilled:
                self.prefix_cache.insert(result.prompt_ids, stack_kv(result.cache),
                                         computed_from=result.num_cached_tokens)
        for result in prefilled:
            self.count_prefill(len(result.prompt_ids) - result.num_cached_tokens, result.num_cached_tokens)

    # -- locks ----------------------------------------------------------------------------------
    def cache_for_prefix(self, prompt_ids: list[int]) -> LockedPrefix:
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

    def unlock(self, node: RadixNode) -> None:
        """Let go of a node locked here (``cache_for_prefix``, ``read_in_place``)."""
        self.prefix_cache.unlock(node)

    @contextlib.contextmanager
    def holding(self) -> Iterator[HeldNodes]:
        """Radix nodes locked for a block: what the block locks (``HeldNodes.lock``) or hands over
        (``HeldNodes.keep``) is unlocked when it ends, however it ends."""
        held = HeldNodes(self.prefix_cache)
        try:
            yield held
        finally:
            held.release()

    def match_prompts(self, prompts: Sequence[list[int]]) -> list[LockedPrefix]:
        """Each prompt's longest cached prefix (``cache_for_prefix``), for a caller that computes the
        rest in a forward of its own (a packed prefill, the scheduler's decode step). The nodes stay
        locked until ``release_prompts``."""
        matches: list[LockedPrefix] = []
        try:
            for prompt_ids in prompts:
                matches.append(self.cache_for_prefix(list(prompt_ids)))
        except BaseException:
            self.release_prompts(matches)
            raise
        return matches

    def release_prompts(self, matches: Sequence[LockedPrefix]) -> None:
        """Unlock what ``match_prompts`` locked."""
        for _, _, node in matches:
            if node is not None:
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

    def read_in_place(self, prompt_ids: list[int], cache: Cache) -> PromptInPlace | None:
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

    # -- what the cache holds -------------------------------------------------------------------
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

    def cache_generated(self, prompt_ids: list[int], token_ids: list[int], cache: Cache | StaticRows) -> None:
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
        if isinstance(cache, StaticRows):
            # The row holds the prompt and the answer; only the answer is new. Stacked: a copy, so
            # the radix cache keeps nothing of a slot the pool will hand out again.
            offset = len(prompt_ids)
            layers = cache.layer_kv(0)
            if layers[0][0].shape[2] == len(sequence):
                generated = torch.stack([torch.stack((k[0, :, offset:], v[0, :, offset:])) for k, v in layers])
                self.prefix_cache.insert(sequence, generated, kv_offset=offset)
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


def run_to_end(steps: Generator[Any, Any, T]) -> T:
    """Run a generator through all its yields (sending None back) and return what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def stack_kv(cache: Cache) -> torch.Tensor:
    """Row 0 of a DynamicCache as one tensor (L, 2, H_kv, T, D), the radix cache's layout."""
    return torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers])
