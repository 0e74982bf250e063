"""Radix prefix cache (RSBCM): a tree over token ids whose nodes own fixed-size blocks of KV, kept
inside a byte budget by a pluggable eviction policy.

A request asks for the longest cached prefix of its prompt (``match_prefix``), computes only the
rest, then gives the whole prompt's KV back (``insert``) so that later requests sharing any prefix of
it skip that work. This is the token-exact reuse of SGLang's RadixAttention and vLLM's automatic
prefix caching, held on the engine's side of ``transformers``.

Storage and blocks:
    Each node holds its KV as one tensor ``storage`` of shape ``(num_layers, 2, num_kv_heads,
    num_tokens, head_dim)``, so a running request can read a node in place, as one attention
    segment, without copying it (``PrefixMatch.segments``). Accounting and eviction work in blocks
    aligned to absolute token positions: block ``b`` covers positions ``[b * block_size,
    (b + 1) * block_size)``; a node's ``blocks`` are views of its storage cut at those boundaries, so
    only the first and last block of a node can be partial and a partial block counts its real bytes.
    Splitting a node makes its two parts views of the same memory (nothing is copied); when eviction
    leaves memory that no node's view covers, the survivors sharing it are compacted into storage of
    their own. Memory that a locked node views is never compacted: the running request reads it in
    place, so a copy would hold it twice and split the request from later ones reading the node. So
    eviction leaves alone the unlocked nodes sharing that memory too (dropping them frees nothing
    while the request holds it). ``total_bytes`` is the memory the nodes hold, each distinct storage
    counted once in full.

Sliding-window layers (``set_sliding_window``):
    A query at position ``p`` of a sliding-window layer sees only the keys of the last ``window``
    positions, so the KV those layers hold for tokens far behind every cached sequence's end is never
    read again. Under budget pressure, before any leaf block goes, the cache frees it (SGLang's
    "tombstones"): the part of a node more than ``window + 1`` positions before the node's end (where
    cached sequences end or part) is split off and keeps only its other layers' KV. A match then counts only up to a length ``m`` whose last ``window`` positions keep
    every layer (``m`` is cut back otherwise), so a request reusing it never needs the freed part. A
    later exact prefill that computes freed positions again puts them back when the budget has room.

Invariants:
    * Each node's storage and blocks hold exactly the KV of its own ``token_ids``, positions following
      its parent's.
    * ``total_bytes <= budget_bytes`` after every allocation: an insert evicts first and then stores
      only what fits (its longest block-aligned leading part), so ``peak_bytes`` never passes the
      budget. (Lowering the budget with ``set_budget`` below the locked bytes is the one way to be
      over it; inserts then store nothing until locks are released.)
    * Out of memory, ``shrink_budget`` lowers the effective budget relative to the budget (never to
      a fraction of what happens to be held, which would take an empty cache's budget to nothing), to
      no less than ``min_budget_bytes`` nor than the locked bytes, so it keeps
      ``total_bytes <= budget_bytes`` even while a running request holds a prefix locked. It also
      evicts down to ``factor`` of the unlocked bytes held, since a budget far above the held
      bytes frees no memory by itself. ``relax_budget`` grows the budget back step by step, never
      past ``configured_budget_bytes``; ``clear`` and ``restore_budget`` return to it at once.
    * A node with ``lock_ref > 0`` (in use by a running request, or an ancestor of one) is never evicted
      nor copied, and neither is any node sharing its memory: its ``storage`` stays the very memory the
      request was lent until it is unlocked.
    * Only the trailing block of a node without cached descendants (a leaf) is evicted, so every node
      keeps a valid prefix above it; a leaf whose last block goes disappears and may expose its parent.
    * Eviction order: among evictable leaves, the policy's ``sort_key`` (smallest first; ties by node
      creation order). ``omega`` (default): increasing ``branch_score / (depth + 1)``, ties least
      recently used. ``lru``: least recently used. With no scores given (every node 1.0 at depth 0)
      ``omega`` orders exactly like ``lru``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..config import EVICTION_POLICY_NAMES
from .memory import is_out_of_memory
from .prefix_match import common_prefix_length

DEFAULT_BLOCK_SIZE = 16


class RadixNode:
    """One edge of the radix tree: a run of tokens and their KV blocks.

    Attributes:
        children: First token id of each child edge -> child.
        parent: The node above (None for the root).
        token_ids: This edge's tokens.
        start: Absolute position of ``token_ids[0]`` in the sequence (the parent path's length).
        storage: KV of ``token_ids``, ``(L, 2, H_kv, num_tokens, D)`` (None for the root); possibly a
            view into memory it shares with the other parts of a split node. After its sliding-window
            layers' KV was freed, only the other layers', in layer order.
        window_freed: Whether this node's sliding-window layers' KV was freed (``set_sliding_window``).
        blocks: Views of ``storage`` cut at multiples of the block size, ``(L, 2, H_kv, t, D)`` each.
        branch_score: Score of the reasoning branch this KV belongs to (1.0 unless a search says
            otherwise).
        depth: Reasoning steps from the root (0 for plain prompts).
        lock_ref: Running requests using this node or a descendant.
        last_access: Logical clock of the last match or insert that used this node.
    """

    __slots__ = ("children", "parent", "token_ids", "start", "storage", "blocks", "branch_score", "depth",
                 "lock_ref", "last_access", "node_id", "window_freed")

    def __init__(
        self,
        token_ids: tuple[int, ...],
        blocks: list[torch.Tensor],
        parent: RadixNode | None,
        *,
        start: int = 0,
        branch_score: float = 1.0,
        depth: int = 0,
        node_id: int = 0,
    ) -> None:
        self.children: dict[int, RadixNode] = {}
        self.parent = parent
        self.token_ids = token_ids
        self.start = start
        self.blocks = blocks
        self.storage: torch.Tensor | None = None
        self.branch_score = branch_score
        self.depth = depth
        self.lock_ref = 0
        self.last_access = 0
        self.node_id = node_id
        self.window_freed = False

    @property
    def kv(self) -> torch.Tensor | None:
        """This node's KV as one tensor ``(L, 2, H_kv, num_tokens, D)`` (its storage, not a copy; only
        the layers kept when ``window_freed``), or None for the root."""
        return self.storage

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.blocks)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        """Absolute position one past this node's last token."""
        return self.start + len(self.token_ids)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def omega(self) -> float:
        """RSBCM importance ``branch_score / (depth + 1)``: shallow, high-scoring KV is kept longest."""
        return self.branch_score / (self.depth + 1)


