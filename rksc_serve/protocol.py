"""The OpenAI request bodies ``rksc serve`` accepts, validated with pydantic, and their translation
into the engine's ``SamplingParams``.

Promises:
    * A body that is not a JSON object, a field of the wrong type or out of range, a field this
      server does not support with a value that would change the answer (the deprecated
      ``functions``, non-zero penalties, ``logit_bias``, ``echo``, ``best_of``), a tool or
      ``response_format`` schema using a feature constrained decoding cannot enforce
      (``rksc_engine.structured.json_schema.check_schema``) raises ``pydantic.ValidationError`` or ``InvalidRequest``;
      both name the field, and the app turns them into HTTP 400 with OpenAI's error JSON.
    * ``tools``/``tool_choice`` and ``response_format`` become a ``ChatPlan``: the ``ToolRequest``
      and JSON schema that ``rksc_engine.structured.tools`` decodes under, exactly as the LangChain and
      LlamaIndex adapters do.
    * Types are strict (``"n": "2"`` and ``"stream": 1`` are refused, not coerced); unknown fields
      that do not change the answer (``user``, ``metadata``, ``store``, ...) are ignored.
    * Bounds that depend on the server's settings (``--max-tokens-limit``, ``--max-n``) come in as
      the validation context (``ServeLimits``).
    * Defaults are OpenAI's: ``temperature`` 1, ``top_p`` 1, ``n`` 1; ``max_tokens`` defaults to the
      server's limit for chat (the engine stops at the context window) and to 16 for ``/v1/completions``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from rksc_engine import SamplingParams
from rksc_engine.config import MAX_SEED
from rksc_engine.structured.json_schema import SchemaNotSupported, check_schema
from rksc_engine.structured.tools import ToolRequest

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


class FunctionCall(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"
    """A JSON string, as OpenAI sends it (an object is accepted too)."""


class HistoryToolCall(BaseModel):
    """A call an earlier assistant turn made, as an agent loop sends it back."""

    model_config = _STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def to_engine(self) -> dict[str, Any]:
        # Templates that render calls expect the arguments as an object; a JSON string is decoded.
        arguments: Any = self.function.arguments
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except json.JSONDecodeError:
                decoded = None
            arguments = decoded if isinstance(decoded, dict) else arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: ChatRole
    """OpenAI's roles; ``developer`` is rendered as ``system``."""
    content: Any = Field(None, validate_default=True)
    """A string, or a list of ``{"type": "text", "text": ...}`` parts (joined); None is empty."""
    tool_calls: list[HistoryToolCall] | None = None
    """An assistant turn's calls; rendered by a template that takes tools, else as ``<tool_call>`` blocks."""
    tool_call_id: str | None = None
    """A ``tool`` message's answer to that call."""
    name: str | None = None

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

    def to_engine(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [call.to_engine() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDefinition(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema (an object schema); calls are decoded under it."""
    strict: bool | None = None
    """Accepted: calls always follow the schema here."""

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "description": self.description or ""}
        if self.parameters is not None:
            out["parameters"] = self.parameters
        return out


class ToolDefinition(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: FunctionDefinition


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """The answer's JSON schema; without one the answer is a JSON object whose keys the model chooses."""
    strict: bool | None = None
    """Accepted: the answer always follows the schema here."""


class ResponseFormat(BaseModel):
    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


@dataclass(frozen=True)
class ChatPlan:
    """What a chat request asks beyond free text, in ``rksc_engine.structured.tools``' terms.

    Attributes:
        tools: The tools offered and whether a call is forced; None when none are offered (none
            given, or ``tool_choice`` is ``"none"``).
        json_answer: The answer must be JSON (``response_format`` ``json_object`` or ``json_schema``).
        schema: The JSON answer's schema; None is a JSON object whose keys the model chooses.
    """

    tools: ToolRequest | None = None
    json_answer: bool = False
    schema: dict[str, Any] | None = None

    @property
    def free_text(self) -> bool:
        """Plain generation: no tools offered, no JSON asked for."""
        return self.tools is None and not self.json_answer

    @property
    def constrained_from_start(self) -> bool:
        """A forced call or a JSON answer: decoded under its schema from the first token."""
        return self.json_answer or (self.tools is not None and self.tools.forced)


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
    tools: list[ToolDefinition] | None = None
    """Functions the model may call; each call is decoded under its ``parameters`` schema."""
    tool_choice: Any = None
    """``"auto"`` (default), ``"none"``, ``"required"`` or ``{"type": "function", "function": {"name": ...}}``."""
    parallel_tool_calls: bool | None = None
    """Accepted; a turn holds the calls the model makes, one when it is decoded under the schema."""
    functions: Any = None
    response_format: ResponseFormat | None = None
    """``text``, ``json_object`` or ``json_schema``: the JSON answers are decoded under the schema."""

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value: Any) -> Any:
        if value:
            raise ValueError("the deprecated functions field is not supported; send tools instead")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check(self) -> ChatPlan:
        """Checks across fields; returns the request's ``ChatPlan``."""
        self.check_stream_options()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
        for i, message in enumerate(self.messages):
            if message.tool_calls and message.role != "assistant":
                raise InvalidRequest(f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                                     f"messages[{i}].tool_calls")
        tools = self._tool_request()
        json_answer, schema = self._response_format()
        if json_answer and tools is not None and not tools.forced:
            raise InvalidRequest("response_format: a JSON answer with tools offered needs tool_choice 'none', "
                                 "'required' or a named function (a turn is either a call or the JSON answer)",
                                 "response_format")
        if self.logprobs and (tools is not None or json_answer):
            raise InvalidRequest("logprobs is not supported with tools or a JSON response_format: those answers "
                                 "are decoded in several constrained engine calls", "logprobs")
        return ChatPlan(tools, json_answer, schema)

    def _tool_request(self) -> ToolRequest | None:
        specs: dict[str, dict[str, Any]] = {}
        for i, tool in enumerate(self.tools or ()):
            function = tool.function
            if function.name in specs:
                raise InvalidRequest(f"tools[{i}].function.name: {function.name!r} is offered twice",
                                     f"tools[{i}].function.name")
            if function.parameters is not None:
                _check_schema(function.parameters, f"tools[{i}].function.parameters", object_only=True)
            specs[function.name] = function.spec()
        choice = _tool_choice(self.tool_choice, list(specs))
        return ToolRequest.build(list(specs.values()), choice) if specs else None

    def _response_format(self) -> tuple[bool, dict[str, Any] | None]:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return False, None
        if fmt.type == "json_object":
            return True, None
        if fmt.json_schema is None:
            raise InvalidRequest("response_format.json_schema is required when response_format.type is "
                                 "'json_schema'", "response_format.json_schema")
        schema = fmt.json_schema.schema_
        if schema is not None:
            _check_schema(schema, "response_format.json_schema.schema")
        return True, schema

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


def _tool_choice(choice: Any, names: list[str]) -> Any:
    """``tool_choice`` checked against the tools offered, in the form ``ToolRequest.build`` takes."""
    if choice is None or choice in ("auto", "none"):
        return choice
    if choice == "required":
        name = None
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        name = choice["function"]["name"]
    else:
        raise InvalidRequest(f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'function': "
                             f"{{'name': ...}}}}, got {json.dumps(choice)[:80]}", "tool_choice")
    if not names:
        raise InvalidRequest(f"tool_choice {json.dumps(choice)[:80]} needs tools", "tool_choice")
    if name is not None and name not in names:
        raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools {names}", "tool_choice")
    return choice


def _check_schema(schema: dict[str, Any], param: str, object_only: bool = False) -> None:
    """``InvalidRequest`` naming the schema's field where ``check_schema`` finds what decoding cannot enforce."""
    if object_only and schema.get("type", "object") != "object":
        raise InvalidRequest(f"{param}.type: a function's parameters must be an object schema, got "
                             f"{schema.get('type')!r}", f"{param}.type")
    try:
        check_schema(schema)
    except SchemaNotSupported as error:
        where = error_param((param, *error.loc))
        raise InvalidRequest(f"{where}: {error}", where) from None


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
