"""LlamaIndex ``ChatMessage``s to the engine's chat dicts, and tool calls in and out of text.

The engine renders ``{"role", "content"}`` dicts with the model's chat template; its roles are
system/user/assistant/tool, so LlamaIndex's extra roles are folded onto those.

Tool calls use the Hermes/Qwen convention, which small instruct models have seen most: the tools'
JSON schemas go into the system message, and the model answers
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A previous call in the history is
rendered back the same way, so the model sees its own earlier calls in the format it is asked for.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock, ToolCallBlock

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

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

TOOL_SYSTEM_PROMPT = (
    "You can call functions. The available tools, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a tool, reply with one block per call and nothing else:\n"
    '<tool_call>{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}</tool_call>'
)


def to_engine_messages(messages: Sequence[ChatMessage], system_prompt: str | None = None) -> list[dict[str, str]]:
    """Engine chat dicts for ``messages``; ``system_prompt`` is prepended unless a system message exists.

    Raises:
        TypeError: An item is not a ``ChatMessage``.
        ValueError: ``messages`` is empty or a message holds non-text content (images, audio).
    """
    if isinstance(messages, (str, ChatMessage)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of ChatMessage, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, ChatMessage):
            raise TypeError(f"messages[{i}] must be a ChatMessage, got {type(message).__name__}")
        role = _ROLE_MAP.get(message.role)
        if role is None:
            raise ValueError(f"messages[{i}] has unsupported role {message.role!r}")
        out.append({"role": role, "content": _message_text(message, i)})
    if system_prompt and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def _message_text(message: ChatMessage, index: int) -> str:
    parts: list[str] = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif isinstance(block, ToolCallBlock):
            parts.append(format_tool_call(block.tool_name, block.tool_kwargs))
        else:
            raise ValueError(
                f"messages[{index}] holds a {type(block).__name__}; this text-only model accepts text and tool calls"
            )
    # Older agents keep calls in additional_kwargs (OpenAI shape) instead of blocks.
    for call in message.additional_kwargs.get("tool_calls", []) or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        if "name" in fn:
            parts.append(format_tool_call(fn["name"], fn.get("arguments", {})))
    return "\n".join(parts)


def format_tool_call(name: str, arguments: dict[str, Any] | str) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def tool_system_prompt(tool_schemas: Sequence[dict[str, Any]]) -> str:
    """The system text that offers ``tool_schemas`` (``{"name", "description", "parameters"}``)."""
    return TOOL_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(s) for s in tool_schemas))


def parse_tool_calls(text: str) -> tuple[str, list[ToolCallBlock]]:
    """Split generated ``text`` into the prose outside ``<tool_call>`` blocks and the parsed calls.

    A block whose body is not a JSON object with a string ``name`` is left in the prose, so a
    malformed call is visible to the caller rather than silently dropped.
    """
    calls: list[ToolCallBlock] = []
    prose: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments", body.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = {"input": arguments}
        if not isinstance(arguments, dict):
            arguments = {"input": arguments}
        calls.append(ToolCallBlock(tool_call_id=f"call_{uuid.uuid4().hex[:12]}", tool_name=body["name"], tool_kwargs=arguments))
        prose.append(text[last:match.start()])
        last = match.end()
    prose.append(text[last:])
    return "".join(prose).strip() if calls else text, calls
