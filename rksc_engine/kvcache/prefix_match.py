"""Token-sequence helpers shared by the prefix cache, ASKS and the verifier.

Nothing here knows of models or caches: the functions take plain sequences of token ids.
"""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_length(
    a: Sequence[int], b: Sequence[int], *, a_start: int = 0, b_start: int = 0, limit: int | None = None
) -> int:
    """How many tokens ``a[a_start:]`` and ``b[b_start:]`` have in common from their starts.

    Args:
        a: Token ids.
        b: Token ids.
        a_start: Where the comparison starts in ``a``.
        b_start: Where the comparison starts in ``b``.
        limit: Compare at most this many tokens; None: up to the shorter remainder.

    Example:
        >>> common_prefix_length([1, 2, 3, 4], [9, 2, 3, 5], a_start=1, b_start=1)
        2
    """
    num_tokens = min(len(a) - a_start, len(b) - b_start)
    if limit is not None:
        num_tokens = min(num_tokens, limit)
    i = 0
    while i < num_tokens and a[a_start + i] == b[b_start + i]:
        i += 1
    return i


def common_prefix(sequences: Sequence[Sequence[int]]) -> list[int]:
    """The longest prefix every one of ``sequences`` starts with (``[]`` for no sequences)."""
    if not sequences:
        return []
    first = sequences[0]
    return list(first[: min(common_prefix_length(first, s) for s in sequences)])
