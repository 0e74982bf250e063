"""Result dataclasses at the engine's boundary, so adapters never reach into engine internals."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "eos"]


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
    """

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    branch_index: int = 0
    seed: int | None = None

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
    """A piece of streamed text; the last chunk of a stream carries the finished ``Completion``."""

    text: str
    token_ids: tuple[int, ...] = ()
    completion: Completion | None = None

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
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def prompt_reuse_rate(self) -> float:
        total = self.prompt_tokens_computed + self.prompt_tokens_reused
        return self.prompt_tokens_reused / total if total else 0.0

    def as_dict(self) -> dict:
        data = asdict(self)
        data["prompt_reuse_rate"] = self.prompt_reuse_rate
        return data
