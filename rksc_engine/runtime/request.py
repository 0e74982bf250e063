"""A request as the scheduler runs it, from submission to its end: its status, its branches, rows,
cache and the KV it holds; and, for a request whose monitor adds branches, the waves it spawns.

Where a request is in its life is its ``status`` (``RequestStatus``), which only the scheduler's
``RequestRegistry`` changes. What only some requests, or only some phases, use is grouped in small
parts: ``PrefillProgress`` (a prompt prefilled in passes), ``Branching`` (branches stopped or added
while it runs) and ``Replay`` (what a request that starts over already did).
"""

from __future__ import annotations

import enum
from collections.abc import Generator
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from ..config import SamplingParams
from ..kvcache.radix import RadixNode
from ..kvcache.shared_prefix import SharedPrefixCache
from ..kvcache.static_rows import StaticRows
from ..results import ASKSDecision, ChunkReuseDecision
from .detokenize import TextState
from .drafts import DraftIndex
from .handle import BranchMonitor, LogitsProcessor, RequestChannel
from .model_runner import DecodeLayout
from .prefix_access import Prefilled, PromptSegments


class RequestStatus(enum.Enum):
    """Where a request is. The live ones, in the order a request meets them:

    * ``WAITING``: queued for admission: submitted, or put back at the head of the queue after it ran
      out of memory (a preemption), to start over.
    * ``ADMITTED``: taken from the queue in this step; its prefill begins once the prompts packed
      before it are prefilled.
    * ``PACKED``: its prompt waits in this step's pack, to be prefilled with the others in one forward
      (or in the decode's own forward).
    * ``PREFILLING``: its prompt is prefilled in passes, one a step, while the others decode.
    * ``RUNNING``: its rows decode. A submitted request whose own rows have ended stays ``RUNNING``
      while the waves its monitor added still decode.

    And the ended ones: ``FINISHED`` (its completions delivered; for a wave, its rows done),
    ``FAILED`` and ``CANCELLED`` (by its caller).
    """

    WAITING = "waiting"
    ADMITTED = "admitted"
    PACKED = "packed"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def live(self) -> bool:
        """Whether a request of this status is still the scheduler's to advance."""
        return self not in ENDED


ENDED = frozenset({RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.CANCELLED})


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
    text_state: TextState = field(default_factory=TextState)  # how many tokens `text` covers
    stop_checked_chars: int = 0  # `text[:stop_checked_chars]` holds no stop string
    drafted_tokens: int = 0  # draft tokens proposed for it and verified (``drafted_step``)
    accepted_draft_tokens: int = 0  # of those, the ones it kept: each one a forward it did not need


@dataclass
class PrefillProgress:
    """A prompt's prefill while it runs in passes, one a step.

    Attributes:
        passes: The prefill (``Prefiller.prefill_steps``): ``send`` it a pass's token budget and it
            yields the tokens that pass computed, or returns the ``Prefilled`` prompt after its last.
        computed_tokens: Tokens its finished passes computed (yielded so far).
    """

    passes: Generator[int, int | None, Prefilled]
    computed_tokens: int = 0


@dataclass
class PromptFork:
    """What a wave of added branches forks off: the prompt's KV exactly as the first wave took it
    (the segments read in place from the radix cache, or a copy of the batch-1 prompt cache) and
    the (1, V) logits after the prompt."""

    prompt_kv: PromptSegments | Cache
    last_logits: torch.Tensor


@dataclass
class Branching:
    """How the branches of a submitted request may change while it runs (read on the submitted
    request, never on a wave): branches ended early by its caller or its monitor, and branches its
    monitor adds (``max_branches > n``), each batch of them decoding as a wave: a member request
    of its own that shares the owner's branches, generators, channel and radix lock.

    Attributes:
        monitor: Watches the branches and may stop some or add more.
        max_branches: Most branches the request may have, added ones included.
        fork: The prompt's KV and last logits, kept while it runs when it may add branches.
        live_members: Itself and its waves while they have rows.
        pending_stop: Branches to end before the next forward.
        stopped: Whether some branch was stopped (by its caller or its monitor).
    """

    monitor: BranchMonitor | None = None
    max_branches: int = 0
    fork: PromptFork | None = None
    live_members: int = 0
    pending_stop: set[int] = field(default_factory=set)
    stopped: bool = False


