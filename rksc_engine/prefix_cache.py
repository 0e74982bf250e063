"""Radix prefix cache: a tree over token ids whose nodes own slices of computed KV.

A request asks for the longest cached prefix of its prompt (``match_prefix``), computes only the
rest, then gives the whole prompt's KV back (``insert``) so that later requests sharing any prefix of
it skip that work. This is the token-exact reuse of SGLang's RadixAttention and vLLM's automatic
prefix caching, held on the engine's side of ``transformers``.

Invariants:
    * Each node's ``kv`` holds exactly the KV of its own ``token_ids``, positions following its parent's.
      Node KV is stored as one tensor ``(num_layers, 2, num_kv_heads, num_tokens, head_dim)`` that the
      node owns (never a view into a larger tensor), so ``total_bytes`` is exact.
    * A node with ``lock_ref > 0`` (in use by a running request, or an ancestor of one) is never evicted.
    * Only leaves are evicted, so every cached node keeps a valid prefix above it. Among evictable
      leaves the policy's ``sort_key`` decides the order (smallest first).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class RadixNode:
    """One edge of the radix tree: a run of tokens and their KV."""

    __slots__ = ("children", "parent", "token_ids", "kv", "lock_ref", "last_access")

    def __init__(self, token_ids: tuple[int, ...], kv: torch.Tensor | None, parent: RadixNode | None) -> None:
        self.children: dict[int, RadixNode] = {}
        self.parent = parent
        self.token_ids = token_ids
        self.kv = kv  # (L, 2, H_kv, T, D) or None for the root
        self.lock_ref = 0
        self.last_access = 0

    @property
    def num_bytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_leaf(self) -> bool:
        return not self.children


class EvictionPolicy(ABC):
    """Orders evictable leaves; the smallest key goes first."""

    name: str

    @abstractmethod
    def sort_key(self, node: RadixNode) -> tuple:
        ...


class LRUPolicy(EvictionPolicy):
    """Least recently used leaf first."""

    name = "lru"

    def sort_key(self, node: RadixNode) -> tuple:
        return (node.last_access,)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy}


def make_eviction_policy(name: str) -> EvictionPolicy:
    """Build a policy by name; an unknown name is a ``ValueError`` listing the valid ones."""
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; valid: {sorted(EVICTION_POLICIES)}") from None


@dataclass
class PrefixMatch:
    """The cached part of a request's prompt.

    Attributes:
        num_tokens: Length of the matched prefix.
        kv: KV of the matched prefix, ``(L, 2, H_kv, num_tokens, D)``, or None when nothing matched.
        last_node: Deepest matched node, to ``lock`` while the request uses the prefix.
    """

    num_tokens: int
    kv: torch.Tensor | None
    last_node: RadixNode


class PrefixCache(ABC):
    """What the engine needs of a prefix cache."""

    @abstractmethod
    def match_prefix(self, token_ids: list[int], max_tokens: int | None = None) -> PrefixMatch: ...

    @abstractmethod
    def insert(self, token_ids: list[int], kv: torch.Tensor) -> int: ...

    @abstractmethod
    def lock(self, node: RadixNode) -> None: ...

    @abstractmethod
    def unlock(self, node: RadixNode) -> None: ...

    @abstractmethod
    def evict(self, num_bytes: int) -> int: ...


def _common_prefix_length(a: tuple[int, ...], b: list[int], start: int) -> int:
    limit = min(len(a), len(b) - start)
    i = 0
    while i < limit and a[i] == b[start + i]:
        i += 1
    return i


class RadixPrefixCache(PrefixCache):
    """Token-exact prefix cache under a byte budget.

    Not thread-safe by itself: the engine serialises access under its own lock.

    Args:
        budget_bytes: Most bytes of KV kept; inserts past it evict unlocked leaves by ``policy``.
        policy: Eviction order (default least recently used).
    """

    def __init__(self, budget_bytes: int, policy: EvictionPolicy | None = None) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.policy = policy or LRUPolicy()
        self.root = RadixNode((), None, None)
        self.total_bytes = 0
        self.total_tokens = 0
        self.evicted_tokens = 0
        self._clock = itertools.count(1)

    # -- lookup ---------------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], max_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix of ``token_ids``, at most ``max_tokens`` long.

        Touches the matched nodes (for LRU). A partially matched edge is split so the returned
        ``last_node`` covers exactly the matched tokens (before the ``max_tokens`` cut).
        """
        node, pieces, matched = self._walk(token_ids, split=True)
        if max_tokens is not None and matched > max_tokens:
            matched = max_tokens
        if matched == 0:
            return PrefixMatch(0, None, self.root)
        kv = torch.cat(pieces, dim=3) if len(pieces) > 1 else pieces[0]
        return PrefixMatch(matched, kv[:, :, :, :matched], node)

    def _walk(self, token_ids: list[int], split: bool) -> tuple[RadixNode, list[torch.Tensor], int]:
        node, pieces, i = self.root, [], 0
        tick = next(self._clock)
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                break
            common = _common_prefix_length(child.token_ids, token_ids, i)
            if common < child.num_tokens:
                if not split:
                    break
                child = self._split(child, common)
            child.last_access = tick
            pieces.append(child.kv)
            i += common
            node = child
        return node, pieces, i

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Split ``node`` after ``at`` tokens; returns the new upper part (which keeps the locks)."""
        upper = RadixNode(node.token_ids[:at], node.kv[:, :, :, :at].clone(), node.parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.parent.children[node.token_ids[0]] = upper
        node.token_ids = node.token_ids[at:]
        node.kv = node.kv[:, :, :, at:].clone()
        node.parent = upper
        upper.children[node.token_ids[0]] = node
        return upper

    # -- insert / evict -------------------------------------------------------------------------
    def insert(self, token_ids: list[int], kv: torch.Tensor) -> int:
        """Cache the KV of ``token_ids`` (``kv``: ``(L, 2, H_kv, len(token_ids), D)``).

        Only the part not already cached is stored (copied, so the cache owns its memory). Returns
        the number of newly cached tokens (0 if the budget could not make room for them).
        """
        if kv.shape[3] != len(token_ids):
            raise ValueError(f"kv holds {kv.shape[3]} tokens but token_ids has {len(token_ids)}")
        node, _, matched = self._walk(token_ids, split=True)
        if matched == len(token_ids):
            return 0
        leaf = RadixNode(tuple(token_ids[matched:]), kv[:, :, :, matched:].clone(), node)
        leaf.last_access = next(self._clock)
        node.children[leaf.token_ids[0]] = leaf
        self.total_bytes += leaf.num_bytes
        self.total_tokens += leaf.num_tokens
        if self.total_bytes > self.budget_bytes:
            # Lock the new leaf's path while making room so we never evict what we just stored
            # unless nothing else can go.
            self.lock(leaf)
            self.evict(self.total_bytes - self.budget_bytes)
            self.unlock(leaf)
            if self.total_bytes > self.budget_bytes:
                self._remove_leaf(leaf)
                return 0
        return leaf.num_tokens

    def evict(self, num_bytes: int) -> int:
        """Evict unlocked leaves in policy order until ``num_bytes`` are freed; returns bytes freed."""
        heap = [(self.policy.sort_key(n), id(n), n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_bytes and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += leaf.num_bytes
            self.evicted_tokens += leaf.num_tokens
            self._remove_leaf(leaf)
            if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (self.policy.sort_key(parent), id(parent), parent))
        return freed

    def _remove_leaf(self, leaf: RadixNode) -> None:
        del leaf.parent.children[leaf.token_ids[0]]
        self.total_bytes -= leaf.num_bytes
        self.total_tokens -= leaf.num_tokens

    def _evictable_leaves(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root and node.is_leaf and node.lock_ref == 0:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def clear(self) -> None:
        """Drop every unlocked node."""
        self.evict(self.total_bytes + 1)

    # -- locking --------------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction (reference counted)."""
        while node is not None and node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of a node that is not locked")
            node.lock_ref -= 1
            node = node.parent

    @property
    def evictable_bytes(self) -> int:
        return sum(n.num_bytes for n in self._iter_nodes() if n.lock_ref == 0)

    def _iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def num_nodes(self) -> int:
        return sum(1 for _ in self._iter_nodes())
