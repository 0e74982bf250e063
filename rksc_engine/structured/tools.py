"""The tool-calling protocol: tool specs and tool choice in one shape, tools rendered into the
prompt, calls parsed from text, and tool calls and JSON answers finished under their schemas.

The adapters (LangChain, LlamaIndex) translate their message and tool types into the plain shapes
this module takes, and nothing else: tools are OpenAI-style dicts
(``{"type": "function", "function": {"name", "description", "parameters"}}``) or bare function dicts
(``{"name", "description", "parameters"}``); ``parameters`` and output schemas are JSON-schema dicts.
This module imports neither LangChain nor LlamaIndex.

Protocol. Tools reach the model one of two ways:
    * The chat template takes them (its source mentions ``tools``): they are passed as
      ``apply_chat_template(tools=...)`` and earlier calls stay in the messages' ``tool_calls``.
    * Otherwise (SmolLM2's template, for one) the documented system-prompt protocol: the function
      schemas go into the system message (``TOOL_SYSTEM_PROMPT``) and a call is written
      ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the Hermes/Qwen convention small
      instruct models have seen most; earlier calls are rendered back in that form.
Either way the model's own calls are decoded in the ``<tool_call>`` form: free text is generated with
``TOOL_CALL_OPEN`` as a stop string (``with_tool_call_stop``), and a call the model starts is
finished under the tool's schema by ``finish_tool_turn`` (one the caller forces, by
``decode_tool_call`` from the first token). Both adapters finish their turns there, so they agree on
the calls and on the message content (``tool_turn_content``). A caller that forces a call or asks for
a JSON answer goes through ``decode_constrained``, so every client agrees on those too.

The JSON decoder these calls are written with is ``rksc_engine.structured.constrained`` (it knows JSON
values and token masks, not the protocol; ``ToolCall``, the record of one call its results carry, is
defined there), and which schemas it can guarantee is ``rksc_engine.structured.json_schema``. Import
their names from those modules.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..config import SamplingParams
from ..protocol import LocalEngine
from ..results import Completion
from .constrained import ConstrainedDecoder, ConstrainedResult, ToolCall, decode_json, inline_refs

__all__ = [
    "JSON_INSTRUCTION",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "TOOL_SYSTEM_PROMPT",
    "ToolRequest",
    "ToolTurn",
    "add_system_text",
    "decode_constrained",
    "decode_tool_call",
    "encode_with_tools",
    "finish_tool_turn",
    "format_tool_call",
    "function_spec",
    "inline_tool_calls",
    "json_instruction",
    "new_call_id",
    "normalise_tool_choice",
    "offer_tools",
    "parse_tool_calls",
    "stopped_at_tool_call",
    "template_takes_tools",
    "tool_system_prompt",
    "tool_turn_content",
    "with_tool_call_stop",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_SYSTEM_PROMPT = (
    "You can call functions. The available tools, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a tool, reply with one block per call and nothing else:\n"
    '<tool_call>{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}</tool_call>\n'
    "When a tool result is given, use it to answer."
)
JSON_INSTRUCTION = "Answer with one JSON object and nothing else."

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


# -- tools and tool choice ----------------------------------------------------------------------
def function_spec(tool: dict[str, Any]) -> dict[str, Any]:
    """The ``{"name", "description", "parameters"}`` dict of an OpenAI-style tool or a function dict.

    Raises:
        TypeError: ``tool`` is not a dict.
        ValueError: It has no string ``name``, or ``parameters`` is not a JSON-schema dict.
    """
    if not isinstance(tool, dict):
        raise TypeError(f"a tool must be a dict (OpenAI tool or function schema), got {type(tool).__name__}")
    spec = tool["function"] if isinstance(tool.get("function"), dict) else tool
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ValueError(f"a tool needs a non-empty string 'name', got {tool!r}")
    parameters = spec.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ValueError(f"tool {spec['name']!r}: 'parameters' must be a JSON-schema dict, got {type(parameters).__name__}")
    return {"name": spec["name"], "description": spec.get("description", ""), "parameters": parameters}


def normalise_tool_choice(choice: Any, names: Sequence[str]) -> str | None:
    """``None`` (the model decides), ``"any"`` (some tool must be called), ``"none"`` or a tool name.

    Accepts ``None``/``"auto"``/``False``, ``"any"``/``"required"``/``True``, ``"none"``, a tool name,
    or ``{"function": {"name": ...}}`` / ``{"name": ...}``.

    Raises:
        ValueError: Anything else, naming the accepted values.
    """
    if choice is None or choice == "auto" or choice is False:
        return None
    if choice in ("any", "required") or choice is True:
        return "any"
    if choice == "none":
        return "none"
    if isinstance(choice, dict):
        choice = (choice.get("function") or {}).get("name") or choice.get("name")
    if isinstance(choice, str) and choice in names:
        return choice
    raise ValueError(
        f"tool_choice must be 'auto', 'any', 'required', 'none', True or one of the tool names {list(names)}, got {choice!r}"
    )


@dataclass(frozen=True)
class ToolRequest:
    """The tools offered to one call and whether a call is required.

    Attributes:
        functions: Tool name -> ``{"name", "description", "parameters"}``, in the order offered.
        choice: ``None`` (the model decides), ``"any"`` or a tool name (a call is forced).
    """

    functions: dict[str, dict[str, Any]]
    choice: str | None = None

    @classmethod
    def build(cls, tools: Sequence[dict[str, Any]], choice: Any = None) -> ToolRequest | None:
        """The request for ``tools`` (OpenAI tools or function dicts); None when nothing is offered."""
        specs = [function_spec(t) for t in tools or ()]
        functions = {s["name"]: s for s in specs}
        normalised = normalise_tool_choice(choice, list(functions)) if functions else None
        if not functions or normalised == "none":
            return None
        return cls(functions, normalised)

    @property
    def forced(self) -> bool:
        return self.choice is not None

    @property
    def forced_name(self) -> str | None:
        """The tool that must be called, when it is determined (named, or the only one offered)."""
        if self.choice in self.functions:
            return self.choice
        return next(iter(self.functions)) if self.forced and len(self.functions) == 1 else None

    def openai_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": f} for f in self.functions.values()]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- rendering ----------------------------------------------------------------------------------
def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a ``tools`` argument."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates; the default one is what renders
        template = template.get("default", "")
    return isinstance(template, str) and "tools" in template


def format_tool_call(name: str, arguments: Any) -> str:
    """A call as the protocol writes it (the exact bytes ``decode_tool_call`` produces).

    String arguments that hold JSON are decoded first, so an OpenAI-style ``"arguments": "{...}"``
    renders as an object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + TOOL_CALL_CLOSE


