"""Schema-constrained JSON decoding on top of plain engine calls.

The engine has no logits-processor hook, so the constraint is applied the way guidance-style
templating does it: the adapter writes every structural token itself (braces, keys, quotes, commas)
and asks the model only for each value, one short engine call per value, with stop strings that end
the value. Values are then coerced to the schema's type (an integer field gets an integer, an enum
the closest member). The output is therefore always valid JSON of the schema's shape, whatever a
small model would have written on its own. Every call re-sends the same prompt plus the scaffold so
far; the prefix cache serves all but the newest tokens, so the cost is close to one decode.
"""

from __future__ import annotations

import difflib
import json
import re
from typing import Any

from rksc_engine import Completion, RKSCEngine, SamplingParams

_INT = re.compile(r"\s*(-?\d+)")
_NUMBER = re.compile(r"\s*(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)")
_END_VALUE = [",", "}", "]", "\n"]
MAX_ITEMS = 8  # array items / free object keys the model may produce, so a loop cannot run away


class ConstrainedDecoder:
    """Appends scaffold text and model-written values after a prompt.

    Args:
        engine: The engine to decode with.
        prompt_ids: Token ids of the rendered prompt (ending in the assistant's generation prompt).
        params: Sampling settings (temperature, top_p, seed); max_new_tokens bounds each string value.
        text: Text already written after the prompt (e.g. the model's prose before a tool call).
    """

    def __init__(self, engine: RKSCEngine, prompt_ids: list[int], params: SamplingParams, text: str = "") -> None:
        self._engine = engine
        self._prompt_ids = list(prompt_ids)
        self._params = params
        self.text = text
        self.output_tokens = 0
        self.first: Completion | None = None  # the first call's accounting (prompt tokens, cache reuse)

    # -- primitives -----------------------------------------------------------------------------
    def emit(self, text: str) -> None:
        self.text += text

    def gen(self, max_new_tokens: int, stop: list[str]) -> str:
        suffix = self._engine.tokenizer(self.text, add_special_tokens=False)["input_ids"] if self.text else []
        params = SamplingParams(
            max_new_tokens=max(1, min(max_new_tokens, self._params.max_new_tokens)),
            temperature=self._params.temperature, top_p=self._params.top_p, top_k=self._params.top_k,
            seed=self._params.seed, stop=tuple(stop),
        )
        completion = self._engine.generate(self._prompt_ids + list(suffix), params)
        if self.first is None:
            self.first = completion
        self.output_tokens += completion.num_generated_tokens
        return completion.text

    def choose(self, options: list[str], max_new_tokens: int = 16) -> str:
        """One of ``options`` (written as a JSON string): the model writes a string, the closest option wins."""
        if len(options) == 1:
            self.emit(json.dumps(options[0], ensure_ascii=False))
            return options[0]
        before = self.text
        self.emit('"')
        raw = self.gen(max_new_tokens, ['"', "\n"])
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
            raw = self.gen(8, _END_VALUE)
            picked = _closest(raw.strip(), [json.dumps(o) for o in options])
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
            raw = self.gen(3, _END_VALUE).strip().lower()
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
        raw = self.gen(12, _END_VALUE + [" "])
        match = (_INT if integer else _NUMBER).match(raw)
        default = schema.get("default", schema.get("minimum", 0))
        value: int | float = (int(match.group(1)) if integer else float(match.group(1))) if match else default
        # The bounds are part of the schema, so the coerced value honours them too.
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        step = 1 if integer else 0
        if "exclusiveMinimum" in schema and value <= low:
            value = low + step
        elif low is not None and value < low:
            value = low
        if "exclusiveMaximum" in schema and value >= high:
            value = high - step
        elif high is not None and value > high:
            value = high
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
            if not self._continues():
                break
        self.emit("]")
        return out

    def _continues(self) -> bool:
        """Whether the model would write another item (a comma) rather than close the container."""
        return self.gen(2, []).lstrip().startswith(",")

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
            if not self._continues():
                break
        self.emit("}")
        return out

    def free_value(self) -> Any:
        """A value whose type the model picks by its first character."""
        first = self.gen(2, []).lstrip()[:1]
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
