"""A request as the scheduler runs it, from admission to retirement: its branches, rows, cache
and the KV it holds; and, for a request whose monitor adds branches, the waves it spawns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import SamplingParams
from ..kvcache.shared_prefix import SharedPrefixCache
from ..results import ASKSDecision, ChunkReuseDecision
from .handle import BranchMonitor, LogitsProcessor, RequestChannel


@dataclass
class Branch:
    """Mutable decoding state of one branch."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    emitted_chars: int = 0  # for streaming: how much of `text` has been handed out
    pending_ids: list[int] = field(default_factory=list)  # for streaming: tokens not yet handed out
    skip_tokens: int = 0  # tokens already handed out before a preemption, not to be handed out again


@dataclass(eq=False)
class Request:
    """A request as the scheduler advances it."""

    request_id: int
    prompt_ids: list[int]
    n: int
    params: SamplingParams
    channel: RequestChannel
    stream: bool
    logits_processor: LogitsProcessor | None
    seed: int
    # Set at admission:
    branches: list[Branch] = field(default_factory=list)
    active: list[int] = field(default_factory=list)  # active[row] = branch index of that batch row
    generators: list[torch.Generator] = field(default_factory=list)
    cache: Any = None  # SharedPrefixCache (batched with others) or a transformers DynamicCache (alone)
    next_tokens: torch.Tensor | None = None  # (rows,) the tokens the next forward feeds
    max_new: int = 0
    num_cached_tokens: int = 0
    exact: bool = True
    asks: ASKSDecision | ChunkReuseDecision | None = None
    segments: tuple[tuple[int, int], ...] | None = None  # the prompt cut at the chunk separator
    locked_node: Any = None  # the radix node whose path the request reads in place (locked until it ends)
    prefill: Any = None  # the prompt's prefill while it runs in chunks (engine.prefill_steps)
    prefill_done: int = 0  # tokens its finished prefill passes computed
    shared_prefix: bool = False  # decode through SharedPrefixCache (the engine's probe said yes)
    num_private_segments: int = 0  # prompt segments the request holds itself (not read from the radix cache)
    admissions: int = 0  # how often it was admitted (more than once after a preemption)
    # After a preemption: per branch, how many tokens and characters its stream already delivered, so
    # the recomputed branch (the same tokens: same prompt, same seeds) does not deliver them twice.
    delivered: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Branch control. A request whose monitor may add branches (max_branches > n) keeps its prompt's
    # KV and last logits (``fork``) while it runs; each added wave decodes as a member request of its
    # own (``owner`` set) that shares the owner's branches, generators, channel and radix lock.
    monitor: BranchMonitor | None = None
    max_branches: int = 0
    owner: Request | None = None
    fork: tuple[Any, torch.Tensor] | None = None  # (prompt KV to fork from, (1, V) logits after the prompt)
    live_members: int = 0  # on an owner: itself and its waves while they have rows
    pending_stop: set[int] = field(default_factory=set)  # on an owner: branches to end before the next forward
    branches_stopped: bool = False  # on an owner: some branch was stopped (by its caller or its monitor)

    @property
    def shared(self) -> bool:
        return isinstance(self.cache, SharedPrefixCache)

    @property
    def head(self) -> Request:
        """The request the caller submitted (itself, or the owner of this wave)."""
        return self.owner or self

    @property
    def preemptible(self) -> bool:
        # Starting over replays every branch from its first token: a monitor would count them twice,
        # and a branch already stopped would run again. Such requests are never the ones preempted.
        return self.owner is None and self.monitor is None and not self.branches_stopped