def tool_system_prompt(functions: Sequence[dict[str, Any]]) -> str:
    """The system text offering ``functions`` (``{"name", "description", "parameters"}`` each)."""
    return TOOL_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(f, ensure_ascii=False) for f in functions))


def json_instruction(schema: dict[str, Any] | None) -> str:
    """The system text asking for a JSON answer (with its schema, when there is one)."""
    if not schema:
        return JSON_INSTRUCTION
    return JSON_INSTRUCTION + " Its JSON schema: " + json.dumps(schema, ensure_ascii=False)


def add_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``messages`` with ``text`` appended to the system message (one is put first if missing)."""
    if messages and messages[0]["role"] == "system":
        content = messages[0]["content"]
        return [{**messages[0], "content": (content + "\n\n" + text) if content else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def inline_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message whose ``tool_calls`` (OpenAI shape or ``{"name", "arguments"}``) are
    written into its text as ``<tool_call>`` blocks, for a template that does not render them."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = []
    for call in calls:
        fn = call.get("function", call)
        blocks.append(format_tool_call(fn["name"], fn.get("arguments", {})))
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = (message.get("content") or "") + "".join(blocks)
    return out


def offer_tools(
    messages: Sequence[dict[str, Any]], request: ToolRequest | None, tokenizer: Any, *,
    json_answer: bool = False, schema: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and ``apply_chat_template`` keyword arguments that offer ``request``'s tools.

    A template that takes tools gets them as ``tools=`` and keeps ``tool_calls`` on the messages;
    otherwise earlier calls are inlined and the tools are described in the system message. With
    ``json_answer`` the system message also asks for JSON (``json_instruction(schema)``): the model
    writes the values of a constrained answer, and it writes them better when it knows the shape.
    """
    if request is not None and template_takes_tools(tokenizer):
        out, template_kwargs = list(messages), {"tools": request.openai_tools()}
    else:
        out, template_kwargs = [inline_tool_calls(m) for m in messages], {}
        if request is not None:
            out = add_system_text(out, tool_system_prompt(list(request.functions.values())))
    if json_answer:
        out = add_system_text(out, json_instruction(schema))
    return out, template_kwargs


