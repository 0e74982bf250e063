"""Typed, validated configuration for the engine and for one generation call.

Every field has a documented default and is checked in ``__post_init__``; a bad value raises
``ValueError`` (or ``TypeError`` for a wrong type) naming the field and the allowed range, before
any model or cache state is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def _check_type(name: str, value: object, expected: type | tuple[type, ...]) -> None:
    # bool is an int subclass; a flag passed where a count is expected is a bug, not a 1.
    if isinstance(value, bool) and bool not in (expected if isinstance(expected, tuple) else (expected,)):
        raise TypeError(f"{name} must be {_type_name(expected)}, got bool")
    if not isinstance(value, expected):
        raise TypeError(f"{name} must be {_type_name(expected)}, got {type(value).__name__}")


def _type_name(expected: type | tuple[type, ...]) -> str:
    if isinstance(expected, tuple):
        return " or ".join(t.__name__ for t in expected)
    return expected.__name__


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request.

    Attributes:
        max_new_tokens: Upper bound on generated tokens per branch, >= 1. Default 256.
        temperature: 0 means greedy (argmax); > 0 samples from ``softmax(logits / temperature)``. Default 0.
        top_p: Nucleus mass in (0, 1]; 1 disables it. Default 1.
        top_k: Keep the k most likely tokens; 0 disables it. Default 0.
        stop: Strings that end a branch; the text is cut before the first occurrence. Default none.
        seed: Seed of branch 0; branch i draws from its own generator seeded ``seed + i``, so a branch
            is the same whether it runs alone or beside siblings. ``None`` picks a fresh seed per call.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_type("max_new_tokens", self.max_new_tokens, int)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check_type("temperature", self.temperature, (int, float))
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check_type("top_p", self.top_p, (int, float))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_type("top_k", self.top_k, int)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"stop must be a string or a sequence of strings, got {self.stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        object.__setattr__(self, "stop", tuple(stop))
        if self.seed is not None:
            _check_type("seed", self.seed, int)
            if self.seed < 0:
                raise ValueError(f"seed must be >= 0 or None, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class PrefixCacheConfig:
    """The radix prefix cache shared across calls.

    Attributes:
        enabled: Reuse KV of previously computed token prefixes. Default True.
        budget_mb: Byte budget of cached KV, in MiB (> 0). Unlocked leaves are evicted least recently
            used first when an insert would pass it. Default 1024 (about 22k tokens on the default model
            in fp32).
    """

    enabled: bool = True
    budget_mb: float = 1024.0

    def __post_init__(self) -> None:
        _check_type("prefix_cache.enabled", self.enabled, bool)
        _check_type("prefix_cache.budget_mb", self.budget_mb, (int, float))
        if not self.budget_mb > 0:
            raise ValueError(f"prefix_cache.budget_mb must be > 0, got {self.budget_mb}")

    @property
    def budget_bytes(self) -> int:
        return int(self.budget_mb * 1024 * 1024)


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings.

    Attributes:
        prefix_cache: Settings of the radix prefix cache.
        trust_remote_code: Passed to ``transformers`` when loading a model directory. Default False.
    """

    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        _check_type("prefix_cache", self.prefix_cache, PrefixCacheConfig)
        _check_type("trust_remote_code", self.trust_remote_code, bool)
