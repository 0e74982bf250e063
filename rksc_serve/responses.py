"""OpenAI response bodies built from the engine's ``Completion``s: whole responses, stream chunks,
usage.

Two shapes share one interface (``ChatShape`` for ``/v1/chat/completions``, ``TextShape`` for
``/v1/completions``), so the app builds and streams both with the same code.

Mapping:
    * ``finish_reason``: the engine's ``eos`` and ``stop`` are OpenAI's ``"stop"``, ``length`` is
      ``"length"``; a turn that made tool calls is ``"tool_calls"``. ``stop_reason`` (as vLLM sends it) is the stop string that ended the choice, None
      when the model ended it (EOS) or it ran out of tokens, so a client can tell ``eos`` from ``stop``.
    * ``usage``: ``prompt_tokens`` counts each prompt once however many choices it has (OpenAI's
      rule), ``completion_tokens`` every generated token of every choice, and
      ``prompt_tokens_details.cached_tokens`` the prompt tokens whose KV came from the prefix cache
      (``Completion.num_cached_tokens``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rksc_engine import Completion, StreamChunk
from rksc_engine.structured.constrained import ToolCall
from rksc_serve.logprobs import TokenText, TopTokens, chat_logprobs, completion_logprobs

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def stop_reason(completion: Completion, stops: tuple[str, ...], tokenizer: Any) -> str | None:
    """The stop string that ended ``completion``, None unless it ended on one."""
    if completion.finish_reason != "stop" or not stops:
        return None
    full = tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)
    return next((s for s in stops if full.startswith(s, len(completion.text))), stops[0])


@dataclass(frozen=True)
class Turn:
    """One chat choice decided with tools offered or a JSON answer asked for (``rksc_serve.tool_turns``).

    Attributes:
        content: The message text (None in the body when it is empty and calls were made).
        tool_calls: The calls made.
        finish_reason: OpenAI's: ``"tool_calls"``, ``"stop"`` or ``"length"``.
        stop_reason: The stop string that ended a free answer, else None.
        num_prompt_tokens, num_cached_tokens: The prompt's accounting (its first engine call's).
        num_generated_tokens: Every token generated for the turn, over all its engine calls.
    """

    content: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    stop_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int


def openai_tool_calls(calls: Sequence[ToolCall], *, indexed: bool = False) -> list[dict[str, Any]]:
    """``message.tool_calls`` (or, ``indexed``, a stream delta's): arguments as a JSON string."""
    out = []
    for i, call in enumerate(calls):
        entry = {"id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
        out.append({"index": i, **entry} if indexed else entry)
    return out


def token_usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage`` body."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage(prompts: list[list[Completion]]) -> dict[str, Any]:
    """OpenAI's ``usage`` of one request, from its completions grouped per prompt."""
    prompt_tokens = sum(cs[0].num_prompt_tokens for cs in prompts if cs)
    cached_tokens = sum(cs[0].num_cached_tokens for cs in prompts if cs)
    completion_tokens = sum(c.num_generated_tokens for cs in prompts for c in cs)
    return token_usage(prompt_tokens, cached_tokens, completion_tokens)


def turns_usage(turns: Sequence[Turn]) -> dict[str, Any]:
    """OpenAI's ``usage`` of one prompt's turns: its prompt once, every turn's generated tokens."""
    first = turns[0] if turns else None
    return token_usage(first.num_prompt_tokens if first else 0, first.num_cached_tokens if first else 0,
                       sum(t.num_generated_tokens for t in turns))


class ChatShape:
    """``chat.completion`` and ``chat.completion.chunk`` bodies."""

    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, token_text: TokenText) -> None:
        self.token_text = token_text

    def logprobs(self, completion: Completion | StreamChunk, top: list[TopTokens] | None) -> dict[str, Any]:
        return chat_logprobs(completion, self.token_text, top)

    def choice(self, index: int, completion: Completion, logprobs: dict | None, stop: str | None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": completion.text},
                "logprobs": logprobs, "finish_reason": FINISH_REASONS[completion.finish_reason], "stop_reason": stop}

    def opening_choice(self, index: int) -> dict[str, Any] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta_choice(self, index: int, text: str, logprobs: dict | None = None) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}

    def final_choice(self, index: int, text: str, completion: Completion, logprobs: dict | None,
                     stop: str | None) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": FINISH_REASONS[completion.finish_reason], "stop_reason": stop}


    def turn_choice(self, index: int, turn: Turn) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": turn.content or (None if turn.tool_calls else "")}
        if turn.tool_calls:
            message["tool_calls"] = openai_tool_calls(turn.tool_calls)
        return {"index": index, "message": message, "logprobs": None, "finish_reason": turn.finish_reason,
                "stop_reason": turn.stop_reason}

    def turn_chunks(self, index: int, text: str, turn: Turn) -> list[dict[str, Any]]:
        """A decided turn's last chunks: ``text`` not streamed yet, its calls whole (each with its
        id, name and complete arguments, as OpenAI's clients accumulate them), then the finish."""
        chunks = [self.delta_choice(index, text)] if text else []
        if turn.tool_calls:
            chunks.append({"index": index, "delta": {"tool_calls": openai_tool_calls(turn.tool_calls, indexed=True)},
                           "logprobs": None, "finish_reason": None})
        chunks.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": turn.finish_reason,
                       "stop_reason": turn.stop_reason})
        return chunks


class TextShape:
    """``text_completion`` bodies (whole and streamed: OpenAI uses one object name for both)."""

    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, token_text: TokenText) -> None:
        self.token_text = token_text

    def logprobs(self, completion: Completion | StreamChunk, top: list[TopTokens] | None) -> dict[str, Any]:
        return completion_logprobs(completion, self.token_text, top)

    def choice(self, index: int, completion: Completion, logprobs: dict | None, stop: str | None) -> dict[str, Any]:
        return {"index": index, "text": completion.text, "logprobs": logprobs,
                "finish_reason": FINISH_REASONS[completion.finish_reason], "stop_reason": stop}

    def opening_choice(self, index: int) -> dict[str, Any] | None:
        return None

    def delta_choice(self, index: int, text: str, logprobs: dict | None = None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}

    def final_choice(self, index: int, text: str, completion: Completion, logprobs: dict | None,
                     stop: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": FINISH_REASONS[completion.finish_reason], "stop_reason": stop}


Shape = ChatShape | TextShape


def envelope(shape: Shape, request_id: str, created: int, model: str, choices: list[dict], *,
             chunk: bool, usage_body: dict | None = None) -> dict[str, Any]:
    """The body around ``choices``: a whole response (``chunk=False``) or one stream chunk."""
    body = {"id": request_id, "object": shape.chunk_object if chunk else shape.object, "created": created,
            "model": model, "choices": choices}
    if usage_body is not None or not chunk:
        body["usage"] = usage_body
    return body
