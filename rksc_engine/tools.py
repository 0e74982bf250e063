"""Tool calling and schema-constrained JSON: the protocol, parsing, and constrained decoding.

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
the calls and on the message content (``tool_turn_content``).

Constrained decoding. ``ConstrainedDecoder`` writes every structural token itself (braces, keys,
quotes, commas) and asks the model only for each value, one short engine call per value; the value is
then coerced to its schema type (an integer field gets an integer, an enum a member), so the output is
valid JSON of the schema's shape whatever the model writes. Each value call also runs under a
token-level mask (``constraint_processor``, a logits processor the scheduler applies to that
request's rows only, so requests batched beside it are untouched) that sets the logits of tokens that
cannot continue a value of that type to -inf (an integer takes digits, an enum follows a prefix trie
of its members, a boolean is ``true``/``false``, an array goes on with ``,`` or ends with ``]``), so
the model chooses among valid continuations by its own probabilities instead of having its free text
repaired afterwards. String values are not masked (any text is a valid string; the closing quote ends
them). A masked call's logprobs are over the masked distribution.
Every value call re-sends the prompt plus the scaffold so far; the prefix cache serves all but the
newest tokens.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .config import SamplingParams
from .types import Completion

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_SYSTEM_PROMPT = (
    "You can call functions. The available tools, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a tool, reply with one block per call and nothing else:\n"
    '<tool_call>{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}</tool_call>\n'
    "When a tool result is given, use it to answer."
)
JSON_INSTRUCTION = "Answer with one JSON object and nothing else."
MAX_ITEMS = 8  # array items / free object keys the model may produce, so a loop cannot run away
MAX_VALUE_TOKENS = 64  # constrained values are short; a runaway string value stops here

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_INT = re.compile(r"\s*(-?\d+)")
_NUMBER = re.compile(r"\s*(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)")
_END_VALUE = [",", "}", "]", "\n"]
_UNQUOTED_END = ",}]\n "  # characters that end an unquoted value (number, boolean)


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


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name, its arguments, and a fresh call id."""

    name: str
    arguments: dict[str, Any]
    id: str


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
    engine: Any, messages: Sequence[dict[str, Any]], request: ToolRequest | None, *,
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


# -- token masks --------------------------------------------------------------------------------
class TokenVocabulary:
    """Every token id's decoded text, indexed for building masks; built once per tokenizer.

    Args:
        tokenizer: The engine's tokenizer.
        num_logits: Rows of the model's LM head (may exceed ``len(tokenizer)``; extra rows are never allowed).
        eos_ids: Token ids that end generation.
    """

    def __init__(self, tokenizer: Any, num_logits: int, eos_ids: Sequence[int]) -> None:
        special = set(getattr(tokenizer, "all_special_ids", []))
        ids = list(range(min(len(tokenizer), num_logits)))
        decoded = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        # Special tokens and partial UTF-8 pieces never take part in a constrained value.
        self.texts = ["" if i in special or "\ufffd" in s else s for i, s in zip(ids, decoded)]
        self.num_logits = num_logits
        self.by_text: dict[str, list[int]] = {}
        for i, text in enumerate(self.texts):
            if text:
                self.by_text.setdefault(text, []).append(i)
        self.eos = self.mask([i for i in eos_ids if i < num_logits])
        self._cache: dict[tuple, Any] = {}

    def mask(self, ids: Sequence[int]) -> torch.Tensor:
        """A ``(num_logits,)`` bool mask with ``ids`` allowed."""
        out = torch.zeros(self.num_logits, dtype=torch.bool)
        if ids:
            out[list(ids)] = True
        return out

    def prefixes_of(self, text: str) -> list[int]:
        """Ids of tokens whose text is a non-empty prefix of ``text``."""
        return [i for k in range(1, len(text) + 1) for i in self.by_text.get(text[:k], ())]

    def starting_with(self, chars: str, skip_spaces: bool = False) -> torch.Tensor:
        """Mask of tokens whose first character (after leading spaces, if asked) is one of ``chars``."""
        key = ("start", chars, skip_spaces)
        if key not in self._cache:
            first = [(t.lstrip(" ") if skip_spaces else t)[:1] for t in self.texts]
            self._cache[key] = self.mask([i for i, c in enumerate(first) if c and c in chars])
        return self._cache[key]

    def within(self, charset: str) -> list[int]:
        """Ids of tokens made only of characters in ``charset``."""
        key = ("within", charset)
        if key not in self._cache:
            allowed = set(charset)
            self._cache[key] = [i for i, t in enumerate(self.texts) if t and set(t) <= allowed]
        return self._cache[key]


