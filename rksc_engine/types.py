"""Result dataclasses at the engine's boundary, so adapters never reach into engine internals."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "eos"]


@dataclass(frozen=True)
class ASKSDecision:
    """What ASKS did for one prompt (see ``rksc_engine.asks``).

    Attributes:
        reused: Whether cached KV of the realigned remainder was reused (approximate KV).
        sigma: Layer-weighted cosine similarity of the two differing spans' hidden states.
        tau: The threshold ``sigma`` was compared with.
        prefix_tokens: Tokens shared token for token with the cached sequence (exact cached KV).
        request_span_tokens: Length of the request's differing span.
        cached_span_tokens: Length of the cached sequence's differing span.
        remainder_tokens: Length of the realigned remainder both sequences share after their spans.
        position_shift: ``request_span_tokens - cached_span_tokens``, the rotary shift of reused keys.
        reused_tokens: Remainder tokens whose cached KV was reused (0 when not reused).
        recomputed_tokens: Remainder tokens computed by the request itself (all of them on a fallback).
        check_tokens: Tokens of the cached span recomputed only to read their hidden states.
        probe_tokens: Remainder tokens run through the first decoder layers to measure how far their
            reused KV deviates (``recompute_selection="deviation"``; 0 otherwise).
        mean_deviation: Mean over the remainder of the relative KV deviation at the probe layer,
            ``||kv_reused - kv_exact|| / ||kv_exact||``; None when not probed.
        max_deviation: The largest per-token deviation; None when not probed.
    """

    reused: bool
    sigma: float
    tau: float
    prefix_tokens: int
    request_span_tokens: int
    cached_span_tokens: int
    remainder_tokens: int
    position_shift: int
    reused_tokens: int
    recomputed_tokens: int
    check_tokens: int
    probe_tokens: int = 0
    mean_deviation: float | None = None
    max_deviation: float | None = None
    kind: str = "realign"


@dataclass(frozen=True)
class ChunkReuseDecision:
    """What retrieved-context reuse did for one prompt (see ``rksc_engine.chunk_reuse``).

    Attributes:
        reused: Whether cached chunk KV was reused (approximate KV).
        segments: Segments the prompt was cut into at the chunk separator.
        chunks_reused: Chunks whose cached KV was placed in the prompt.
        chunks_cached: Chunks prefilled on their own for this prompt (seen for the first time).
        prefix_tokens: Leading tokens served exact KV by the token-exact radix cache.
        reused_tokens: Prompt tokens served reused chunk KV (after repair).
        recomputed_tokens: Reused-chunk tokens recomputed through every layer instead (all of them
            when the deviation gate refused the reuse).
        probe_tokens: Reused tokens run through the first decoder layers to measure their deviation.
        mean_deviation: Mean relative KV deviation of the reused tokens at the probe layer; None when
            not probed.
        max_deviation: The largest per-token deviation; None when not probed.
    """

    reused: bool
    segments: int
    chunks_reused: int
    chunks_cached: int
    prefix_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    probe_tokens: int = 0
    mean_deviation: float | None = None
    max_deviation: float | None = None
    kind: str = "chunks"


@dataclass(frozen=True)
class Completion:
    """One generated branch.

    Attributes:
        text: Generated text only (never the prompt), cut before the first stop string, special
            tokens removed.
        token_ids: Generated token ids, including the EOS token or the token that completed a stop string.
        logprobs: Per generated token, its log-probability under the model's unmodified distribution
            (temperature 1, no top-k/top-p), so confidences compare across sampling settings.
        finish_reason: ``"eos"`` (model ended), ``"stop"`` (a stop string), or ``"length"``
            (``max_new_tokens`` or the context window).
        num_prompt_tokens: Tokens in the prompt.
        num_cached_tokens: Prompt tokens whose KV came from the prefix cache instead of being computed.
        branch_index: Position among siblings; the branch drew from the generator seeded ``seed + branch_index``.
        seed: The seed of branch 0 of the call.
        asks: What ASKS did for the prompt: an ``ASKSDecision`` (a reworded span realigned with a
            cached sequence) or a ``ChunkReuseDecision`` (retrieved chunks reused at new positions);
            None when ASKS did not act.
    """

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    branch_index: int = 0
    seed: int | None = None
    asks: ASKSDecision | ChunkReuseDecision | None = None

    @property
    def confidence(self) -> float:
        """``exp(mean token logprob)``: the geometric-mean probability of the generated tokens."""
        if not self.logprobs:
            return 0.0
        return math.exp(sum(self.logprobs) / len(self.logprobs))

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StreamChunk:
    """A piece of streamed text; the last chunk of a branch carries its finished ``Completion``.

    Attributes:
        text: New text since the previous chunk of the same branch.
        token_ids: The tokens generated since that chunk.
        completion: Set on the branch's last chunk.
        branch_index: Which branch of the request this chunk belongs to.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    completion: Completion | None = None
    branch_index: int = 0

    @property
    def is_last(self) -> bool:
        return self.completion is not None


@dataclass
class EngineStats:
    """Cumulative counters since the engine was built (or ``reset_stats``)."""

    requests: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_reused: int = 0
    decode_tokens: int = 0
    prefills: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_bytes: int = 0
    cache_tokens: int = 0
    cache_evicted_tokens: int = 0
    cache_peak_bytes: int = 0  # most KV bytes the prefix cache held at once (since reset_stats)
    cache_budget_bytes: int = 0  # its effective budget now (shrinks after out-of-memory errors)
    oom_retries: int = 0  # forward passes retried after an out-of-memory error
    asks_checks: int = 0  # prompts whose differing span ASKS compared with a cached one
    asks_reuses: int = 0  # of those, prompts that reused the cached remainder
    asks_reused_tokens: int = 0  # prompt tokens served approximate (reused, re-rotated) KV
    asks_recomputed_tokens: int = 0  # remainder tokens computed instead (fallbacks, selective recompute)
    asks_check_tokens: int = 0  # cached-span tokens recomputed only to compare hidden states
    chunk_reuse_prompts: int = 0  # prompts that reused retrieved chunks' KV (asks.reuse_chunks)
    chunks_reused: int = 0  # chunks placed in those prompts from the cache
    chunk_tokens_cached: int = 0  # chunk tokens prefilled on their own the first time a chunk was seen
    chunk_recomputed_tokens: int = 0  # reused-chunk tokens recomputed by the repair (or the gate)
    chunk_probe_tokens: int = 0  # reused-chunk tokens run through the first layers to measure deviation
    running_requests: int = 0  # requests decoding now
    waiting_requests: int = 0  # requests queued for admission
    running_kv_bytes: int = 0  # KV the running requests hold outside the prefix cache
    peak_running_kv_bytes: int = 0  # the most they held at once (since reset_stats)
    peak_batch_rows: int = 0  # the most branches decoded in one forward (since reset_stats)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def prompt_reuse_rate(self) -> float:
        total = self.prompt_tokens_computed + self.prompt_tokens_reused
        return self.prompt_tokens_reused / total if total else 0.0

    def as_dict(self) -> dict:
        data = asdict(self)
        data["prompt_reuse_rate"] = self.prompt_reuse_rate
        return data
