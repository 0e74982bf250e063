"""rksc_engine.structured (tools, constrained, json_schema) on the tiny seeded model: the tool
protocol both ways, parsing, token masks, calls / JSON decoded under their schema, and the schema
checks."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rksc_engine import Completion, RKSCEngine, SamplingParams
from rksc_engine.structured import constrained as C
from rksc_engine.structured import json_schema
from rksc_engine.structured import tools as T
from tests.conftest import make_char_tokenizer

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
PICK = {"name": "pick", "description": "Pick a colour.", "parameters": {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"},
                   "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}}},
    "required": ["colour", "bright", "sizes"]}}
GREEDY = SamplingParams(max_new_tokens=16)


def prompt_ids(engine, text: str = "call a tool") -> list[int]:
    return engine.encode([{"role": "user", "content": text}])


def next_logits(engine, ids: list[int]) -> torch.Tensor:
    """The plain model's next-token logits after ``ids`` (no engine, no cache, no mask)."""
    with torch.no_grad():
        return engine.model(input_ids=torch.tensor([ids])).logits[0, -1]


def no_hooks_left(model) -> bool:
    modules = (model, model.get_output_embeddings())
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in modules)


# -- protocol -----------------------------------------------------------------------------------
def test_openai_tools_and_bare_function_dicts_give_the_same_spec():
    assert T.function_spec(ADD) == T.function_spec(ADD["function"])
    assert T.function_spec({"name": "noargs"})["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("tool, error, match", [
    ("add", TypeError, "must be a dict"),
    ({"description": "no name"}, ValueError, "non-empty string 'name'"),
    ({"name": "x", "parameters": "a: int"}, ValueError, "'parameters' must be a JSON-schema dict"),
])
def test_a_malformed_tool_is_a_clear_error(tool, error, match):
    with pytest.raises(error, match=match):
        T.function_spec(tool)


def test_tool_choice_names_map_onto_auto_any_none_or_a_tool():
    names = ["add", "pick"]
    assert [T.normalise_tool_choice(c, names) for c in (None, "auto", False)] == [None, None, None]
    assert [T.normalise_tool_choice(c, names) for c in ("any", "required", True)] == ["any"] * 3
    assert T.normalise_tool_choice({"function": {"name": "pick"}}, names) == "pick"
    with pytest.raises(ValueError, match="tool_choice must be .* one of the tool names"):
        T.normalise_tool_choice("subtract", names)


def test_a_forced_choice_of_a_single_tool_names_it():
    assert T.ToolRequest.build([ADD], "any").forced_name == "add"
    assert T.ToolRequest.build([ADD, PICK], "any").forced_name is None
    assert T.ToolRequest.build([ADD, PICK], None).forced is False
    assert T.ToolRequest.build([ADD], "none") is None and T.ToolRequest.build([], "any") is None


def test_without_template_support_tools_go_into_the_system_prompt_and_past_calls_into_the_text(tiny_tokenizer):
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
    ]
    messages, kwargs = T.offer_tools(history, T.ToolRequest.build([ADD]), tiny_tokenizer)
    assert kwargs == {}
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call functions.") and '"name": "add"' in messages[0]["content"]
    assert messages[1] == {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'}


def test_a_template_that_takes_tools_renders_them_itself_and_keeps_the_calls_structured(tiny_model):
    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}" + tokenizer.chat_template
    engine = RKSCEngine(tiny_model, tokenizer)
    history = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {}}}]}]
    messages, kwargs = T.offer_tools(history, T.ToolRequest.build([ADD, PICK]), tokenizer)
    assert messages == history and [t["function"]["name"] for t in kwargs["tools"]] == ["add", "pick"]
    ids = T.encode_with_tools(engine, [{"role": "user", "content": "hi"}], T.ToolRequest.build([ADD]))
    assert tokenizer.decode(ids) == "[add]<user>hi\n<assistant>"


def test_parsing_reads_back_what_the_protocol_writes_and_leaves_malformed_blocks_in_the_prose():
    text = "Let me add. " + T.format_tool_call("add", {"a": 2, "b": 3}) + T.format_tool_call("add", '{"a": 1, "b": 1}')
    prose, calls = T.parse_tool_calls(text)
    assert prose == "Let me add."
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 2, "b": 3}), ("add", {"a": 1, "b": 1})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert T.parse_tool_calls("<tool_call>{oops}</tool_call>") == ("<tool_call>{oops}</tool_call>", [])
    assert T.parse_tool_calls('<tool_call>{"name": "echo", "arguments": "hi"}')[1][0].arguments == {"input": "hi"}


def test_a_generation_stopped_at_the_opener_is_told_apart_from_one_stopped_elsewhere(tiny_tokenizer):
    ids = tuple(tiny_tokenizer("abc<tool_call>", add_special_tokens=False)["input_ids"])
    at_opener = Completion("abc", ids, (0.0,) * len(ids), "stop", num_prompt_tokens=3)
    assert T.stopped_at_tool_call(tiny_tokenizer, at_opener)
    other = tuple(tiny_tokenizer("abc##", add_special_tokens=False)["input_ids"])
    assert not T.stopped_at_tool_call(tiny_tokenizer, Completion("abc", other, (0.0,) * 5, "stop", num_prompt_tokens=3))
    assert not T.stopped_at_tool_call(tiny_tokenizer, Completion("abc", ids, (0.0,) * len(ids), "eos", num_prompt_tokens=3))


