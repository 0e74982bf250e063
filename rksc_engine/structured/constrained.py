"""Schema-constrained JSON decoding: a value of a JSON schema written with a local model, valid
whatever the model writes.

``ConstrainedDecoder`` writes every structural token itself (braces, keys, quotes, commas) and asks
the model only for each value, one short engine call per value; the value is then coerced to its
schema type (an integer field gets an integer, an enum a member), so the output is valid JSON of the
schema's shape whatever the model writes. Each value call also runs under a token-level mask
(``constraint_processor``, a logits processor the scheduler applies to that request's rows only, so
requests batched beside it are untouched) that sets the logits of tokens that cannot continue a value
of that type to -inf (an integer takes digits, an enum follows a prefix trie of its members, a boolean
is ``true``/``false``, an array goes on with ``,`` or ends with ``]``), so the model chooses among
valid continuations by its own probabilities instead of having its free text repaired afterwards.
String values are not masked (any text is a valid string; the closing quote ends them). A masked
call's logprobs are over the masked distribution. Every value call re-sends the prompt plus the
scaffold so far; the prefix cache serves all but the newest tokens.

This module knows JSON values and token masks, not the tool protocol: the tool-calling protocol
(``rksc_engine.structured.tools``) builds a tool call on this decoder, and
``rksc_engine.structured.json_schema`` says which schemas the decoder can guarantee (and sets its
item limit, ``MAX_ITEMS``). A result carries the calls made as ``ToolCall`` records, defined here
because the result holds them; the protocol that writes and parses them imports this module, never
the other way.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..config import SamplingParams
from ..protocol import LocalEngine
from ..results import Completion
from .json_schema import MAX_ITEMS

__all__ = [
    "MAX_VALUE_TOKENS",
    "ChoiceConstraint",
    "ConstrainedDecoder",
    "ConstrainedResult",
    "FixedConstraint",
    "PatternConstraint",
    "TokenConstraint",
    "TokenVocabulary",
    "ToolCall",
    "constraint_processor",
    "decode_json",
    "inline_refs",
    "integer_constraint",
    "number_constraint",
    "value_params",
    "vocabulary",
]

MAX_VALUE_TOKENS = 64  # constrained values are short; a runaway string value stops here

_INT = re.compile(r"\s*(-?\d+)")
_NUMBER = re.compile(r"\s*(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)")
_END_VALUE = [",", "}", "]", "\n"]
_UNQUOTED_END = ",}]\n "  # characters that end an unquoted value (number, boolean)


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


def vocabulary(engine: LocalEngine) -> TokenVocabulary:
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
    engine: LocalEngine, constraint: TokenConstraint, timing: dict[str, float] | None = None
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
        self, engine: LocalEngine, prompt_ids: Sequence[int], params: SamplingParams, text: str = "", token_masks: bool = True
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

    # -- the result -----------------------------------------------------------------------------
    def result(
        self, text: str, calls: tuple[ToolCall, ...], value: Any, finish_reason: str, free: Completion | None = None
    ) -> ConstrainedResult:
        """What was decoded, with the request's accounting.

        Args:
            text: The result's text (the prose before a call, or the JSON text).
            calls: The tool calls made.
            value: The decoded JSON value (JSON answers), else None.
            finish_reason: ``"tool_calls"`` or ``"stop"``.
            free: The free generation the decoder continued (its accounting is reported), if any.
        """
        prompt_ids = self._prompt_ids
        first = free if free is not None else self.first
        if first is None:  # the schema left nothing for the model to write (a tool without arguments)
            first = Completion("", (), (), "stop", num_prompt_tokens=len(prompt_ids))
        elif free is None:
            # The first value's prompt already held some scaffold; report the request's own prompt.
            first = dataclasses.replace(
                first, num_prompt_tokens=len(prompt_ids), num_cached_tokens=min(first.num_cached_tokens, len(prompt_ids))
            )
        generated = self.output_tokens + (free.num_generated_tokens if free is not None else 0)
        return ConstrainedResult(text, calls, value, finish_reason, first, generated, self.timing["mask_s"])


# -- results ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name, its arguments, and a fresh call id."""

    name: str
    arguments: dict[str, Any]
    id: str


@dataclass(frozen=True)
class ConstrainedResult:
    """A tool call or JSON answer decoded under its schema.

    Attributes:
        text: The prose before the call (tool calls), or the JSON text (JSON answers).
        tool_calls: The calls made (one per ``rksc_engine.structured.tools.decode_tool_call``).
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


def decode_json(
    engine: LocalEngine, prompt_ids: Sequence[int], params: SamplingParams, schema: dict[str, Any] | None = None,
    *, token_masks: bool = True,
) -> ConstrainedResult:
    """A JSON answer: a value of ``schema`` (local ``$ref``s are resolved), or with no schema an
    object whose keys the model chooses (JSON mode). ``text`` is its compact JSON."""
    decoder = ConstrainedDecoder(engine, prompt_ids, params, token_masks=token_masks)
    value = decoder.value(inline_refs(schema)) if schema else decoder.free_object()
    return decoder.result(json.dumps(value, ensure_ascii=False), (), value, "stop")


def value_params(params: SamplingParams, seed: int | None) -> SamplingParams:
    """The sampling settings of a constrained answer's value calls: ``params``' temperature, top_p
    and top_k, at most ``MAX_VALUE_TOKENS`` tokens a value, no stop strings (the decoder sets each
    value's own), seeded ``seed``."""
    return dataclasses.replace(
        params, max_new_tokens=min(params.max_new_tokens, MAX_VALUE_TOKENS), stop=(), seed=seed
    )


# -- schema preparation -------------------------------------------------------------------------
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
