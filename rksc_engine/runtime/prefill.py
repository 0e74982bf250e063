"""Prefill: a prompt's KV, computed once, its longest cached prefix served by the radix cache.

The ``Prefiller`` is the scheduler's and the engine's one object for prompts. It is the radix
cache's door while requests run (``PrefixAccess``: every lock taken and let go of, every insert),
and it chooses how each prompt is computed: reusing retrieved chunks' KV, through ASKS, or
token-exact, in passes or whole (``prefill_strategies``); several prompts together in one forward
are its ``packing``'s (``packed_prefill``).

Callers hold the engine lock.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from ..config import ASKSConfig
from ..kvcache.radix import RadixPrefixCache
from ..kvcache.state_snapshots import StateSnapshots
from .model_runner import ModelRunner
from .packed_prefill import PromptPacker
from .prefill_strategies import prefill_exact, prefill_reusing_asks, prefill_reusing_retrieved_chunks
from .prefix_access import Prefilled, PrefixAccess, run_to_end
from .stats import Counters


class Prefiller(PrefixAccess):
    """Computes prompts' KV through the radix cache (see the module docstring). Built with the
    arguments of ``PrefixAccess``.

    Attributes:
        packing: Prefills several prompts in one forward (``PromptPacker``).
    """

    def __init__(self, runner: ModelRunner, prefix_cache: RadixPrefixCache, asks_config: ASKSConfig,
                 cacheable: bool, counters: Counters, snapshots: StateSnapshots | None = None) -> None:
        super().__init__(runner, prefix_cache, asks_config, cacheable, counters, snapshots)
        self.packing = PromptPacker(self)

    def prefill(self, prompt_ids: list[int]) -> Prefilled:
        """The whole prompt's KV in one pass (its cached prefix served by the radix cache)."""
        return run_to_end(self.prefill_steps(prompt_ids, None))

    def warm(self, prompt_ids: list[int]) -> int:
        """Compute ``prompt_ids``' KV into the radix cache; returns the prompt tokens computed."""
        before = self.counters.totals.prompt_tokens_computed
        self.prefill(prompt_ids)
        return self.counters.totals.prompt_tokens_computed - before

    def prefill_steps(self, prompt_ids: list[int], pass_tokens: int | None,
                      context_spans: Sequence[tuple[int, int]] | None = None
                      ) -> Generator[int, int | None, Prefilled]:
        """Prefill ``prompt_ids`` in passes: the first of at most ``pass_tokens`` new tokens (all of
        them when None), each later one of at most what the caller sends back between passes, so
        the scheduler can hand each pass what is left of its step's token budget.

        A generator: it yields the tokens each pass computed, between passes, and receives the next
        pass's size (``send(budget)``; ``next()`` for all that is left), so the scheduler can decode
        other requests in between; it returns the ``Prefilled``. The matched prefix stays locked
        until it returns or is closed (``close()`` on a cancelled request unlocks it).
        ``context_spans`` (the prompt cut at ``asks.chunk_separator``) let retrieved chunks be
        reused; approximate reuse computes the prompt in one go."""
        with torch.inference_mode():
            prefilled = prefill_reusing_retrieved_chunks(self, prompt_ids, context_spans) if context_spans else None
            if prefilled is None:
                prefilled = prefill_reusing_asks(self, prompt_ids)
        if prefilled is not None:
            return prefilled
        prefilled = yield from prefill_exact(self, prompt_ids, pass_tokens)
        matched = prefilled.num_cached_tokens
        self.count_prefill(len(prompt_ids) - matched, matched)
        return prefilled