_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocabulary(engine: Any) -> TokenVocabulary:
    """The engine tokenizer's ``TokenVocabulary`` (built on first use, about 0.4 s for 49k tokens)."""
    tokenizer = engine.tokenizer
    vocab = _vocabularies.get(tokenizer)
    num_logits = engine.model.get_output_embeddings().weight.shape[0]
    if vocab is None or vocab.num_logits != num_logits:
        vocab = TokenVocabulary(tokenizer, num_logits, sorted(engine.eos_token_ids))
        _vocabularies[tokenizer] = vocab
    return vocab


class TokenConstraint(Protocol):
    """Which tokens may come next, given the text generated so far in this call."""

    def allowed(self, text: str) -> torch.Tensor | None:
        """A ``(num_logits,)`` bool mask, or None for no constraint."""
        ...


class FixedConstraint:
    """The same allowed set at every step (e.g. ``,`` or ``]`` after an array item)."""

    def __init__(self, mask: torch.Tensor) -> None:
        self._mask = mask

    def allowed(self, text: str) -> torch.Tensor | None:
        return self._mask if bool(self._mask.any()) else None


class ChoiceConstraint:
    """The text must spell one of ``options``: a token is allowed when it keeps the text a prefix of
    some option; once the text is an option, the tokens in ``end`` (and EOS) are allowed too."""

    def __init__(self, vocab: TokenVocabulary, options: Sequence[str], end: torch.Tensor) -> None:
        self._vocab, self._options, self._end = vocab, list(options), end | vocab.eos

    def allowed(self, text: str) -> torch.Tensor | None:
        ids: list[int] = []
        done = False
        for option in self._options:
            if option.startswith(text):
                rest = option[len(text):]
                if rest:
                    ids += self._vocab.prefixes_of(rest)
                else:
                    done = True
        mask = self._vocab.mask(ids)
        if done:
            mask |= self._end
        return mask if bool(mask.any()) else None  # off every option: unconstrained, coercion repairs


class PatternConstraint:
    """The text must stay a prefix of ``prefix`` (a regex matched in full) using tokens of
    ``charset``; once it fully matches ``complete``, the tokens in ``end`` (and EOS) are allowed too."""

    def __init__(self, vocab: TokenVocabulary, charset: str, prefix: str, complete: str, end: torch.Tensor) -> None:
        self._vocab, self._ids = vocab, vocab.within(charset)
        self._prefix, self._complete, self._end = re.compile(prefix), re.compile(complete), end | vocab.eos

    def allowed(self, text: str) -> torch.Tensor | None:
        texts = self._vocab.texts
        mask = self._vocab.mask([i for i in self._ids if self._prefix.fullmatch(text + texts[i])])
        if self._complete.fullmatch(text):
            mask |= self._end
        return mask if bool(mask.any()) else None


def integer_constraint(vocab: TokenVocabulary) -> PatternConstraint:
    end = vocab.starting_with(_UNQUOTED_END)
    return PatternConstraint(vocab, "-0123456789", r"-?\d*", r"-?\d+", end)