def encode_with_tools(
    engine: LocalEngine, messages: Sequence[dict[str, Any]], request: ToolRequest | None, *,
    json_answer: bool = False, schema: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template, tools offered (and a JSON answer
    asked for) per ``offer_tools``."""
    rendered, template_kwargs = offer_tools(messages, request, engine.tokenizer, json_answer=json_answer, schema=schema)
    return engine.encode_chat(rendered, **template_kwargs)


# -- parsing ------------------------------------------------------------------------------------
def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split generated ``text`` into the prose outside ``<tool_call>`` blocks and the calls in them.

    A block whose body is not a JSON object with a string ``name`` is left in the prose, so a
    malformed call is visible to the caller rather than silently dropped. Arguments given as a JSON
    string are decoded; arguments that are not an object become ``{"input": value}``.
    """
    calls: list[ToolCall] = []
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
        calls.append(ToolCall(body["name"], arguments, new_call_id()))
        prose.append(text[last:match.start()])
        last = match.end()
    prose.append(text[last:])
    return ("".join(prose).strip(), calls) if calls else (text, [])


def stopped_at_tool_call(tokenizer: Any, completion: Completion) -> bool:
    """Whether a free generation ended at the tool-call opener (not a user stop string or EOS)."""
    if completion.finish_reason != "stop":
        return False
    full = tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)
    return full[len(completion.text):].startswith(TOOL_CALL_OPEN)


def tool_turn_content(prose: str, tokenizer: Any) -> str:
    """The message content of a turn that made tool calls, given the text written before them.

    With the system-prompt protocol (a template that does not take ``tools``) the text is dropped:
    small models mostly echo the protocol's own instruction there, and an agent feeding the content
    back into its history would compound the echo. A template that takes tools keeps it (the
    model's own words)."""
    return prose if template_takes_tools(tokenizer) else ""


# -- whole calls --------------------------------------------------------------------------------
def decode_tool_call(
    engine: LocalEngine,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    request: ToolRequest,
    *,
    free: Completion | None = None,
    token_masks: bool = True,
) -> ConstrainedResult:
    """One tool call decoded under ``request``'s schemas.

    Args:
        engine: The ``RKSCEngine``.
        prompt_ids: The rendered prompt (tools offered) ending in the assistant's generation prompt.
        params: Sampling settings of the value calls.
        request: The tools; a forced name is written, otherwise the model picks the tool by name.
        free: The free generation that stopped at ``<tool_call>``: its text is kept as prose and its
            accounting is reported. None for a call forced from the start.
        token_masks: See ``ConstrainedDecoder``.
    """
    prose = free.text if free is not None else ""
    decoder = ConstrainedDecoder(engine, prompt_ids, params, text=prose, token_masks=token_masks)
    decoder.emit(TOOL_CALL_OPEN + '{"name": ')
    name = request.forced_name
    if name is not None:
        decoder.emit(json.dumps(name, ensure_ascii=False))
    else:
        name = decoder.choose(list(request.functions))
    decoder.emit(', "arguments": ')
    arguments = decoder.value(inline_refs(request.functions[name]["parameters"] or {"type": "object", "properties": {}}))
    decoder.emit("}" + TOOL_CALL_CLOSE)
    if not isinstance(arguments, dict):
        arguments = {"input": arguments}
    return decoder.result(prose, (ToolCall(name, arguments, new_call_id()),), None, "tool_calls", free=free)


