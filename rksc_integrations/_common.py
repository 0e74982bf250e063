"""Rules both adapters (LangChain and LlamaIndex) apply the same way, kept in one place so they agree.

* Stop strings: one string is accepted wherever a list of them is (constructor fields and per-call
  arguments alike), as LangChain's own models do.
* Empty prompts: a prompt with no text raises ``ValueError`` naming the prompt, on every path
  (complete, chat, stream, async): a completion prompt that is empty or whitespace, or a chat in
  which no message has text or tool calls. The engine refuses an empty prompt too; a chat template
  would render an empty user turn into a non-empty prompt, but the model would then answer nothing
  the user asked.
* Tool-call turns: with tools offered through the system-prompt protocol (a chat template that does
  not take ``tools``, SmolLM2's for one), whatever the model writes before ``<tool_call>`` is dropped
  from the message content. Small models mostly write the protocol's own instruction there
  ("You can call a tool, reply with one block per call and nothing else:"), and an agent feeds the
  content back into its history, where the echo compounds. A template that takes tools keeps the
  text: there it is the model's own words.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rksc_engine.tools import template_takes_tools


def normalise_stop(value: Any) -> Any:
    """``[value]`` for one stop string; anything else unchanged (the field's own type check judges it)."""
    return [value] if isinstance(value, str) else value


def check_prompt_text(prompt: str, name: str = "prompt") -> None:
    """``TypeError`` unless ``prompt`` is a string, ``ValueError`` if it has no non-whitespace text."""
    if not isinstance(prompt, str):
        raise TypeError(f"{name} must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError(f"{name} must be a non-empty string (with non-whitespace text), got {prompt!r}")


def check_chat_has_text(messages: Sequence[dict[str, Any]]) -> None:
    """``ValueError`` when no engine chat message has text or tool calls (an empty conversation)."""
    if not any(str(m.get("content") or "").strip() or m.get("tool_calls") for m in messages):
        raise ValueError("prompt must be non-empty: every message in it has blank content and no tool calls")


def tool_turn_content(prose: str, tokenizer: Any) -> str:
    """The message content of a turn that made tool calls, given the text written before them."""
    return prose if template_takes_tools(tokenizer) else ""
