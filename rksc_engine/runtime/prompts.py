"""Prompts into token ids: a string, chat messages (the model's chat template) or token ids, checked
before anything runs; and the spans a prompt's retrieved chunks occupy, for chunk reuse.

Given the context window, a text prompt whose length in characters already proves it too long is
refused before it is tokenized (``prompt_bound``): tokenizing a megabyte takes seconds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

from ..config import ASKSConfig
from ..kvcache import chunk_reuse
from .prompt_bound import max_chars_per_token

ChatMessage = dict[str, Any]
Prompt = str | Sequence[ChatMessage] | Sequence[int]
CHAT_ROLES = ("system", "user", "assistant", "tool")


class PromptEncoder:
    """Encodes prompts with one tokenizer.

    Args:
        tokenizer: The model's tokenizer.
        vocab_size: The model's vocabulary size (token ids up to it are accepted).
        asks_config: Where the chunk separator and whether chunk reuse is on are read.
        cacheable: Whether the radix cache is in use (chunk reuse needs it).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, asks_config: ASKSConfig, cacheable: bool) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.asks_config = asks_config
        self.cacheable = cacheable

    @functools.cached_property
    def max_chars_per_token(self) -> float | None:
        """The most characters one token of this tokenizer stands for (None: no bound holds); read
        from its vocabulary once, at first use."""
        return max_chars_per_token(self.tokenizer)

    def encode(self, prompt: Prompt, context_window: int | None = None) -> list[int]:
        """Token ids of a prompt: a string (tokenised as ``tokenizer(prompt)`` does), a list of chat
        messages (rendered with the model's chat template, generation prompt appended), or token ids.

        With ``context_window``, a text (or rendered chat) long enough in characters to be certain
        to fill the window is refused with ``ValueError`` before it is tokenized; the exact check
        of the tokens is the caller's (``RKSCEngine.validate_request``).
        """
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise TypeError(f"prompt must be a string, a list of chat messages or a list of token ids, got "
                            f"{type(prompt).__name__}; decode bytes first (prompt.decode('utf-8'))")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must be a non-empty string, list of chat messages or token ids")
            check_encodable(prompt, "prompt")
            self.check_length(prompt, context_window)
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(self.tokenizer)
            bad = [t for t in prompt if not 0 <= t < max(vocab, self.vocab_size)]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:3]}")
            ids = list(prompt)
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.encode_chat(list(prompt), context_window=context_window)
        elif isinstance(prompt, Sequence) and not prompt:
            raise ValueError("prompt must not be empty")
        else:
            raise TypeError(
                f"prompt must be a string, a list of chat messages ({{'role', 'content'}} dicts) or a list of "
                f"token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("prompt encodes to zero tokens")
        return ids

    def encode_chat(self, messages: list[ChatMessage], *, context_window: int | None = None,
                    **template_kwargs: Any) -> list[int]:
        """Token ids of chat ``messages`` rendered with the model's chat template (generation prompt
        appended); ``template_kwargs`` go to ``apply_chat_template`` (``tools=...``). With
        ``context_window``, the rendered text is refused before tokenizing as ``encode`` says."""
        # Extra keys (LangChain's ``name``, ``id``, ``tool_calls``...) go to the chat template as they
        # are, which uses what it knows; any non-empty history of known roles is accepted, an
        # assistant-only one included (the model then writes the next assistant turn).
        for i, message in enumerate(messages):
            role = message.get("role")
            if role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}]['role'] must be one of {list(CHAT_ROLES)}, got {role!r}")
            content = message.get("content")
            if not isinstance(content, str):
                raise TypeError(f"messages[{i}]['content'] must be a string, got {type(content).__name__}")
            check_encodable(content, f"messages[{i}]['content']")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; pass the prompt as a string")
        text = self.render_chat(messages, **template_kwargs)
        self.check_length(text, context_window)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def check_length(self, text: str, context_window: int | None) -> None:
        """``ValueError`` when ``text`` has so many characters that its tokens certainly fill
        ``context_window`` (which leaves no room for a generated token); nothing otherwise, or when
        this tokenizer has no bound (``prompt_bound``)."""
        chars_per_token = self.max_chars_per_token
        if context_window is None or chars_per_token is None:
            return
        fewest_tokens = math.ceil(len(text) / chars_per_token)
        if fewest_tokens >= context_window:
            raise ValueError(
                f"prompt has at least {fewest_tokens:,} tokens ({len(text):,} characters, and one token of this "
                f"tokenizer covers at most {chars_per_token:g}); the model's context window is {context_window:,}, "
                f"so the prompt must have at most {context_window - 1:,}")

    def render_chat(self, messages: list[ChatMessage], **template_kwargs: Any) -> str:
        """The chat template applied to ``messages`` with the assistant's generation prompt appended."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **template_kwargs)

    def context_spans(self, prompt: Prompt, prompt_ids: list[int]) -> tuple[tuple[int, int], ...] | None:
        """Token spans tiling ``prompt_ids`` cut at ``asks.chunk_separator``, for retrieved-context
        reuse; None when it is off, the prompt is token ids (no text to cut), or the tokenizer gives
        no character offsets. The spans come from the same tokenisation as ``prompt_ids``, which is
        checked token for token, so cutting never changes how the prompt is tokenised."""
        config = self.asks_config
        if not (config.enabled and config.reuse_chunks and self.cacheable):
            return None
        if isinstance(prompt, str):
            text, special = prompt, True
        elif isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], dict):
            text, special = self.render_chat(list(prompt)), False
        else:
            return None
        if config.chunk_separator not in text:
            return None
        try:
            encoded = self.tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer has no offsets
            return None
        if list(encoded["input_ids"]) != prompt_ids:
            return None
        offsets = [tuple(pair) for pair in encoded["offset_mapping"]]
        return tuple(chunk_reuse.segment_spans(text, offsets, config.chunk_separator))


def check_encodable(text: str, name: str) -> None:
    """``ValueError`` naming ``name`` when ``text`` cannot be UTF-8 encoded (a lone surrogate), which the
    tokenizer would otherwise report as an opaque ``TypeError``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{name} is not valid Unicode text: {error.reason} at index {error.start} "
                         f"({text[error.start:error.end]!r}); remove or replace it") from None
