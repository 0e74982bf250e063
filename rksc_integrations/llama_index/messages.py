"""LlamaIndex ``ChatMessage``s to the engine's chat dicts, and engine tool calls to ``ToolCallBlock``s.

The engine renders ``{"role", "content"}`` dicts with the model's chat template; its roles are
system/user/assistant/tool, so LlamaIndex's extra roles are folded onto those. An assistant
message's calls (``ToolCallBlock``s, or OpenAI-shaped ``additional_kwargs["tool_calls"]`` from older
agents) travel as ``tool_calls`` on its dict; ``rksc_engine.structured.tools`` renders them for the template
(natively, or as ``<tool_call>`` blocks in the text) together with the offered tools.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock, ToolCallBlock

from rksc_engine.structured import tools as tool_protocol
from rksc_engine.structured.constrained import ToolCall
from rksc_integrations._common import check_chat_has_text

_ROLE_MAP = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
    MessageRole.TOOL: "tool",
    MessageRole.FUNCTION: "tool",
}


def to_engine_messages(messages: Sequence[ChatMessage], system_prompt: str | None = None) -> list[dict[str, Any]]:
    """Engine chat dicts for ``messages``; ``system_prompt`` is prepended unless a system message exists.

    Raises:
        TypeError: An item is not a ``ChatMessage``.
        ValueError: ``messages`` is empty, no message has text or tool calls, or a message holds
            non-text content (images, audio).
    """
    if isinstance(messages, (str, ChatMessage)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of ChatMessage, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, ChatMessage):
            raise TypeError(f"messages[{i}] must be a ChatMessage, got {type(message).__name__}")
        role = _ROLE_MAP.get(message.role)
        if role is None:
            raise ValueError(f"messages[{i}] has unsupported role {message.role!r}")
        entry: dict[str, Any] = {"role": role, "content": _message_text(message, i)}
        calls = _tool_calls(message)
        if calls:
            entry["tool_calls"] = calls
        call_id = message.additional_kwargs.get("tool_call_id")
        if role == "tool" and call_id:
            entry["tool_call_id"] = call_id
        out.append(entry)
    check_chat_has_text(out)  # before the default system prompt, which is not the caller's text
    if system_prompt and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def _message_text(message: ChatMessage, index: int) -> str:
    parts: list[str] = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif not isinstance(block, ToolCallBlock):
            raise ValueError(
                f"messages[{index}] holds a {type(block).__name__}; this text-only model accepts text and tool calls"
            )
    return "\n".join(parts)


def _tool_calls(message: ChatMessage) -> list[dict[str, Any]]:
    """The message's calls in the OpenAI shape: its ``ToolCallBlock``s, then any that older agents
    keep in ``additional_kwargs["tool_calls"]``."""
    calls = [
        {"id": b.tool_call_id, "type": "function", "function": {"name": b.tool_name, "arguments": b.tool_kwargs}}
        for b in message.blocks if isinstance(b, ToolCallBlock)
    ]
    for call in message.additional_kwargs.get("tool_calls", []) or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        if "name" in fn:
            calls.append({"id": call.get("id"), "type": "function",
                          "function": {"name": fn["name"], "arguments": fn.get("arguments", {})}})
    return calls


def to_tool_call_blocks(calls: Sequence[ToolCall]) -> list[ToolCallBlock]:
    return [ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=c.arguments) for c in calls]


def parse_tool_calls(text: str) -> tuple[str, list[ToolCallBlock]]:
    """Split generated ``text`` into prose and ``ToolCallBlock``s (``rksc_engine.structured.tools.parse_tool_calls``);
    a malformed block stays in the prose."""
    prose, calls = tool_protocol.parse_tool_calls(text)
    return prose, to_tool_call_blocks(calls)
