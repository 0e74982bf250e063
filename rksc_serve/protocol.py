"""The OpenAI request bodies ``rksc serve`` accepts, validated with pydantic, and their translation
into the engine's ``SamplingParams``.

Promises:
    * A body that is not a JSON object, a field of the wrong type or out of range, a field this
      server does not support with a value that would change the answer (``tools``,
      ``response_format`` other than text, non-zero penalties, ``logit_bias``, ``echo``, ``best_of``)
      raises ``pydantic.ValidationError`` or ``InvalidRequest``; both name the field, and the app
      turns them into HTTP 400 with OpenAI's error JSON.
    * Types are strict (``"n": "2"`` and ``"stream": 1`` are refused, not coerced); unknown fields
      that do not change the answer (``user``, ``metadata``, ``store``, ...) are ignored.
    * Bounds that depend on the server's settings (``--max-tokens-limit``, ``--max-n``) come in as
      the validation context (``ServeLimits``).
    * Defaults are OpenAI's: ``temperature`` 1, ``top_p`` 1, ``n`` 1; ``max_tokens`` defaults to the
      server's limit for chat (the engine stops at the context window) and to 16 for ``/v1/completions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from rksc_engine import SamplingParams
from rksc_engine.config import MAX_SEED

# OpenAI's default number of tokens of a legacy completion when the request names none.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Most stop strings per request, and most top logprobs per token (OpenAI's own bound is 20).
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


class InvalidRequest(ValueError):
    """A request the server refuses (HTTP 400); ``param`` names the field, None for the whole body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask of the server.

    Attributes:
        max_tokens: Most ``max_tokens`` (and default for chat) per request, >= 1. Default 4096.
        max_n: Most generations per request (``n`` times the number of prompts), >= 1. Default 64.
        max_body_bytes: Largest request body in bytes, >= 1. Default 1 MiB.
    """

    max_tokens: int = 4096
    max_n: int = 64
    max_body_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_n", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _limits(info: ValidationInfo) -> ServeLimits:
    return info.context.get("limits", ServeLimits()) if isinstance(info.context, dict) else ServeLimits()


def within_max_n(value: int, info: ValidationInfo) -> int:
    """A field validator's body: ``value`` unless it is over the server's ``--max-n``."""
    limit = _limits(info).max_n
    if value > limit:
        raise ValueError(f"must be at most {limit} (the server's --max-n), got {value}")
    return value


def within_max_tokens(value: int | None, info: ValidationInfo) -> int | None:
    """A field validator's body: ``value`` unless it is over the server's ``--max-tokens-limit``."""
    limit = _limits(info).max_tokens
    if value is not None and value > limit:
        raise ValueError(f"must be at most {limit} (the server's --max-tokens-limit), got {value}")
    return value


_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False
    """Send a last chunk, before ``[DONE]``, with the request's token usage."""


class _GenerationRequest(BaseModel):
    """The fields both endpoints share."""

    model_config = _STRICT

    model: str | None = None
    """Echoed back; the server has one model, so any name is accepted."""
    n: int = Field(1, ge=1)
    """Generations per prompt: sibling branches over one prefill, branch i seeded ``seed + i``."""
    temperature: float | None = Field(None, ge=0, le=2)
    """0 is greedy; default 1 (OpenAI's)."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus mass; default 1."""
    top_k: int | None = Field(None, ge=0)
    """Keep the k most likely tokens, 0 disables (an extension vLLM and SGLang accept too)."""
    max_tokens: int | None = Field(None, ge=1)
    """Most generated tokens per generation."""
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    """Seed of generation 0; generation i is seeded ``seed + i``, so a seeded request is reproducible."""
    stop: Any = Field(None, validate_default=True)
    """A stop string or a list of them; the text is cut before the first one."""
    stream: bool = False
    """Answer with server-sent events, one chunk per decode step and generation."""
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _n_within_limit(cls, value: int, info: ValidationInfo) -> int:
        return within_max_n(value, info)

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _max_tokens_within_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        return within_max_tokens(value, info)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"must have at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return tuple(stops)

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("is not supported by this server (only 0)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict | None) -> dict | None:
        if value:
            raise ValueError("is not supported by this server")
        return value

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's parameters for one generation of this request."""
        return SamplingParams(
            max_new_tokens=self.requested_max_tokens() or default_max_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=self.top_k or 0,
            stop=self.stop,
            seed=self.seed,
        )

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: ChatRole
    """OpenAI's roles; ``developer`` is rendered as ``system``."""
    content: Any = Field(None, validate_default=True)
    """A string, or a list of ``{"type": "text", "text": ...}`` parts (joined); None is empty."""

    @field_validator("content")
    @classmethod
    def _text_content(cls, value: Any) -> str:
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            texts = []
            for i, part in enumerate(value):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"part {i} is {kind!r}; only text parts ({{'type': 'text', 'text': ...}}) "
                                     f"are supported")
                texts.append(part["text"])
            return "".join(texts)
        raise ValueError(f"must be a string or a list of text parts, got {type(value).__name__}")

    def to_engine(self) -> dict[str, str]:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    """The conversation, rendered with the model's chat template."""
    max_completion_tokens: int | None = Field(None, ge=1)
    """OpenAI's newer name for ``max_tokens``; wins when both are given."""
    logprobs: bool = False
    """Return each generated token's log-probability."""
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """With ``logprobs``, also the k most likely tokens at each position."""
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    response_format: Any = None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: Any) -> Any:
        if value:
            raise ValueError("tool calling is not supported by this server yet")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_none(cls, value: Any) -> Any:
        if value not in (None, "none", "auto"):
            raise ValueError("tool calling is not supported by this server yet")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value: Any) -> Any:
        if value is not None and value != {"type": "text"}:
            raise ValueError("only {'type': 'text'} is supported by this server yet")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check(self) -> None:
        self.check_stream_options()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    @property
    def num_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``."""

    prompt: Any
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """Return each token's log-probability and this many most likely tokens per position."""
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Any) -> list[str | list[int]]:
        if isinstance(value, str):
            value = [value]
        elif isinstance(value, list) and value and all(_is_token_id(t) for t in value):
            value = [value]
        if not isinstance(value, list) or not value:
            raise ValueError("must be a string, a list of strings, a list of token ids or a list of such lists")
        for i, prompt in enumerate(value):
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError(f"prompt {i} is empty")
            elif not (isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt)):
                raise ValueError(f"prompt {i} must be a non-empty string or a non-empty list of token ids")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("is not supported by this server")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("is not supported by this server (use n and pick yourself)")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("is not supported by this server")
        return value

    def check(self, limits: ServeLimits) -> None:
        self.check_stream_options()
        total = self.n * len(self.prompt)
        if total > limits.max_n:
            raise InvalidRequest(f"n times the number of prompts is {total}, more than the server's --max-n "
                                 f"({limits.max_n})", "n")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0


def _is_token_id(value: Any) -> bool:
    return type(value) is int and value >= 0


def error_param(loc: tuple[Any, ...]) -> str | None:
    """A pydantic error location as a field path: ``("messages", 0, "role")`` -> ``messages[0].role``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def engine_error_param(message: str, default: str) -> str:
    """The request field an engine ``ValueError``/``TypeError`` message is about (its first word names
    the engine's argument), as the OpenAI field; ``default`` (the prompt field) otherwise."""
    head = message.split(" ", 1)[0].split("[", 1)[0].split("=", 1)[0]
    return {"n": "n", "seed": "seed", "max_new_tokens": "max_tokens", "temperature": "temperature",
            "top_p": "top_p", "top_k": "top_k", "stop": "stop"}.get(head, default)
