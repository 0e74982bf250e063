"""OpenAI response bodies built from the engine's ``Completion``s: whole responses, stream chunks,
usage.

Two shapes share one interface (``ChatShape`` for ``/v1/chat/completions``, ``TextShape`` for
``/v1/completions``), so the app builds and streams both with the same code.

Mapping:
    * ``finish_reason``: the engine's ``eos`` and ``stop`` are OpenAI's ``"stop"``, ``length`` is
      ``"length"``. ``stop_reason`` (as vLLM sends it) is the stop string that ended the choice, None
      when the model ended it (EOS) or it ran out of tokens, so a client can tell ``eos`` from ``stop``.
    * ``usage``: ``prompt_tokens`` counts each prompt once however many choices it has (OpenAI's
      rule), ``completion_tokens`` every generated token of every choice, and
      ``prompt_tokens_details.cached_tokens`` the prompt tokens whose KV came from the prefix cache
      (``Completion.num_cached_tokens``).
"""

from __future__ import annotations

from typing import Any

from rksc_engine import Completion

from .logprobs import TokenText, TopTokens, chat_logprobs, completion_logprobs

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def stop_reason(completion: Completion, stops: tuple[str, ...], tokenizer: Any) -> str | None:
    """The stop string that ended ``completion``, None unless it ended on one."""
    if completion.finish_reason != "stop" or not stops:
        return None
    full = tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)
    return next((s for s in stops if full.startswith(s, len(completion.text))), stops[0])


def usage(prompts: list[list[Completion]]) -> dict[str, Any]:
    """OpenAI's ``usage`` of one request, from its completions grouped per prompt."""
    prompt_tokens = sum(cs[0].num_prompt_tokens for cs in prompts if cs)
    cached_tokens = sum(cs[0].num_cached_tokens for cs in prompts if cs)
    completion_tokens = sum(c.num_generated_tokens for cs in prompts for c in cs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ChatShape:
    """``chat.completion`` and ``chat.completion.chunk`` bodies."""

    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, token_text: TokenText) -> None:
        self.token_text = token_text

    def logprobs(self, completion: Completion, top: list[TopTokens] | None) -> dict[str, Any]:
        return chat_logprobs(completion, self.token_text, top)

    def choice(self, index: int, completion: Completion, logprobs: dict | None, stop: str | None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": completion.text},
                "logprobs": logprobs, "finish_reason": FINISH_REASONS[completion.finish_reason], "stop_reason": stop}

    def opening_choice(self, index: int) -> dict[str, Any] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta_choice(self, index: int, text: str) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}

    def final_choice(self, index: int, text: str, completion: Completion, logprobs: dict | None,
                     stop: str | None) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": FINISH_REASONS[completion.finish_reason], "stop_reason": stop}


class TextShape:
    """``text_completion`` bodies (whole and streamed: OpenAI uses one object name for both)."""

    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, token_text: TokenText) -> None:
        self.token_text = token_text

    def logprobs(self, completion: Completion, top: list[TopTokens] | None) -> dict[str, Any]:
        return completion_logprobs(completion, self.token_text, top)

    def choice(self, index: int, completion: Completion, logprobs: dict | None, stop: str | None) -> dict[str, Any]:
        return {"index": index, "text": completion.text, "logprobs": logprobs,
                "finish_reason": FINISH_REASONS[completion.finish_reason], "stop_reason": stop}

    def opening_choice(self, index: int) -> dict[str, Any] | None:
        return None

    def delta_choice(self, index: int, text: str) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": None}

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
