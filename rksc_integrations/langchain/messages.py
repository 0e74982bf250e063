"""LangChain messages to the engine's chat dicts, and the tool-calling protocol.

Every role renders, in any order: a history may end in an AI message or a ``ToolMessage`` (an agent's
next step), unlike ``ChatHuggingFace``, which requires a final human message.

Tools reach the model one of two ways:
    * The chat template takes them (its source mentions ``tools``): they are passed as
      ``apply_chat_template(tools=...)``, and earlier calls as the messages' ``tool_calls``.
    * Otherwise (SmolLM2's template, for one) the documented system-prompt protocol: the tools' JSON
      schemas go into the system message (``TOOL_SYSTEM_PROMPT``) and a call is written
      ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the Hermes/Qwen convention that
      small instruct models have seen most; earlier calls are rendered back in that form.
Either way, the model's calls are decoded in the ``<tool_call>`` form (see ``constrained``).
"""

from __future__ import annotations

import json
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

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
ENGINE_ROLES = ("system", "user", "assistant", "tool")

TOOL_SYSTEM_PROMPT = (
    "You can call functions. The available tools, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a tool, reply with one block per call and nothing else:\n"
    '<tool_call>{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}</tool_call>\n'
    "When a tool result is given, use it to answer."
)

_ROLE_OF = {SystemMessage: "system", HumanMessage: "user", AIMessage: "assistant", ToolMessage: "tool", FunctionMessage: "tool"}


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a ``tools`` argument."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates; the default one is what renders
        template = template.get("default", "")
    return isinstance(template, str) and "tools" in template


def to_engine_messages(messages: Sequence[BaseMessage], native_tools: bool = False) -> list[dict[str, Any]]:
    """Chat dicts for ``messages``.

    Args:
        messages: LangChain messages (any role, any order).
        native_tools: Keep tool calls as ``tool_calls`` fields for a template that renders them;
            otherwise they are written into the assistant text as ``<tool_call>`` blocks.

    Raises:
        TypeError: An item is not a ``BaseMessage``, or its content is neither a string nor a list.
        ValueError: ``messages`` is empty, a role is unknown, or content holds non-text blocks (images...).
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
            if native_tools:
                entry["tool_calls"] = [
                    {"id": c.get("id"), "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                    for c in message.tool_calls
                ]
            else:
                blocks = [format_tool_call(c["name"], c["args"]) for c in message.tool_calls]
                entry["content"] = text + "".join(blocks)
        if isinstance(message, ToolMessage):
            entry["tool_call_id"] = message.tool_call_id
            if message.status == "error":  # the model should see that the call failed
                entry["content"] = f"Error: {text}"
        out.append(entry)
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
    content = message.content
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


def format_tool_call(name: str, arguments: Any) -> str:
    """A call as the protocol writes it (the exact bytes the constrained decoder produces)."""
    return TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + TOOL_CALL_CLOSE


def tool_system_prompt(functions: Sequence[dict[str, Any]]) -> str:
    """The system text offering ``functions`` (``{"name", "description", "parameters"}`` each)."""
    return TOOL_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(f, ensure_ascii=False) for f in functions))


def add_tool_prompt(messages: list[dict[str, Any]], functions: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the tool offer appended to the system message (one is added if missing)."""
    offer = tool_system_prompt(functions)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = (first["content"] + "\n\n" + offer) if first["content"] else offer
        return [first, *messages[1:]]
    return [{"role": "system", "content": offer}, *messages]