# -- token masks --------------------------------------------------------------------------------
def test_the_vocabulary_index_finds_prefix_tokens_and_first_characters(tiny_engine):
    vocab = C.vocabulary(tiny_engine)
    assert [vocab.texts[i] for i in vocab.prefixes_of("red")] == ["r"]  # one character a token
    assert vocab.eos[1] and not vocab.eos[2]
    starts = vocab.starting_with(",]")
    assert {vocab.texts[i] for i in starts.nonzero().flatten().tolist()} == {",", "]"}
    assert C.vocabulary(tiny_engine) is vocab  # built once per tokenizer


def test_an_enum_is_the_member_whose_first_token_the_model_ranks_highest(tiny_engine):
    ids = prompt_ids(tiny_engine)
    decoder = C.ConstrainedDecoder(tiny_engine, ids, GREEDY)
    options = ["red", "green", "blue"]
    picked = decoder.choose(options)
    logits = next_logits(tiny_engine, ids + tiny_engine.tokenizer('"', add_special_tokens=False)["input_ids"])
    first = {o: tiny_engine.tokenizer(o[0], add_special_tokens=False)["input_ids"][0] for o in options}
    assert picked == max(options, key=lambda o: logits[first[o]].item())
    assert decoder.text == json.dumps(picked)


def test_an_integer_is_written_in_digits_starting_with_the_models_best_digit(tiny_engine):
    ids = prompt_ids(tiny_engine, "a number")
    decoder = C.ConstrainedDecoder(tiny_engine, ids, GREEDY)
    value = decoder.value({"type": "integer"})
    assert isinstance(value, int) and decoder.text == str(value)
    digits = [tiny_engine.tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in "-0123456789"]
    logits = next_logits(tiny_engine, ids)
    best = "-0123456789"[max(range(11), key=lambda k: logits[digits[k]].item())]
    assert str(value).startswith(best) or (best == "-" and value >= 0)  # a bare "-" is coerced away


def test_the_mask_makes_the_model_itself_write_digits_where_unmasked_only_the_default_is_left(tiny_engine):
    ids = prompt_ids(tiny_engine, "a number")
    unmasked = C.ConstrainedDecoder(tiny_engine, ids, GREEDY, token_masks=False)
    assert unmasked.value({"type": "integer", "default": 7}) == 7
    assert not unmasked.first.text.lstrip()[:1].isdigit()  # the random model wrote letters; coercion fell back
    masked = C.ConstrainedDecoder(tiny_engine, ids, GREEDY)
    masked.value({"type": "integer", "default": 7})
    assert masked.first.text.isdigit()  # its own digits, cut where it chose an end token


def test_a_failing_mask_fails_only_its_request_and_generation_stays_exact(tiny_engine):
    prompt = prompt_ids(tiny_engine, "hello")
    reference = tiny_engine.generate(prompt, GREEDY).token_ids

    class Exploding:
        def allowed(self, text):
            raise RuntimeError("constraint failed")

    with pytest.raises(RuntimeError, match="constraint failed"):
        processor = C.constraint_processor(tiny_engine, Exploding())
        tiny_engine.submit(prompt, 1, GREEDY, logits_processor=processor).result()
    T.decode_tool_call(tiny_engine, prompt, GREEDY, T.ToolRequest.build([PICK], "any"))
    assert no_hooks_left(tiny_engine.model)
    assert tiny_engine.generate(prompt, GREEDY).token_ids == reference
    with torch.no_grad():
        plain = tiny_engine.model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
    assert tuple(plain.tolist())[: len(reference)] == reference


# -- whole calls --------------------------------------------------------------------------------
def test_a_forced_call_has_arguments_of_every_schema_type(tiny_engine):
    ids = prompt_ids(tiny_engine)
    result = T.decode_tool_call(tiny_engine, ids, GREEDY, T.ToolRequest.build([PICK], "pick"))
    [call] = result.tool_calls
    assert call.name == "pick" and result.finish_reason == "tool_calls"
    assert call.arguments["colour"] in ("red", "green", "blue") and isinstance(call.arguments["bright"], bool)
    assert 1 <= len(call.arguments["sizes"]) <= json_schema.MAX_ITEMS and all(1 <= s <= 9 for s in call.arguments["sizes"])
    assert result.completion.num_prompt_tokens == len(ids) and result.num_generated_tokens > 0


def test_the_model_picks_which_tool_to_call_by_name_when_none_is_forced(tiny_engine):
    ids = prompt_ids(tiny_engine)
    result = T.decode_tool_call(tiny_engine, ids, GREEDY, T.ToolRequest.build([ADD, PICK], "any"))
    [call] = result.tool_calls
    logits = next_logits(tiny_engine, ids + tiny_engine.tokenizer('<tool_call>{"name": "', add_special_tokens=False)["input_ids"])
    a, p = (tiny_engine.tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in "ap")
    assert call.name == ("add" if logits[a] > logits[p] else "pick")
    assert set(call.arguments) == set(T.function_spec([ADD, PICK][call.name == "pick"])["parameters"]["required"])


