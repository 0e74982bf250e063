"""LangChain messages to the engine's chat dicts.

Every role renders, in any order: a history may end in an AI message or a ``ToolMessage`` (an agent's
next step), unlike ``ChatHuggingFace``, which requires a final human message. An AI message's tool
calls become OpenAI-shaped ``tool_calls`` on its dict, or, for a template that does not render them,
``<tool_call>`` blocks in its text; the tool protocol itself (both ways of offering tools, the block
format, parsing, constrained decoding) is ``rksc_engine.structured.tools``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from rksc_engine.structured.tools import inline_tool_calls
from rksc_engine.structured.tools import template_takes_tools as template_takes_tools  # re-exported, defined once there
from rksc_integrations._common import check_chat_has_text

ENGINE_ROLES = ("system", "user", "assistant", "tool")

_ROLE_OF = {SystemMessage: "system", HumanMessage: "user", AIMessage: "assistant", ToolMessage: "tool", FunctionMessage: "tool"}


def to_engine_messages(messages: Sequence[BaseMessage], native_tools: bool = False) -> list[dict[str, Any]]:
    """Chat dicts for ``messages``.

    Args:
        messages: LangChain messages (any role, any order).
        native_tools: Keep tool calls as ``tool_calls`` fields for a template that renders them;
            otherwise they are written into the assistant text as ``<tool_call>`` blocks.

    Raises:
        TypeError: An item is not a ``BaseMessage``, or its content is neither a string nor a list.
        ValueError: ``messages`` is empty, no message has text or tool calls, a role is unknown, or
            content holds non-text blocks (images...).
    """
    if isinstance(messages, (str, BaseMessage)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of BaseMessage, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, BaseMessage):
            raise TypeError(f"messages[{i}] must be a BaseMessage, got {type(message).__name__}")
        role = _role(message, i)
        text = message_text(message, f"messages[{i}]")
        entry: dict[str, Any] = {"role": role, "content": text}
        if isinstance(message, AIMessage) and message.tool_calls:
            entry["tool_calls"] = [
                {"id": c.get("id"), "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                for c in message.tool_calls
            ]
            if not native_tools:
                entry = inline_tool_calls(entry)
        if isinstance(message, ToolMessage):
            entry["tool_call_id"] = message.tool_call_id
            if message.status == "error":  # the model should see that the call failed
                entry["content"] = f"Error: {text}"
        out.append(entry)
    check_chat_has_text(out)
    return out


def _role(message: BaseMessage, index: int) -> str:
    for cls, role in _ROLE_OF.items():
        if isinstance(message, cls):
            return role
    if isinstance(message, ChatMessage):
        role = {"human": "user", "ai": "assistant", "developer": "system", "function": "tool"}.get(message.role, message.role)
        if role in ENGINE_ROLES:
            return role
        raise ValueError(f"messages[{index}] has role {message.role!r}; supported roles are {list(ENGINE_ROLES)}")
    raise ValueError(f"messages[{index}] is a {type(message).__name__}, which has no chat role")


def message_text(message: BaseMessage, where: str) -> str:
    """The text of a message: string content, or the text blocks of list content joined."""
    return content_text(message.content, where)


def content_text(content: Any, where: str) -> str:
    """The text of message content: a string, or a list of content blocks (strings and
    ``{"type": "text", "text": ...}``) whose text parts are joined; tool-use and reasoning blocks
    are skipped, anything else (images...) is a ``ValueError``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TypeError(f"{where} content must be a string or a list of content blocks, got {type(content).__name__}")
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(block, dict) and block.get("type") in ("tool_use", "tool_call", "reasoning", "thinking"):
            continue  # carried by message.tool_calls / not part of the visible text
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"{where} holds a {kind!r} content block; this text-only model accepts text")
    return "".join(parts)