def with_tool_call_stop(params: SamplingParams) -> SamplingParams:
    """``params`` with ``TOOL_CALL_OPEN`` as a stop, so a call the model starts ends its free text
    and is finished under the schema (``finish_tool_turn``)."""
    return dataclasses.replace(params, stop=(*params.stop, TOOL_CALL_OPEN))


@dataclass(frozen=True)
class ToolTurn:
    """A finished free generation made with tools offered.

    Attributes:
        text: The message content: the generated text, or, when calls were made, the text before
            them as ``tool_turn_content`` keeps it.
        tool_calls: The calls made (none for a plain answer).
        completion: The free generation (its accounting is the turn's).
        constrained: The decoder's result when a call the model started was finished under the
            schema, else None.
    """

    text: str
    tool_calls: tuple[ToolCall, ...]
    completion: Completion
    constrained: ConstrainedResult | None = None


def finish_tool_turn(
    engine: LocalEngine, prompt: Any, request: ToolRequest, free: Completion, params: SamplingParams,
    *, token_masks: bool = True,
) -> ToolTurn:
    """The turn of a free generation made with ``request``'s tools offered and ``TOOL_CALL_OPEN``
    among its stops (``with_tool_call_stop``).

    A call the model started (it stopped at the opener) is finished under the schema by
    ``decode_tool_call``; calls written out in full anyway (a model past the stop) are parsed from
    the text; otherwise the text is the answer. The text before calls follows ``tool_turn_content``.

    Args:
        engine: The ``RKSCEngine``.
        prompt: The prompt the free generation continued, as token ids or anything ``engine.encode``
            takes (encoded only when a call is finished).
        request: The tools offered.
        free: The free generation.
        params: Sampling settings of the value calls (``value_params``).
        token_masks: See ``ConstrainedDecoder``.
    """
    if stopped_at_tool_call(engine.tokenizer, free):
        result = decode_tool_call(engine, engine.encode(prompt), params, request, free=free, token_masks=token_masks)
        return ToolTurn(tool_turn_content(result.text, engine.tokenizer), result.tool_calls, free, result)
    prose, calls = parse_tool_calls(free.text)
    if calls:
        prose = tool_turn_content(prose, engine.tokenizer)
    return ToolTurn(prose, tuple(calls), free)


def decode_constrained(
    engine: LocalEngine, prompt_ids: Sequence[int], params: SamplingParams, request: ToolRequest | None = None,
    schema: dict[str, Any] | None = None, *, token_masks: bool = True,
) -> tuple[ConstrainedResult, str]:
    """An answer decoded under its schema from the first token, and its message content: a call of
    ``request``'s tools when it forces one, else a JSON answer of ``schema`` (an object whose keys
    the model chooses when there is none).

    Every client that asks for a forced call or a JSON answer (the adapters, the HTTP server) comes
    through here, so they agree on the answer and on what the message says.

    Args:
        params: The value calls' settings (``value_params``).
    """
    if request is not None and request.forced:
        result = decode_tool_call(engine, prompt_ids, params, request, token_masks=token_masks)
        return result, tool_turn_content(result.text, engine.tokenizer)
    result = decode_json(engine, prompt_ids, params, schema, token_masks=token_masks)
    return result, result.text

