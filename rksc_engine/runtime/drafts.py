"""Drafts for speculative decoding, taken from text a request already has: no draft model.

A branch's draft is what followed, elsewhere, the last few tokens it has: an n-gram suffix match
(prompt lookup decoding) against the sources ``SchedulerConfig.draft_sources`` names, in its order:

* ``"prompt"``: the branch's own tokens, generated ones first, then the request's prompt;
* ``"siblings"``: the tokens the request's other branches have generated;
* ``"cache"``: the radix prefix cache, across requests: what an earlier request went on with after
  the branch's whole context (its prompt and its tokens so far), where the cache holds that context.

``"cache"`` matches the whole context, so it is tried before any n-gram. For the others, the longest
n-gram is tried first (``MAX_NGRAM`` tokens down to ``MIN_NGRAM``), every source for one length
before a shorter one; within a source the latest occurrence that has a continuation wins.
Each source keeps an index from n-gram to where it ends (``NgramIndex``), brought up to date as its
branch grows, so a proposal costs a few dictionary look-ups whatever the prompt's length.

A draft is only a guess: ``drafted_step`` keeps of it exactly the tokens the branch would have
chosen itself, so what is proposed here changes how many forwards a request takes, never its tokens.

Callers hold the engine lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

# What the radix cache holds after a context (``RadixPrefixCache.continuation``): ``(context,
# limit) -> tokens``, None once the context is not all in it.
CachedTokens = Callable[[Sequence[int], int], "list[int] | None"]

# Lengths of the n-grams matched, longest first: a longer match predicts its continuation better, a
# shorter one matches more often.
MAX_NGRAM = 4
MIN_NGRAM = 2


class NgramIndex:
    """Where each n-gram (``MIN_NGRAM`` to ``MAX_NGRAM`` tokens) of a growing token sequence ends.

    Attributes:
        tokens: The sequence indexed so far.
    """

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions just after each occurrence
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Index ``tokens`` appended to the sequence."""
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens)
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                self._ends.setdefault(tuple(self.tokens[end - n:end]), []).append(end)

    def catch_up(self, tokens: Sequence[int]) -> None:
        """Index what ``tokens`` (the sequence this index follows, grown since) holds beyond what is
        indexed; a sequence that does not extend the indexed one (a branch that started over) is
        indexed afresh."""
        indexed = len(self.tokens)
        if len(tokens) < indexed or list(tokens[:indexed]) != self.tokens:
            self.tokens, self._ends, indexed = [], {}, 0
        if len(tokens) > indexed:
            self.extend(tokens[indexed:])

    def continuation(self, key: tuple[int, ...], limit: int) -> list[int]:
        """Up to ``limit`` tokens that follow the latest occurrence of ``key`` with any token after it
        (an occurrence at the very end has none); empty when there is none."""
        for end in reversed(self._ends.get(key, ())):
            if end < len(self.tokens):
                return self.tokens[end:end + limit]
        return []


@dataclass(frozen=True)
class Draft:
    """Tokens proposed to follow a branch, and the source they came from (``DRAFT_SOURCES``)."""

    tokens: tuple[int, ...]
    source: str


class DraftIndex:
    """A submitted request's draft sources: its prompt's n-grams and each branch's generated ones.

    Args:
        prompt_ids: The request's prompt.
        cached: What the radix cache holds after a context, ``(context, limit) -> tokens``
            (``RadixPrefixCache.continuation``: None once the context is not all in it); None
            without a cache.
    """

    def __init__(self, prompt_ids: Sequence[int], cached: CachedTokens | None = None) -> None:
        self.prompt_ids = list(prompt_ids)
        self.prompt = NgramIndex(prompt_ids)
        self.generated: dict[int, NgramIndex] = {}  # branch index -> its generated tokens' index
        self.cached = cached
        self.off_cache: set[int] = set()  # branches whose context has left the cache: not looked up again

    def catch_up(self, generated: Iterable[tuple[int, Sequence[int]]]) -> None:
        """Index what the branches generated since the last call: ``(branch index, its tokens)`` each."""
        for branch_index, token_ids in generated:
            index = self.generated.get(branch_index)
            if index is None:
                index = self.generated[branch_index] = NgramIndex()
            index.catch_up(token_ids)

    def propose(self, branch_index: int, token_ids: Sequence[int], limit: int, sources: Sequence[str]) -> Draft | None:
        """Up to ``limit`` tokens to follow branch ``branch_index``, which has generated ``token_ids``,
        from the first of ``sources`` whose index continues its last tokens, longest match first
        (module docstring); None when none does. The indexes must be caught up (``catch_up``)."""
        if limit < 1:
            return None
        if "cache" in sources and self.cached is not None and branch_index not in self.off_cache:
            found = self.cached(self.prompt_ids + list(token_ids), limit)
            if found is None:
                self.off_cache.add(branch_index)
            elif found:
                return Draft(tuple(found), "cache")
        tail = (self.prompt_ids[-MAX_NGRAM:] + list(token_ids[-MAX_NGRAM:]))[-MAX_NGRAM:]
        for n in range(min(MAX_NGRAM, len(tail)), MIN_NGRAM - 1, -1):
            key = tuple(tail[-n:])
            for source in sources:
                for index in self._indexes(source, branch_index):
                    found = index.continuation(key, limit)
                    if found:
                        return Draft(tuple(found), source)
        return None

    def _indexes(self, source: str, branch_index: int) -> list[NgramIndex]:
        if source == "cache":
            return []
        if source == "prompt":
            own = self.generated.get(branch_index)
            return [own, self.prompt] if own is not None else [self.prompt]
        return [index for b, index in sorted(self.generated.items()) if b != branch_index]
