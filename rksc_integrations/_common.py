"""Rules both adapters (LangChain and LlamaIndex) apply the same way, kept in one place so they agree.

* Stop strings: one string is accepted wherever a list of them is (constructor fields and per-call
  arguments alike), as LangChain's own models do.
* Empty prompts: a prompt with no text raises ``ValueError`` naming the prompt, on every path
  (complete, chat, stream, async): a completion prompt that is empty or whitespace, or a chat in
  which no message has text or tool calls. The engine refuses an empty prompt too; a chat template
  would render an empty user turn into a non-empty prompt, but the model would then answer nothing
  the user asked.
* Per-call options: the keyword arguments of a call override the model's fields of the same name
  (``call_sampling_params``); an unknown one raises ``TypeError`` listing the accepted ones.
* Tool-call turns: with tools offered through the system-prompt protocol (a chat template that does
  not take ``tools``, SmolLM2's for one), whatever the model writes before ``<tool_call>`` is dropped
  from the message content (``rksc_engine.structured.tools.tool_turn_content``, applied by
  ``rksc_engine.structured.tools.finish_tool_turn``). Small models mostly write the protocol's own instruction
  there ("You can call a tool, reply with one block per call and nothing else:"), and an agent feeds
  the content back into its history, where the echo compounds. A template that takes tools keeps the
  text: there it is the model's own words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rksc_engine import SamplingParams
from rksc_engine.structured.tools import tool_turn_content

__all__ = ["call_sampling_params", "check_chat_has_text", "check_prompt_text", "normalise_stop", "tool_turn_content"]


def call_sampling_params(
    fields: Any, kwargs: Mapping[str, Any], call_kwargs: Sequence[str], stop: str | Sequence[str], *,
    n_name: str = "n", branch_temperature: float | None = None,
) -> tuple[SamplingParams, int]:
    """The engine parameters of one adapter call, and its number of generations.

    Args:
        fields: The adapter model; its ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
            ``seed`` and ``n_name`` attributes are the defaults.
        kwargs: The call's keyword arguments, overriding the fields of the same name (``max_tokens``
            is ``max_new_tokens``).
        call_kwargs: The keyword arguments a call accepts.
        stop: The call's stop strings, as the adapter merges them (one string or a sequence).
        n_name: The name of the generations count (``"n"``, ``"branches"``).
        branch_temperature: Used instead of a temperature of 0 when there are several generations
            (greedy branches would all be the same); None keeps the temperature.

    Raises:
        TypeError: An unknown keyword argument (the message lists ``call_kwargs``), both
            ``max_tokens`` and ``max_new_tokens``, or a value of the wrong type.
        ValueError: A generations count that is not an int >= 1 (named ``n_name``), or a value out of range.
    """
    unknown = sorted(set(kwargs) - set(call_kwargs))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}; per-call options are {list(call_kwargs)}")
    if "max_tokens" in kwargs and "max_new_tokens" in kwargs:
        raise TypeError("pass max_tokens or max_new_tokens, not both")
    n = kwargs.get(n_name, getattr(fields, n_name))
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{n_name} must be an int >= 1, got {n!r}")
    temperature = kwargs.get("temperature", fields.temperature)
    if branch_temperature is not None and n > 1 and temperature == 0:
        temperature = branch_temperature
    params = SamplingParams(
        max_new_tokens=kwargs.get("max_new_tokens", kwargs.get("max_tokens", fields.max_new_tokens)),
        temperature=temperature,
        top_p=kwargs.get("top_p", fields.top_p),
        top_k=kwargs.get("top_k", fields.top_k),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        seed=kwargs.get("seed", fields.seed),
    )
    return params, n


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