@dataclass
class Replay:
    """What a request that starts over (preempted, or put back in the queue when its prefill ran out
    of memory) already did, so that doing it again is not seen twice.

    Attributes:
        admissions: How often it was admitted (counted as a request once).
        delivered: Per branch, the tokens and characters its stream already delivered: the recomputed
            branch (the same tokens: same prompt, same seeds) does not deliver them again.
    """

    admissions: int = 0
    delivered: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass(eq=False)
class Request:
    """A request as the scheduler advances it: a submitted request, or a wave of branches its
    monitor added (``owner`` set)."""

    request_id: int
    prompt_ids: list[int]
    n: int
    params: SamplingParams
    channel: RequestChannel
    stream: bool
    logits_processor: LogitsProcessor | None
    seed: int
    context_spans: tuple[tuple[int, int], ...] | None = None  # the prompt cut at the chunk separator
    status: RequestStatus | None = None  # set by the registry only (None until registered)
    # Set at admission:
    layout: DecodeLayout = DecodeLayout.DYNAMIC_CACHE  # how its branches hold their KV (the runner decides)
    prefill: PrefillProgress | None = None  # while its prompt is prefilled in passes
    # Set when it starts decoding:
    branches: list[Branch] = field(default_factory=list)
    active: list[int] = field(default_factory=list)  # active[row] = branch index of that batch row
    generators: list[torch.Generator] = field(default_factory=list)
    # SharedPrefixCache or StaticRows (batched with others), or a transformers DynamicCache (alone).
    cache: Cache | StaticRows | None = None
    next_tokens: torch.Tensor | None = None  # (rows,) the tokens the next forward feeds
    # Drafting (``drafted_step``), on the submitted request: its drafts' sources, made on its first
    # drafted step, and the decode forwards its rows (its waves' included) took part in since it started.
    draft_index: DraftIndex | None = None
    decode_forwards: int = 0
    max_new: int = 0
    num_cached_tokens: int = 0
    exact: bool = True
    reuse_decision: ASKSDecision | ChunkReuseDecision | None = None  # what approximate reuse did, if it acted
    locked_node: RadixNode | None = None  # the radix node whose path the request reads in place (locked until it ends)
    num_private_segments: int = 0  # prompt segments the request holds itself (not read from the radix cache)
    owner: Request | None = None  # on a wave: the submitted request it belongs to
    branching: Branching = field(default_factory=Branching)
    replay: Replay = field(default_factory=Replay)
    # Set when it starts decoding: whether anything reads its branches while they run (a stream, a
    # stop string, a monitor, a logits processor). Unwatched, a branch's text is decoded once, when
    # it ends, and one whose tokens are chosen with others' (``sampling.batch_choices``) is advanced
    # with them in one loop.
    watched: bool = True

    @property
    def row_generators(self) -> list[torch.Generator]:
        """Its rows' generators, in row order (none when greedy)."""
        return [self.generators[b] for b in self.active] if self.generators else []

    @property
    def shared_prefix(self) -> bool:
        """Whether it decodes (or will) through ``SharedPrefixCache``."""
        return self.layout is DecodeLayout.SHARED_PREFIX

    @property
    def shared(self) -> bool:
        return isinstance(self.cache, SharedPrefixCache)

    @property
    def static(self) -> bool:
        return isinstance(self.cache, StaticRows)

    @property
    def head(self) -> Request:
        """The request the caller submitted (itself, or the owner of this wave)."""
        return self.owner or self

    @property
    def preemptible(self) -> bool:
        # Starting over replays every branch from its first token: a monitor would count them twice,
        # a branch already stopped would run again, and the KV of a request's waves (drafting starts
        # branches as waves) is not its own to free. Such requests are never the ones preempted.
        return (self.owner is None and self.branching.monitor is None and not self.branching.stopped
                and self.branching.live_members <= 1)