def number_constraint(vocab: TokenVocabulary) -> PatternConstraint:
    end = vocab.starting_with(_UNQUOTED_END)
    return PatternConstraint(
        vocab, "-+.eE0123456789", r"-?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d*)?)?", r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", end
    )


def constraint_processor(
    engine: Any, constraint: TokenConstraint, timing: dict[str, float] | None = None
) -> Callable[[Sequence[Sequence[int]], torch.Tensor], torch.Tensor]:
    """A per-request logits processor (``engine.submit(..., logits_processor=...)``) that sets the
    logits of tokens ``constraint`` does not allow after each row's text so far to -inf.

    It runs inside the scheduler's step for this request's rows only, so other requests batched
    with it are untouched. ``timing["mask_s"]``, when given, accumulates the seconds it takes.
    """
    tokenizer = engine.tokenizer

    def process(token_ids: Sequence[Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
        # logits: (rows, V); it may be a broadcast view of the prefill's logits, so never write in place.
        started = time.perf_counter()
        try:
            rows = []
            for row, ids in enumerate(token_ids):
                allowed = constraint.allowed(tokenizer.decode(list(ids), skip_special_tokens=True))
                if allowed is None:
                    rows.append(logits[row])
                else:
                    blocked = ~allowed.to(logits.device)[: logits.shape[-1]]
                    rows.append(logits[row].masked_fill(blocked, float("-inf")))
            return torch.stack(rows)
        finally:
            if timing is not None:
                timing["mask_s"] = timing.get("mask_s", 0.0) + time.perf_counter() - started

    return process


# -- constrained decoding -----------------------------------------------------------------------
class ConstrainedDecoder:
    """Appends scaffold text and model-written values after a prompt.

    Args:
        engine: The ``RKSCEngine`` to decode with.
        prompt_ids: Token ids of the rendered prompt (ending in the assistant's generation prompt).
        params: Sampling settings (temperature, top_p, top_k, seed); ``max_new_tokens`` bounds each string value.
        text: Text already written after the prompt (e.g. the model's prose before a tool call).
        token_masks: Constrain each value at token level (see the module docstring); False keeps only
            the scaffold and the coercion.
    """

    def __init__(
        self, engine: Any, prompt_ids: Sequence[int], params: SamplingParams, text: str = "", token_masks: bool = True
    ) -> None:
        self._engine = engine
        self._prompt_ids = list(prompt_ids)
        self._params = params
        self._vocab = vocabulary(engine) if token_masks else None
        self.text = text
        self.output_tokens = 0
        self.timing: dict[str, float] = {"mask_s": 0.0}  # seconds spent computing and applying masks
        self.first: Completion | None = None  # the first call's accounting (prompt tokens, cache reuse)

    # -- primitives -----------------------------------------------------------------------------
    def emit(self, text: str) -> None:
        self.text += text

    def gen(self, max_new_tokens: int, stop: list[str], constraint: TokenConstraint | None = None) -> str:
        """The model's text after the prompt and the scaffold so far, under ``constraint``."""
        suffix = self._engine.tokenizer(self.text, add_special_tokens=False)["input_ids"] if self.text else []
        params = SamplingParams(
            max_new_tokens=max(1, min(max_new_tokens, self._params.max_new_tokens)),
            temperature=self._params.temperature, top_p=self._params.top_p, top_k=self._params.top_k,
            seed=self._params.seed, stop=tuple(stop),
        )
        prompt_ids = self._prompt_ids + list(suffix)
        processor = None
        if constraint is not None and self._vocab is not None:
            processor = constraint_processor(self._engine, constraint, self.timing)
        completion = self._engine.submit(prompt_ids, 1, params, logits_processor=processor).result()[0]
        if self.first is None:
            self.first = completion
        self.output_tokens += completion.num_generated_tokens
        return completion.text

    def _choice(self, options: list[str], end: str) -> TokenConstraint | None:
        return None if self._vocab is None else ChoiceConstraint(self._vocab, options, self._vocab.starting_with(end))

    def _first_char(self, chars: str) -> TokenConstraint | None:
        return None if self._vocab is None else FixedConstraint(self._vocab.starting_with(chars, skip_spaces=True))

    def choose(self, options: list[str]) -> str:
        """One of ``options``, written as a JSON string: the model spells it under a prefix-trie mask;
        whatever it wrote, the closest option is what is emitted."""
        if len(options) == 1:
            self.emit(json.dumps(options[0], ensure_ascii=False))
            return options[0]
        before = self.text
        self.emit('"')
        longest = max(len(o) for o in options)
        raw = self.gen(longest + 1, ['"', "\n"], self._choice(options, '"'))
        self.text = before
        picked = _closest(raw, options)
        self.emit(json.dumps(picked, ensure_ascii=False))
        return picked

    # -- values ---------------------------------------------------------------------------------
    def value(self, schema: dict[str, Any]) -> Any:
        """Write a value of ``schema`` (a JSON schema with references resolved) and return it."""
        schema = _simplify(schema)
        if "const" in schema:
            self.emit(json.dumps(schema["const"], ensure_ascii=False))
            return schema["const"]
        if "enum" in schema:
            options = list(schema["enum"])
            if all(isinstance(o, str) for o in options):
                return self.choose(options)
            written = [json.dumps(o) for o in options]
            raw = self.gen(max(len(w) for w in written) + 1, _END_VALUE + [" "], self._choice(written, _UNQUOTED_END))
            picked = _closest(raw.strip(), written)
            self.emit(picked)
            return json.loads(picked)
        kind = schema.get("type")
        if kind == "string":
            return self._string()
        if kind == "integer":
            return self._number(schema, integer=True)
        if kind == "number":
            return self._number(schema, integer=False)
        if kind == "boolean":
            raw = self.gen(6, _END_VALUE + [" "], self._choice(["true", "false"], _UNQUOTED_END)).strip().lower()
            value = raw.startswith(("t", "y", "1"))
            self.emit("true" if value else "false")
            return value
        if kind == "null":
            self.emit("null")
            return None
        if kind == "object" or "properties" in schema:
            return self._object(schema)
        if kind == "array":
            return self._array(schema.get("items") or {})
        return self.free_value()

    def _string(self) -> str:
        self.emit('"')
        raw = self.gen(self._params.max_new_tokens, ['"', "\n"])
        self.emit(json.dumps(raw, ensure_ascii=False)[1:])  # escaped body and the closing quote
        return raw

    def _number(self, schema: dict[str, Any], integer: bool) -> int | float:
        constraint = None
        if self._vocab is not None:
            constraint = integer_constraint(self._vocab) if integer else number_constraint(self._vocab)
        raw = self.gen(12, _END_VALUE + [" "], constraint)
        match = (_INT if integer else _NUMBER).match(raw)
        default = schema.get("default", schema.get("minimum", 0))
        value: int | float = (int(match.group(1)) if integer else float(match.group(1))) if match else default
        if not math.isfinite(value):  # "1e999" parses to inf, which JSON cannot write
            value = default
        value = _within_bounds(value, schema, integer)
        value = int(value) if integer else float(value)
        self.emit(json.dumps(value))
        return value

    def _object(self, schema: dict[str, Any]) -> dict[str, Any]:
        properties = schema.get("properties") or {}
        if not properties:
            # ``properties: {}`` (a tool without arguments) is an empty object; no properties at all
            # and extra keys allowed is a free-form object.
            free = "properties" not in schema and schema.get("additionalProperties", True) is not False
            return self.free_object() if free else self._empty()
        # Required keys are written; optional ones are left to their defaults (a small model fills
        # them with noise more often than with meaning).
        keys = [k for k in schema.get("required", list(properties)) if k in properties]
        out: dict[str, Any] = {}
        self.emit("{")
        for i, key in enumerate(keys):
            self.emit(("" if i == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
            out[key] = self.value(properties[key])
        self.emit("}")
        return out

    def _empty(self) -> dict[str, Any]:
        self.emit("{}")
        return {}

    def _array(self, items: dict[str, Any]) -> list[Any]:
        self.emit("[")
        out: list[Any] = []
        for i in range(MAX_ITEMS):
            if i:
                self.emit(", ")
            out.append(self.value(items))
            if not self._continues("]"):
                break
        self.emit("]")
        return out

    def _continues(self, closer: str) -> bool:
        """Whether the model writes another item (a comma) rather than close the container."""
        # One masked token decides; unmasked, two let the model get past a space.
        peek = 1 if self._vocab is not None else 2
        return self.gen(peek, [], self._first_char("," + closer)).lstrip().startswith(",")

    def free_object(self) -> dict[str, Any]:
        """An object whose keys the model chooses (JSON mode)."""
        out: dict[str, Any] = {}
        self.emit("{")
        for i in range(MAX_ITEMS):
            if i:
                self.emit(", ")
            self.emit('"')
            key = self.gen(16, ['"', "\n"]) or f"key{i}"
            self.emit(json.dumps(key, ensure_ascii=False)[1:] + ": ")
            out[key] = self.free_value()
            if not self._continues("}"):
                break
        self.emit("}")
        return out

    def free_value(self) -> Any:
        """A value whose type the model picks by its first character."""
        peek = 1 if self._vocab is not None else 2
        first = self.gen(peek, [], self._first_char('{["-0123456789tfn')).lstrip()[:1]
        if first == "{":
            return self.free_object()
        if first == "[":
            return self._array({})
        if first in ("t", "f"):
            return self.value({"type": "boolean"})
        if first == "n":
            return self.value({"type": "null"})
        if first == "-" or first.isdigit():
            return self.value({"type": "number"})
        return self._string()


# -- whole calls --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConstrainedResult:
    """A tool call or JSON answer decoded under its schema.

    Attributes:
        text: The prose before the call (tool calls), or the JSON text (JSON answers).
        tool_calls: The calls made (one per ``decode_tool_call``).
        value: The decoded JSON value (JSON answers), else None.
        finish_reason: ``"tool_calls"`` or ``"stop"``.
        completion: The accounting to report for the request: the free generation that started the
            call, else the first value call with the request's own prompt length.
        num_generated_tokens: Tokens the model generated for the whole result.
        mask_s: Seconds spent computing and applying token masks (their overhead).
    """

    text: str
    tool_calls: tuple[ToolCall, ...]
    value: Any
    finish_reason: str
    completion: Completion
    num_generated_tokens: int
    mask_s: float = 0.0


def decode_tool_call(
    engine: Any,
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
    return _result(decoder, prompt_ids, free, prose, (ToolCall(name, arguments, new_call_id()),), None, "tool_calls")


def with_tool_call_stop(params: SamplingParams) -> SamplingParams:
    """``params`` with ``TOOL_CALL_OPEN`` as a stop, so a call the model starts ends its free text
    and is finished under the schema (``finish_tool_turn``)."""
    return dataclasses.replace(params, stop=(*params.stop, TOOL_CALL_OPEN))


def value_params(params: SamplingParams, seed: int | None) -> SamplingParams:
    """The sampling settings of a constrained answer's value calls: ``params``' temperature, top_p
    and top_k, at most ``MAX_VALUE_TOKENS`` tokens a value, no stop strings (the decoder sets each
    value's own), seeded ``seed``."""
    return dataclasses.replace(
        params, max_new_tokens=min(params.max_new_tokens, MAX_VALUE_TOKENS), stop=(), seed=seed
    )


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
    engine: Any, prompt: Any, request: ToolRequest, free: Completion, params: SamplingParams,
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


def decode_json(
    engine: Any, prompt_ids: Sequence[int], params: SamplingParams, schema: dict[str, Any] | None = None,
    *, token_masks: bool = True,
) -> ConstrainedResult:
    """A JSON answer: a value of ``schema`` (local ``$ref``s are resolved), or with no schema an
    object whose keys the model chooses (JSON mode). ``text`` is its compact JSON."""
    decoder = ConstrainedDecoder(engine, prompt_ids, params, token_masks=token_masks)
    value = decoder.value(inline_refs(schema)) if schema else decoder.free_object()
    return _result(decoder, prompt_ids, None, json.dumps(value, ensure_ascii=False), (), value, "stop")


def _result(
    decoder: ConstrainedDecoder, prompt_ids: Sequence[int], free: Completion | None, text: str,
    calls: tuple[ToolCall, ...], value: Any, finish_reason: str,
) -> ConstrainedResult:
    first = free if free is not None else decoder.first
    if first is None:  # the schema left nothing for the model to write (a tool without arguments)
        first = Completion("", (), (), "stop", num_prompt_tokens=len(prompt_ids))
    elif free is None:
        # The first value's prompt already held some scaffold; report the request's own prompt.
        first = dataclasses.replace(
            first, num_prompt_tokens=len(prompt_ids), num_cached_tokens=min(first.num_cached_tokens, len(prompt_ids))
        )
    generated = decoder.output_tokens + (free.num_generated_tokens if free is not None else 0)
    return ConstrainedResult(text, calls, value, finish_reason, first, generated, decoder.timing["mask_s"])


def decode_constrained(
    engine: Any, prompt_ids: Sequence[int], params: SamplingParams, request: ToolRequest | None = None,
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


def json_instruction(schema: dict[str, Any] | None) -> str:
    """The system text asking for a JSON answer (with its schema, when there is one)."""
    if not schema:
        return JSON_INSTRUCTION
    return JSON_INSTRUCTION + " Its JSON schema: " + json.dumps(schema, ensure_ascii=False)


def inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with local ``$ref``s replaced by their definitions (the decoder walks plain schemas)."""
    defs = {**schema.get("$defs", {}), **schema.get("definitions", {})}

    def walk(node: Any, depth: int = 0) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.rsplit("/", 1)[-1] in defs and depth < 16:
                return walk({**defs[ref.rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}}, depth + 1)
            return {k: walk(v, depth) for k, v in node.items() if k not in ("$defs", "definitions")}
        if isinstance(node, list):
            return [walk(v, depth) for v in node]
        return node

    return walk(schema)


# -- what the decoder honours ---------------------------------------------------------------------
JSON_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
# Assertions the decoder does not enforce: output decoded under a schema that uses them may not
# validate, so a caller that promises validity refuses such a schema up front (``check_schema``).
UNSUPPORTED_KEYWORDS = (
    "pattern", "minLength", "maxLength", "format", "contentEncoding", "contentMediaType", "multipleOf",
    "prefixItems", "contains", "minContains", "maxContains", "minProperties", "maxProperties",
    "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies", "not",
    "if", "then", "else", "unevaluatedProperties", "unevaluatedItems", "additionalItems",
)
_COMBINERS = ("anyOf", "oneOf", "allOf")


class SchemaNotSupported(ValueError):
    """A JSON schema asks for something ``ConstrainedDecoder`` cannot guarantee.

    Attributes:
        loc: Where, as keys and list indices from the schema's root (``("properties", "x", "pattern")``).
    """

    def __init__(self, message: str, loc: tuple[str | int, ...]) -> None:
        super().__init__(message)
        self.loc = loc


def check_schema(schema: Any) -> None:
    """Raise ``SchemaNotSupported`` unless every value decoded under ``schema`` validates against it.

    The decoder honours ``type`` (one, or one plus ``"null"``), ``properties``/``required``,
    ``additionalProperties`` beside properties, ``items``, ``enum``, ``const``, numeric bounds, local
    ``$ref``s (not recursive ones), Optional-style ``anyOf``/``oneOf`` (one non-null option) and a
    one-schema ``allOf``. It writes only required keys, 1 to ``MAX_ITEMS`` array items, and coerces
    each value to its type; anything that constrains more than that (``UNSUPPORTED_KEYWORDS``, tighter
    array bounds, unions of several types) is refused rather than answered with invalid JSON.
    Keywords it does not know are annotations (``title``, ``description``, vendor keys) and pass.

    Raises:
        SchemaNotSupported: The first unsupported use, with its location.
    """
    defs = {}
    if isinstance(schema, dict):
        defs = {**{k: ("definitions", k) for k in schema.get("definitions") or {}},
                **{k: ("$defs", k) for k in schema.get("$defs") or {}}}
    _check_node(schema, schema, (), defs, ())


def _check_node(root: Any, node: Any, loc: tuple[str | int, ...], defs: dict[str, tuple[str, str]],
                refs: tuple[str, ...]) -> None:
    if not isinstance(node, dict):
        raise SchemaNotSupported(f"must be a JSON-schema object, got {json.dumps(node)[:40]}", loc)
    ref = node.get("$ref")
    if ref is not None:
        name = ref.rsplit("/", 1)[-1] if isinstance(ref, str) else None
        if not isinstance(ref, str) or not ref.startswith("#/") or name not in defs:
            raise SchemaNotSupported(f"$ref {ref!r} is not a local reference to $defs or definitions", (*loc, "$ref"))
        if name in refs:
            raise SchemaNotSupported(f"$ref {ref!r} is recursive; the decoder needs a finite schema", (*loc, "$ref"))
        target_loc = defs[name]
        _check_node(root, root[target_loc[0]][target_loc[1]], target_loc, defs, (*refs, name))
    for keyword in UNSUPPORTED_KEYWORDS:
        if keyword in node:
            raise SchemaNotSupported(f"{keyword} is not supported: constrained decoding cannot enforce it",
                                     (*loc, keyword))
    if node.get("uniqueItems"):
        raise SchemaNotSupported("uniqueItems is not supported: constrained decoding cannot enforce it",
                                 (*loc, "uniqueItems"))
    _check_type(node, loc)
    _check_combiners(root, node, loc, defs, refs)
    _check_object(root, node, loc, defs, refs)
    _check_array(root, node, loc, defs, refs)
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise SchemaNotSupported("enum must be a non-empty list", (*loc, "enum"))


def _check_type(node: dict[str, Any], loc: tuple[str | int, ...]) -> None:
    kind = node.get("type")
    if kind is None:
        return
    kinds = kind if isinstance(kind, list) else [kind]
    if not kinds or not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
        raise SchemaNotSupported(f"type must be one of {sorted(JSON_TYPES)} or a list of them, got {kind!r}",
                                 (*loc, "type"))
    if len([k for k in kinds if k != "null"]) > 1:
        raise SchemaNotSupported(f"type {kind!r} is a union of several types; the decoder writes one (and null)",
                                 (*loc, "type"))


def _check_combiners(root: Any, node: dict[str, Any], loc: tuple[str | int, ...],
                     defs: dict[str, tuple[str, str]], refs: tuple[str, ...]) -> None:
    for combiner in _COMBINERS:
        if combiner not in node:
            continue
        options = node[combiner]
        if not isinstance(options, list) or not options:
            raise SchemaNotSupported(f"{combiner} must be a non-empty list of schemas", (*loc, combiner))
        non_null = [i for i, o in enumerate(options) if not (isinstance(o, dict) and o.get("type") == "null")]
        if len(non_null) != 1:
            raise SchemaNotSupported(f"{combiner} with {len(non_null)} non-null options is not supported: the "
                                     f"decoder takes exactly one (Optional[X])", (*loc, combiner))
        _check_node(root, options[non_null[0]], (*loc, combiner, non_null[0]), defs, refs)


def _check_object(root: Any, node: dict[str, Any], loc: tuple[str | int, ...],
                  defs: dict[str, tuple[str, str]], refs: tuple[str, ...]) -> None:
    properties = node.get("properties")
    if properties is not None and not isinstance(properties, dict):
        raise SchemaNotSupported("properties must be an object of schemas", (*loc, "properties"))
    for key, value in (properties or {}).items():
        _check_node(root, value, (*loc, "properties", key), defs, refs)
    required = node.get("required")
    if required is not None:
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise SchemaNotSupported("required must be a list of property names", (*loc, "required"))
        missing = [k for k in required if k not in (properties or {})]
        if missing:
            raise SchemaNotSupported(f"required names {missing}, which are not in properties; the decoder "
                                     f"writes only declared properties", (*loc, "required"))
    extra = node.get("additionalProperties")
    if extra is not None and not isinstance(extra, bool) and not properties:
        raise SchemaNotSupported("additionalProperties as a schema (a map of typed values) is not supported",
                                 (*loc, "additionalProperties"))


def _check_array(root: Any, node: dict[str, Any], loc: tuple[str | int, ...],
                 defs: dict[str, tuple[str, str]], refs: tuple[str, ...]) -> None:
    if "items" in node:
        _check_node(root, node["items"], (*loc, "items"), defs, refs)
    low, high = node.get("minItems"), node.get("maxItems")
    if low is not None and (not isinstance(low, int) or low > 1):
        raise SchemaNotSupported(f"minItems {low} is not supported: the decoder may write a single item",
                                 (*loc, "minItems"))
    if high is not None and (not isinstance(high, int) or high < MAX_ITEMS):
        raise SchemaNotSupported(f"maxItems {high} is not supported: the decoder may write up to {MAX_ITEMS} items",
                                 (*loc, "maxItems"))


def _simplify(schema: dict[str, Any]) -> dict[str, Any]:
    """Optional[X] (``anyOf [X, null]``) and one-item ``allOf`` as X; ``type: [X, "null"]`` as X."""
    for combiner in ("anyOf", "oneOf", "allOf"):
        options = schema.get(combiner)
        if isinstance(options, list):
            non_null = [o for o in options if o.get("type") != "null"]
            if len(non_null) == 1:
                merged = {k: v for k, v in schema.items() if k != combiner}
                return _simplify({**non_null[0], **merged})
    kind = schema.get("type")
    if isinstance(kind, list):
        non_null = [k for k in kind if k != "null"]
        return {**schema, "type": non_null[0] if non_null else "null"}
    return schema


def _within_bounds(value: int | float, schema: dict[str, Any], integer: bool) -> int | float:
    """``value`` moved to the nearest value the schema's bounds allow: the bounds are part of the
    schema, so a coerced value honours them too. ``exclusiveMinimum``/``exclusiveMaximum`` are
    bounds of their own (a ``true`` flag makes ``minimum``/``maximum`` exclusive, the draft-4 form)."""
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is not None and value < low:
        value = low
    if high is not None and value > high:
        value = high
    above, below = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if isinstance(above, bool):
        above = low if above else None
    if isinstance(below, bool):
        below = high if below else None
    if above is not None and value <= above:
        value = math.floor(above) + 1 if integer else math.nextafter(above, math.inf)
    if below is not None and value >= below:
        value = math.ceil(below) - 1 if integer else math.nextafter(below, -math.inf)
    return value


def _closest(raw: str, options: list[str]) -> str:
    raw = raw.strip()
    for option in options:
        if raw == option:
            return option
    starts = [o for o in options if raw and (o.startswith(raw) or raw.startswith(o))]
    if starts:
        return max(starts, key=len) if raw else starts[0]
    close = difflib.get_close_matches(raw, options, n=1, cutoff=0.0)
    return close[0] if close else options[0]