def test_a_call_started_in_free_text_keeps_the_prose_and_reports_the_free_generation(tiny_engine):
    ids = prompt_ids(tiny_engine)
    token_ids = tuple(tiny_engine.tokenizer("Sure.<tool_call>", add_special_tokens=False)["input_ids"])
    free = Completion("Sure.", token_ids, (-0.1,) * len(token_ids), "stop", num_prompt_tokens=len(ids), num_cached_tokens=5)
    result = T.decode_tool_call(tiny_engine, ids, GREEDY, T.ToolRequest.build([ADD]), free=free)
    assert result.text == "Sure." and result.completion is free
    assert result.num_generated_tokens > len(token_ids)
    assert all(type(v) is int for v in result.tool_calls[0].arguments.values())


def test_json_answers_resolve_references_and_json_mode_chooses_its_own_keys(tiny_engine):
    schema = {
        "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["item"], "$defs": {"Item": {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}},
    }
    result = C.decode_json(tiny_engine, prompt_ids(tiny_engine, "json"), GREEDY, schema)
    assert set(result.value) == {"item"} and type(result.value["item"]["count"]) is int
    assert json.loads(result.text) == result.value and result.finish_reason == "stop"
    free = C.decode_json(tiny_engine, prompt_ids(tiny_engine, "json"), GREEDY)
    assert isinstance(free.value, dict) and json.loads(free.text) == free.value


def test_the_tools_module_imports_neither_langchain_nor_llama_index():
    code = ("import sys, rksc_engine.structured.tools, rksc_engine.structured.constrained, "
            "rksc_engine.structured.json_schema; sys.exit(any(m.split('.')[0] in ('langchain_core', 'llama_index') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def sibling_imports(module) -> set[str]:
    """The ``rksc_engine.structured`` modules that ``module`` imports (relative ``from .x import``)."""
    tree = ast.parse(Path(module.__file__).read_text())
    return {node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module}


def test_the_structured_modules_import_one_way_and_define_each_public_name_once():
    # json_schema <- constrained <- tools: the schema check needs neither, the decoder only the
    # schema check's limits, the protocol the decoder; nothing imports back up.
    assert sibling_imports(json_schema) == set()
    assert sibling_imports(C) == {"json_schema"}
    assert sibling_imports(T) == {"constrained"}
    exported = [name for module in (json_schema, C, T) for name in module.__all__]
    assert len(exported) == len(set(exported)), "a public name is listed by two structured modules"
    for module in (json_schema, C, T):
        for name in module.__all__:
            value = getattr(module, name)
            home = getattr(value, "__module__", module.__name__)
            assert home == module.__name__, f"{module.__name__}.{name} is defined in {home}"


# -- what the decoder honours ---------------------------------------------------------------------
@pytest.mark.parametrize("schema, loc", [
    ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^a$"}}}, ("properties", "code", "pattern")),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, ("anyOf",)),
    ({"type": ["string", "integer"]}, ("type",)),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, ("minItems",)),
    ({"type": "object", "properties": {}, "required": ["x"]}, ("required",)),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, ("additionalProperties",)),
    ({"$ref": "#/$defs/Node", "$defs": {"Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}}}},
     ("$defs", "Node", "properties", "next", "$ref")),
    ({"$ref": "https://example.com/schema.json"}, ("$ref",)),
])
def test_a_schema_the_decoder_cannot_honour_is_refused_at_its_location(schema, loc):
    with pytest.raises(json_schema.SchemaNotSupported) as raised:
        json_schema.check_schema(schema)
    assert raised.value.loc == loc


def test_every_schema_check_schema_accepts_here_is_decoded_into_a_valid_value(tiny_engine):
    jsonschema = pytest.importorskip("jsonschema")
    schemas = [
        PICK["parameters"],
        {"type": "object", "title": "Pydantic-style", "additionalProperties": False,
         "properties": {"item": {"$ref": "#/$defs/Item"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}],
                                                                    "default": None},
                        "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
         "required": ["item", "score"],
         "$defs": {"Item": {"type": "object", "properties": {"count": {"type": "integer", "minimum": 3}},
                            "required": ["count"]}}},
        {"type": "array", "items": {"type": ["boolean", "null"]}, "minItems": 1},
        # Bounds no 12-token number can meet unclamped: the coerced values must sit strictly inside.
        {"type": "object", "required": ["above", "below", "count"], "properties": {
            "above": {"type": "number", "exclusiveMinimum": 1e15},
            "below": {"type": "number", "exclusiveMaximum": -1e15},
            "count": {"type": "integer", "exclusiveMinimum": 1e15}}},
    ]
    for schema in schemas:
        json_schema.check_schema(schema)
        result = C.decode_json(tiny_engine, prompt_ids(tiny_engine, "json"), GREEDY, schema)
        jsonschema.validate(json.loads(result.text), schema)