# -- eviction policies ----------------------------------------------------------------------------
class EvictionPolicy(ABC):
    """Orders evictable leaves; the smallest key goes first (ties: the older node)."""

    name: str

    @abstractmethod
    def sort_key(self, node: RadixNode) -> tuple:
        ...


class LRUPolicy(EvictionPolicy):
    """Least recently used leaf first."""

    name = "lru"

    def sort_key(self, node: RadixNode) -> tuple:
        return (node.last_access,)


class OmegaPolicy(EvictionPolicy):
    """Lowest ``omega = branch_score / (depth + 1)`` first; ties least recently used."""

    name = "omega"

    def sort_key(self, node: RadixNode) -> tuple:
        return (node.omega, node.last_access)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "omega": OmegaPolicy}
assert tuple(sorted(EVICTION_POLICIES)) == tuple(sorted(EVICTION_POLICY_NAMES)), "config names the policies"


def make_eviction_policy(name: str) -> EvictionPolicy:
    """Build a policy by name; an unknown name is a ``ValueError`` listing the valid ones."""
    try:
        return EVICTION_POLICIES[name]()
    except (KeyError, TypeError):
        raise ValueError(f"unknown eviction policy {name!r}; valid: {sorted(EVICTION_POLICIES)}") from None


# -- results ----------------------------------------------------------------------------------------
@dataclass
class PrefixMatch:
    """The cached part of a request's prompt.

    Attributes:
        num_tokens: Length of the matched prefix.
        segments: The matched nodes' storage in position order, the last one cut to the match, each
            ``(L, 2, H_kv, t, D)``: the cache's own memory, to read in place while the match is locked
            (the cache neither copies nor frees it until then). A segment whose sliding-window layers'
            KV was freed holds only the layers in ``segment_layers``.
        last_node: Deepest matched node, to ``lock`` while the request uses the prefix.
        segment_layers: Per segment, None when it holds every layer, else the layers it holds, in
            order (the rest were freed out of the window). Empty when no segment lost any.
        num_layers: The model's layers (0 when ``segment_layers`` is empty).
    """

    num_tokens: int
    segments: list[torch.Tensor]
    last_node: RadixNode
    segment_layers: list[tuple[int, ...] | None] = field(default_factory=list)
    num_layers: int = 0

    def layer_kv(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each segment's keys and values of one layer, ``(H_kv, t, D)`` each, views of the cache's
        memory. Where that layer's KV was freed out of the window, zeros that take no memory: the match
        rule keeps every position a request reusing the match can see intact."""
        layers = self.segment_layers or [None] * len(self.segments)
        out = []
        for segment, held in zip(self.segments, layers):
            if held is None or layer in held:
                row = layer if held is None else held.index(layer)
                out.append((segment[row, 0], segment[row, 1]))
            else:
                zeros = segment.new_zeros(()).expand(segment.shape[2:])
                out.append((zeros, zeros))
        return out

    @property
    def window_freed(self) -> bool:
        """Whether some segment lost its sliding-window layers' KV out of the window: such a match is
        exact for a query right after it, not for one anywhere else (ASKS, chunk reuse)."""
        return any(held is not None for held in self.segment_layers)

    @property
    def kv(self) -> torch.Tensor | None:
        """KV of the matched prefix as one tensor ``(L, 2, H_kv, num_tokens, D)`` (a copy when it spans
        several nodes or lost out-of-window KV, zeros there), or None when nothing matched."""
        if not self.segments:
            return None
        if not any(held is not None for held in self.segment_layers):
            return self.segments[0] if len(self.segments) == 1 else torch.cat(self.segments, dim=3)
        per_layer = []
        for layer in range(self.num_layers):
            parts = self.layer_kv(layer)
            per_layer.append(torch.stack((torch.cat([k for k, _ in parts], dim=1),
                                          torch.cat([v for _, v in parts], dim=1))))
        return torch.stack(per_layer)


@dataclass(frozen=True)
class EvictedBlock:
    """One block that eviction removed.

    Attributes:
        token_ids: The block's tokens.
        start: Absolute position of its first token.
        num_bytes: Bytes freed.
        omega: Its node's importance when it went.
    """

    token_ids: tuple[int, ...]
    start: int
    num_bytes: int
    omega: float


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that owns its storage, so a block's bytes are exactly its own."""
    return t.clone(memory_format=torch.contiguous_format)


def _layer_token_bytes(kv: torch.Tensor) -> int:
    """Bytes one layer's keys and values take per token in ``kv`` ``(L, 2, H_kv, T, D)``."""
    return kv[:1, :, :, :1].numel() * kv.element_size()


def _memory_key(node: RadixNode) -> int:
    """Identifies the memory ``node.storage`` views (shared by the parts of a split node)."""
    return node.storage.untyped_storage().data_ptr()


def _any_locked(nodes: list[RadixNode]) -> bool:
    return any(node.lock_ref > 0 for node in nodes)


class RadixPrefixCache:
    """Token-exact prefix cache of KV blocks under a byte budget.

    Not thread-safe by itself: the engine serialises access under its own lock.

    Args:
        budget_bytes: Most bytes of KV kept (> 0).
        policy: Eviction order: an ``EvictionPolicy`` or its name (``"omega"`` default, ``"lru"``).
        block_size: Tokens per block (>= 1), the unit of eviction. Default 16.

    Example:
        >>> cache = RadixPrefixCache(64 << 20, policy="omega", block_size=16)
        >>> cache.insert(prompt_ids, kv, branch_score=0.8, depth=2)  # kv: (L, 2, H_kv, T, D)
        >>> match = cache.match_prefix(prompt_ids + more_ids)
        >>> cache.lock(match.last_node)  # while a request uses match.kv; unlock when done
    """

    def __init__(
        self, budget_bytes: int, policy: EvictionPolicy | str | None = None, block_size: int = DEFAULT_BLOCK_SIZE
    ) -> None:
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be an int > 0, got {budget_bytes!r}")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if policy is None:
            policy = OmegaPolicy()
        elif isinstance(policy, str):
            policy = make_eviction_policy(policy)
        elif not isinstance(policy, EvictionPolicy):
            raise TypeError(f"policy must be an EvictionPolicy or a name, got {type(policy).__name__}")
        self.configured_budget_bytes = budget_bytes
        self.budget_bytes = budget_bytes
        self.bytes_per_token = 0  # of the last inserted KV; 0 until the first insert
        self.block_size = block_size
        self.policy = policy
        self._ids = itertools.count()
        self.root = RadixNode((), [], None, node_id=next(self._ids))
        self.total_bytes = 0
        self.total_tokens = 0
        self.peak_bytes = 0
        self.evicted_tokens = 0
        self.evicted_blocks = 0
        self.window_freed_tokens = 0  # tokens whose sliding-window layers' KV was freed
        self.window: int | None = None
        self.num_layers = 0
        self.kept_layers: tuple[int, ...] = ()  # the layers a node keeps when its window KV is freed
        self._clock = itertools.count(1)

    def set_sliding_window(self, sliding_layers: Sequence[int], num_layers: int, window: int) -> None:
        """Tell the cache which layers attend within a sliding ``window``, so that under budget
        pressure it frees their KV for positions every cached sequence has left behind, and matches
        only prefixes whose last ``window`` positions keep every layer.

        Args:
            sliding_layers: Indices of the sliding-window layers, non-empty, each in ``[0, num_layers)``.
            num_layers: The model's layers (the ``L`` of the KV inserted), >= 1.
            window: Positions a query sees, itself included, >= 1.
        """
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        sliding = set(sliding_layers)
        if not sliding or not all(isinstance(i, int) and 0 <= i < num_layers for i in sliding):
            raise ValueError(f"sliding_layers must be a non-empty set of layer indices in [0, {num_layers}), "
                             f"got {sliding_layers!r}")
        if self.total_tokens:
            raise RuntimeError("set_sliding_window needs an empty cache")
        self.window, self.num_layers = window, num_layers
        self.kept_layers = tuple(i for i in range(num_layers) if i not in sliding)

    # -- lookup ---------------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], max_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix of ``token_ids``, at most ``max_tokens`` long.

        Touches the matched nodes (for LRU). A partially matched edge is split so the returned
        ``last_node`` covers exactly the matched tokens (before the ``max_tokens`` cut).
        """
        path, matched = self._walk(token_ids, split=True, touch=True)
        if max_tokens is not None and matched > max_tokens:
            matched = max_tokens
        intact = self._window_intact_length(path, matched)
        if intact < matched:
            # The cut lands on a node's start: the match rests on the nodes before it alone, so only
            # they are locked (a freed node after it stays free to be restored or evicted).
            path = [node for node in path if node.start < intact]
            matched = intact
        if matched == 0:
            return PrefixMatch(0, [], self.root)
        segments, layers, covered = [], [], 0
        for node in path:
            take = min(node.num_tokens, matched - covered)
            if take <= 0:
                break
            segments.append(node.storage if take == node.num_tokens else node.storage[:, :, :, :take])
            layers.append(self.kept_layers if node.window_freed else None)
            covered += take
        if not any(held is not None for held in layers):
            return PrefixMatch(matched, segments, path[-1])
        return PrefixMatch(matched, segments, path[-1], layers, self.num_layers)

    def continuation(self, token_ids: Sequence[int], limit: int) -> list[int] | None:
        """Up to ``limit`` tokens the tree holds right after ``token_ids``, following at each fork the
        child used last: what an earlier request went on with after the same context. ``[]`` when
        the tree holds all of ``token_ids`` and nothing after it; None when it does not hold them
        all (a context that has left the tree does not come back to it as it grows, bar a later
        insert). Reads the tree only: no node is touched or split."""
        node, i, n = self.root, 0, len(token_ids)
        rest: tuple[int, ...] = ()
        while i < n:
            child = node.children.get(token_ids[i])
            if child is None:
                return None
            edge = child.token_ids
            if n - i >= len(edge) and tuple(token_ids[i:i + len(edge)]) == edge:  # one C-level comparison
                i += len(edge)
                node = child
                continue
            common = common_prefix_length(edge, token_ids, b_start=i)
            if i + common < n:
                return None
            rest, node, i = edge[common:], child, n
        found = list(rest[:limit])
        while len(found) < limit and node.children:
            node = max(node.children.values(), key=lambda c: c.last_access)
            found += node.token_ids[:limit - len(found)]
        return found

    def _window_intact_length(self, path: list[RadixNode], length: int) -> int:
        """The longest prefix, at most ``length`` long, whose positions a query right after it can see
        through a sliding window all keep every layer's KV."""
        freed = [node for node in path if node.window_freed]
        while freed:
            # One position more than the window the model applies (a query sees ``window`` positions,
            # itself included), so a match never rests on that convention.
            low = length - self.window
            overlapping = [node for node in freed if node.start < length and node.end > low]
            if not overlapping:
                break
            length = min(node.start for node in overlapping)
        return length

    def _walk(self, token_ids: list[int], split: bool, touch: bool) -> tuple[list[RadixNode], int]:
        """The nodes along the longest cached prefix of ``token_ids`` and its length."""
        node, path, i = self.root, [], 0
        tick = next(self._clock) if touch else 0
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                break
            common = common_prefix_length(child.token_ids, token_ids, b_start=i)
            if common < child.num_tokens:
                if not split:
                    break
                child = self._split(child, common)
            if touch:
                child.last_access = tick
            path.append(child)
            i += common
            node = child
        return path, i

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Split ``node`` after ``at`` tokens; returns the new upper part (which keeps the locks).

        Nothing is copied: both parts are views of the node's storage (a request reading the node
        in place goes on reading the same memory), so ``total_bytes`` is unchanged.
        """
        cut = node.start + at  # absolute position of the first token of the lower part
        upper_storage, lower_storage = node.storage[:, :, :, :at], node.storage[:, :, :, at:]
        upper = RadixNode(node.token_ids[:at], self._to_blocks(upper_storage, node.start), node.parent,
                          start=node.start, branch_score=node.branch_score, depth=node.depth, node_id=next(self._ids))
        upper.storage = upper_storage
        node.storage = lower_storage
        lower_blocks = self._to_blocks(lower_storage, cut)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.window_freed = node.window_freed
        node.parent.children[node.token_ids[0]] = upper
        node.token_ids = node.token_ids[at:]
        node.blocks = lower_blocks
        node.start = cut
        node.parent = upper
        upper.children[node.token_ids[0]] = node
        return upper

    # -- insert ---------------------------------------------------------------------------------
    def insert(self, token_ids: list[int], kv: torch.Tensor, *, branch_score: float = 1.0, depth: int = 0,
               kv_offset: int = 0, computed_from: int | None = None) -> int:
        """Cache the KV of ``token_ids`` (``kv``: ``(L, 2, H_kv, len(token_ids) - kv_offset, D)``, the
        KV of ``token_ids[kv_offset:]``; the first ``kv_offset`` tokens must then be cached already,
        or nothing past the cached part is stored).

        Only the part not already cached is stored (copied into blocks the cache owns). Room is made
        before anything is allocated; if the budget cannot hold the whole new part, its longest
        block-aligned leading part that fits is stored. New nodes get ``branch_score`` and ``depth``
        (nodes already cached keep theirs; see ``annotate``).

        ``computed_from``, when given, says that ``kv`` from that position on was computed by the
        caller, not read from this cache: cached nodes there whose sliding-window KV was freed, and
        that the window of this sequence's end reaches, get it back from ``kv`` while the budget has
        room (so a prompt whose match the freed KV cut short is served whole the next time).

        Returns:
            The number of newly cached tokens.
        """
        if not 0 <= kv_offset <= len(token_ids):
            raise ValueError(f"kv_offset must be in [0, {len(token_ids)}], got {kv_offset}")
        if kv.dim() != 5 or kv.shape[3] != len(token_ids) - kv_offset:
            raise ValueError(f"kv must be (L, 2, H_kv, {len(token_ids) - kv_offset}, D) for {len(token_ids)} token "
                             f"ids from offset {kv_offset}, got {tuple(kv.shape)}")
        path, matched = self._walk(token_ids, split=True, touch=True)
        if computed_from is not None and self.window is not None:
            self._restore_window(path, len(token_ids), kv, max(kv_offset, computed_from) - kv_offset)
        if matched == len(token_ids) or matched < kv_offset:
            return 0
        parent = path[-1] if path else self.root
        bytes_per_token = kv[:, :, :, :1].numel() * kv.element_size()
        self.bytes_per_token = bytes_per_token
        num_new = len(token_ids) - matched
        over = self.total_bytes + num_new * bytes_per_token - self.budget_bytes
        if over > 0:
            # Keep the node we attach to (and so the path above it) while making room. Not a lock:
            # nothing reads it in place, so compaction may still give it storage of its own.
            self._evict_blocks(over, keep=parent)
        room_tokens = max(0, self.budget_bytes - self.total_bytes) // bytes_per_token
        if room_tokens < num_new:
            # Keep a block-aligned leading part, so the tail we drop is whole blocks.
            aligned_end = (matched + room_tokens) // self.block_size * self.block_size
            num_new = max(0, aligned_end - matched)
        if num_new == 0:
            return 0
        end = matched + num_new
        storage = _own(kv[:, :, :, matched - kv_offset:end - kv_offset])
        leaf = RadixNode(tuple(token_ids[matched:end]), self._to_blocks(storage, matched),
                         parent, start=matched, branch_score=float(branch_score), depth=int(depth),
                         node_id=next(self._ids))
        leaf.storage = storage
        leaf.last_access = next(self._clock)
        parent.children[leaf.token_ids[0]] = leaf
        self.total_bytes += storage.untyped_storage().nbytes()
        self.total_tokens += leaf.num_tokens
        self.peak_bytes = max(self.peak_bytes, self.total_bytes)
        return num_new

    def _restore_window(self, path: list[RadixNode], end: int, kv: torch.Tensor, first: int) -> None:
        """Put back the sliding-window KV of the unlocked nodes on ``path`` that lost it, lie wholly in
        ``kv[:, :, :, first:]`` (``kv`` starting at position ``kv_start``) and that the window of
        position ``end`` reaches, while the budget has room."""
        kv_start = end - kv.shape[3]
        restored = False
        for node in path:
            # A prompt of ``end`` tokens is matched up to ``end - 1`` (its last token is always
            # computed), and that match needs positions from ``end - 1 - window`` on whole.
            if (not node.window_freed or node.lock_ref or node.end <= end - 1 - self.window
                    or node.start < kv_start + first):
                continue
            # All of the node's layers anew: the memory it held stays while a locked node shares it.
            added = kv.shape[0] * node.num_tokens * _layer_token_bytes(kv)
            if self.total_bytes + added > self.budget_bytes:
                break
            storage = _own(kv[:, :, :, node.start - kv_start:node.end - kv_start])
            node.storage, node.blocks, node.window_freed = storage, self._to_blocks(storage, node.start), False
            self.total_bytes += storage.untyped_storage().nbytes()
            restored = True
        if restored:
            self._compact()
            self.peak_bytes = max(self.peak_bytes, self.total_bytes)

    def _to_blocks(self, storage: torch.Tensor, start: int) -> list[torch.Tensor]:
        """Views of ``storage`` (``(L, 2, H_kv, T, D)`` for positions ``start..start+T``) cut at block
        boundaries."""
        blocks, pos, end = [], start, start + storage.shape[3]
        while pos < end:
            stop = min(end, (pos // self.block_size + 1) * self.block_size)
            blocks.append(storage[:, :, :, pos - start:stop - start])
            pos = stop
        return blocks

    def annotate(self, token_ids: list[int], *, start: int = 0, branch_score: float, depth: int) -> int:
        """Set ``branch_score`` and ``depth`` on the cached nodes holding positions
        ``[start, len(token_ids))`` of ``token_ids`` (splitting nodes at both ends so nothing outside
        the range changes). Does not count as an access. Returns the number of tokens annotated."""
        if not 0 <= start <= len(token_ids):
            raise ValueError(f"start must be in [0, {len(token_ids)}], got {start}")
        if start:
            self._walk(token_ids[:start], split=True, touch=False)
        path, matched = self._walk(token_ids, split=True, touch=False)
        annotated = 0
        for node in path:
            if node.start >= start:
                node.branch_score, node.depth = float(branch_score), int(depth)
                annotated += node.num_tokens
        return annotated

    # -- evict ------------------------------------------------------------------------------------
    def evict(self, num_bytes: int) -> int:
        """Evict trailing blocks of unlocked leaves in policy order until ``num_bytes`` are freed
        (or nothing evictable is left); returns the bytes of memory freed."""
        held = self.total_bytes
        self.evict_blocks(num_bytes)
        return held - self.total_bytes

    def evict_blocks(self, num_bytes: int) -> list[EvictedBlock]:
        """Like ``evict``, returning the evicted blocks in the order they went.

        Leaves sharing memory with a locked node are not evicted: the memory stays whole while a
        running request reads it, so dropping them would lose KV and free nothing."""
        return self._evict_blocks(num_bytes, keep=None)

    def _evict_blocks(self, num_bytes: int, keep: RadixNode | None, free_window: bool = True
                      ) -> list[EvictedBlock]:
        """``evict_blocks``, never taking ``keep`` (so nothing on the path above it goes either).
        With ``free_window``, sliding-window KV no cached sequence's window reaches goes first
        (``set_sliding_window``)."""
        if free_window and self.window is not None and num_bytes > 0:
            held = self.total_bytes
            self._free_out_of_window(num_bytes)
            num_bytes -= held - self.total_bytes
            if num_bytes <= 0:
                return []
        pinned = {memory for memory, (_, nodes) in self._memory_groups().items() if _any_locked(nodes)}

        def evictable(node: RadixNode) -> bool:
            return (node.is_leaf and node.lock_ref == 0 and node is not keep
                    and _memory_key(node) not in pinned)

        heap = [(self.policy.sort_key(n), n.node_id, n) for n in self._iter_nodes() if evictable(n)]
        heapq.heapify(heap)
        freed, evicted = 0, []
        while freed < num_bytes and heap:
            _, _, leaf = heap[0]
            block = leaf.blocks.pop()
            width = block.shape[3]
            size = block.numel() * block.element_size()
            evicted.append(EvictedBlock(leaf.token_ids[-width:], leaf.end - width, size, leaf.omega))
            key = leaf.token_ids[0]
            leaf.token_ids = leaf.token_ids[:-width]
            leaf.storage = leaf.storage[:, :, :, :-width] if leaf.token_ids else None
            freed += size  # by ``_compact`` below, as no locked node views this memory
            self.total_tokens -= width
            self.evicted_tokens += width
            self.evicted_blocks += 1
            if leaf.token_ids:
                continue  # same key: its next trailing block stays at the top of the heap
            heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[key]
            if parent is not self.root and evictable(parent):
                heapq.heappush(heap, (self.policy.sort_key(parent), parent.node_id, parent))
        self._compact()
        return evicted

    def _free_out_of_window(self, num_bytes: int) -> None:
        """Free the sliding-window layers' KV of unlocked positions more than ``window + 1`` before
        their node's end, in policy order, until about ``num_bytes`` are freed.

        A node's end is where cached sequences end or part (an insert or a match splits a node
        there), so every such point keeps the window a match ending at it, or a token before it (a
        repeated prompt, whose last token is always computed), reads; the margin is the match
        rule's."""
        pinned = {memory for memory, (_, nodes) in self._memory_groups().items() if _any_locked(nodes)}
        keep = self.window + 1
        candidates = [node for node in self._iter_nodes()
                      if not node.window_freed and node.lock_ref == 0 and node.num_tokens > keep
                      and _memory_key(node) not in pinned]
        candidates.sort(key=lambda node: (self.policy.sort_key(node), node.node_id))
        layer_fraction = 1 - len(self.kept_layers) / self.num_layers
        freed = 0
        for node in candidates:
            if freed >= num_bytes:
                break
            node = self._split(node, node.num_tokens - keep)  # the upper part, out of every window
            try:
                kept = _own(node.storage[list(self.kept_layers)])
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                break
            freed += int(node.num_bytes * layer_fraction)
            node.storage, node.blocks, node.window_freed = kept, self._to_blocks(kept, node.start), True
            self.window_freed_tokens += node.num_tokens
        if freed:
            self._compact()

    def _compact(self) -> None:
        """Give the nodes that share memory no node covers any more (what eviction left behind in a
        split node's storage) storage of their own, so the dead bytes are freed; then count
        ``total_bytes`` afresh as the memory the nodes hold.

        Memory a locked node views is left as it is: the request reads it in place, so copying any
        node in it would hold the bytes twice. Out of memory for the copies, the memory is kept (and
        counted) as it is too; the next eviction tries again."""
        total_bytes = 0
        for nbytes, nodes in self._memory_groups().values():
            if sum(n.num_bytes for n in nodes) < nbytes and not _any_locked(nodes):
                try:
                    # Every copy before any is swapped in, so a failure leaves the nodes as they were.
                    copies = [_own(node.storage) for node in nodes]
                except Exception as error:
                    if not is_out_of_memory(error):
                        raise
                    copies = []
                if copies:
                    for node, storage in zip(nodes, copies):
                        node.storage = storage
                        node.blocks = self._to_blocks(storage, node.start)
                    nbytes = sum(storage.untyped_storage().nbytes() for storage in copies)
            total_bytes += nbytes
        self.total_bytes = total_bytes

    def _memory_groups(self) -> dict[int, tuple[int, list[RadixNode]]]:
        """The distinct memory the nodes' storage views: address -> (its bytes, the nodes viewing it)."""
        groups: dict[int, tuple[int, list[RadixNode]]] = {}
        for node in self._iter_nodes():
            memory = node.storage.untyped_storage()
            if memory.nbytes() == 0:
                continue  # a node of sliding layers only, whose KV was all freed
            groups.setdefault(memory.data_ptr(), (memory.nbytes(), []))[1].append(node)
        return groups

    def clear(self) -> None:
        """Drop every node eviction can free (all but the locked ones and those sharing their memory)
        and go back to the configured budget."""
        self._evict_blocks(self.total_bytes + 1, keep=None, free_window=False)
        self.restore_budget()

    # -- budget -----------------------------------------------------------------------------------
    def set_budget(self, budget_bytes: int) -> int:
        """Change the effective budget (> 0) and evict down to it; returns the bytes freed."""
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be an int > 0, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        return self.evict(self.total_bytes - budget_bytes) if self.total_bytes > budget_bytes else 0

    def shrink_budget(self, factor: float, *, min_budget_bytes: int | None = None) -> int:
        """Memory pressure (a forward pass ran out of memory): lower the effective budget to ``factor``
        times the current budget, and evict down to ``factor`` times the unlocked bytes held, so the
        retry finds memory freed now and the cache grows less afterwards.

        The budget goes no lower than ``min_budget_bytes`` (and does not rise to reach it), and
        never below the locked bytes: KV a running request has locked cannot be evicted, so a budget
        below it would leave ``total_bytes`` over the budget.

        Args:
            factor: In (0, 1).
            min_budget_bytes: Smallest budget to shrink to, >= 1: what one request's prompt needs
                cached, say. Default one block's worth of the last inserted KV (1 byte before any
                insert). Capped at the configured budget.

        Returns:
            The bytes freed.
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < 1:
            raise ValueError(f"factor must be a number in (0, 1), got {factor!r}")
        if min_budget_bytes is None:
            min_budget_bytes = max(1, self.block_size * self.bytes_per_token)
        elif (not isinstance(min_budget_bytes, int) or isinstance(min_budget_bytes, bool)
              or min_budget_bytes < 1):
            raise ValueError(f"min_budget_bytes must be an int >= 1, got {min_budget_bytes!r}")
        locked_bytes = self.locked_bytes
        floor = min(min_budget_bytes, self.configured_budget_bytes)
        shrunk = min(self.budget_bytes, max(floor, int(self.budget_bytes * factor)))
        self.budget_bytes = max(shrunk, locked_bytes)
        # A budget far above the held bytes frees nothing, so give back part of what is held too.
        unlocked_bytes = self.total_bytes - locked_bytes
        target = min(self.budget_bytes, locked_bytes + int(unlocked_bytes * factor))
        return self.evict(self.total_bytes - target) if self.total_bytes > target else 0

    def relax_budget(self, factor: float) -> int:
        """Grow a shrunk budget back towards the configured one after work that fit in memory:
        ``factor`` times the current budget (at least one byte more), capped at
        ``configured_budget_bytes``. Returns the new budget.

        Args:
            factor: > 1 and finite.
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 < factor < math.inf:
            raise ValueError(f"factor must be a finite number > 1, got {factor!r}")
        grown = max(self.budget_bytes + 1, math.ceil(self.budget_bytes * factor))
        self.budget_bytes = min(self.configured_budget_bytes, grown)
        return self.budget_bytes

    def restore_budget(self) -> None:
        """Go back to the configured budget after ``set_budget``/``shrink_budget``."""
        self.budget_bytes = self.configured_budget_bytes

    def reset_peak(self) -> None:
        """Start measuring ``peak_bytes`` afresh from what is held now, and zero ``evicted_tokens``
        and ``evicted_blocks`` (the engine's ``reset_stats`` calls this)."""
        self.peak_bytes = self.total_bytes
        self.evicted_tokens = 0
        self.evicted_blocks = 0
        self.window_freed_tokens = 0

    # -- locking --------------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction (reference counted)."""
        while node is not None and node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Release one ``lock`` of ``node``; unlocking a node that is not locked is an error."""
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of a node that is not locked")
            node.lock_ref -= 1
            node = node.parent

    # -- inspection -----------------------------------------------------------------------------
    @property
    def evictable_bytes(self) -> int:
        """Bytes that evicting every unlocked node would free: the memory no locked node views."""
        return sum(nbytes for nbytes, nodes in self._memory_groups().values() if not _any_locked(nodes))

    @property
    def locked_bytes(self) -> int:
        """Bytes no eviction can free now: the memory of the nodes running requests hold (``lock_ref >
        0``), including the unlocked nodes that share it."""
        return self.total_bytes - self.evictable_bytes

    def _iter_nodes(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def num_nodes(self) -> int:
        return sum(1 for _ in self._iter_nodes())

    def check_consistency(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (byte/token totals, tree
        links, block alignment, lock counts). For tests and debugging; walks the whole tree."""
        node_bytes = total_tokens = 0
        for node in self._iter_nodes():
            where = f"node at positions [{node.start}, {node.end})"
            assert node.token_ids, f"{where} is empty"
            assert node.parent.children.get(node.token_ids[0]) is node, f"{where} is not its parent's child"
            assert node.start == node.parent.end, f"{where} does not follow its parent (ends at {node.parent.end})"
            children_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= children_locks, (
                f"{where} has lock_ref {node.lock_ref} below its children's {children_locks}")
            assert node.storage is not None and node.storage.shape[3] == node.num_tokens, (
                f"{where}: storage does not hold its {node.num_tokens} tokens")
            if node.window_freed:
                assert node.storage.shape[0] == len(self.kept_layers), (
                    f"{where}: freed its window KV but holds {node.storage.shape[0]} layers")
            pos = node.start
            for block in node.blocks:
                width = block.shape[3]
                assert width >= 1, f"{where} holds an empty block"
                assert pos // self.block_size == (pos + width - 1) // self.block_size, (
                    f"{where}: block [{pos}, {pos + width}) crosses a block boundary")
                pos += width
            assert pos == node.end, f"{where}: blocks cover [{node.start}, {pos})"
            node_bytes += node.num_bytes
            total_tokens += node.num_tokens
        memory_bytes = sum(nbytes for nbytes, _ in self._memory_groups().values())
        assert memory_bytes == self.total_bytes, (
            f"total_bytes {self.total_bytes} but the nodes hold {memory_bytes} bytes of memory")
        assert node_bytes <= memory_bytes, f"nodes' blocks hold {node_bytes} bytes of {memory_bytes} bytes of memory"
        assert total_tokens == self.total_tokens, f"total_tokens {self.total_tokens} but nodes hold {total_tokens}"
