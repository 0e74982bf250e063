"""Decode-step linear layers on a CPU with the weight as the left operand: which layers take it,
where (only inside the decode step, on its thread, at 2 to MAX_ROWS rows), and that the engine's
tokens stay those of ``linear`` and of ``transformers``."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import MIXED_LENGTH_PROMPTS, engine_hf_greedy, make_char_tokenizer, make_tiny_model

import rksc_engine.runtime.weight_left_linear as weight_left_linear
from rksc_engine import EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.runtime.weight_left_linear import (
    MAX_ROWS,
    MIN_ROWS,
    WeightLeftLinear,
    install,
    uninstall,
    weight_left_products,
)


def layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 24, bias=False))


class SubclassedLinear(torch.nn.Linear):
    """A subclass (as quantized and adapter layers are): computes otherwise, so it is left alone."""


@pytest.fixture(autouse=True)
def small_layers_too(monkeypatch):
    """These tests' layers are small: let them take the product, as a model's large ones do."""
    monkeypatch.setattr(weight_left_linear, "MIN_WEIGHT_ELEMENTS", 0)


@pytest.fixture
def products(monkeypatch):
    """The shapes of the inputs that took the weight-left product."""
    calls = []
    product = weight_left_linear.weight_left_linear

    def counted(x, weight, bias):
        calls.append(tuple(x.shape))
        return product(x, weight, bias)

    monkeypatch.setattr(weight_left_linear, "weight_left_linear", counted)
    return calls


def test_layers_smaller_than_the_bound_stay_linear(monkeypatch):
    monkeypatch.setattr(weight_left_linear, "MIN_WEIGHT_ELEMENTS", 64 * 64)
    model = torch.nn.Sequential(torch.nn.Linear(64, 63), torch.nn.Linear(64, 64))
    assert install(model) == 1
    assert [type(m) for m in model] == [torch.nn.Linear, WeightLeftLinear]


def test_install_takes_plain_float32_cpu_linears_only_and_once():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), SubclassedLinear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16),
                                torch.nn.Linear(8, 8), torch.nn.Conv1d(2, 2, 1))
    hooked = model[3]
    hooked.forward = lambda x: x  # an instance forward someone else installed (accelerate's hooks do)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert install(model) == 1
    assert [type(m) for m in model] == [WeightLeftLinear, SubclassedLinear, torch.nn.Linear, torch.nn.Linear,
                                        torch.nn.Conv1d]
    assert isinstance(model[0], torch.nn.Linear)
    assert hooked.forward(torch.ones(1)) == 1  # theirs, kept
    assert install(model) == 1  # already one: counted, not turned again
    assert model.state_dict().keys() == state.keys() and all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert uninstall(model) == 1
    assert type(model[0]) is torch.nn.Linear


@pytest.mark.parametrize("rows", [1, MIN_ROWS, 5, MAX_ROWS, MAX_ROWS + 1])
def test_outside_the_decode_step_every_call_is_linear_bit_for_bit(rows, products):
    model = layers()
    x = torch.randn(rows, 1, 24)
    want = model[1](F.relu(model[0](x)))  # before install: the class's forward
    install(model)
    assert torch.equal(model[1](F.relu(model[0](input=x))), want)  # nn.Linear's keyword too
    assert products == []


@pytest.mark.parametrize("rows", [MIN_ROWS, 3, 8, MAX_ROWS])
def test_inside_the_decode_step_rows_in_range_take_the_weight_left_product(rows, products):
    model = layers()
    install(model)
    x = torch.randn(rows, 1, 24)
    with weight_left_products():
        hidden = model[0](x)
        out = model[1](hidden)
    assert products == [(rows, 1, 24), (rows, 1, 40)]
    assert hidden.shape == (rows, 1, 40) and hidden.is_contiguous() and out.is_contiguous()
    assert torch.equal(hidden, torch.addmm(model[0].bias[:, None], model[0].weight, x[:, 0].T).T[:, None])
    torch.testing.assert_close(out, F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight))


@pytest.mark.parametrize("rows", [1, MAX_ROWS + 1])
def test_inside_the_decode_step_rows_out_of_range_stay_linear(rows, products):
    model = layers()
    x = torch.randn(rows, 24)
    want = model[0](x)
    install(model)
    with weight_left_products():
        assert torch.equal(model[0](x), want)
    assert products == []


def test_a_layer_turned_to_another_dtype_after_install_stays_linear(products):
    model = layers()
    install(model)
    model.to(torch.float64)
    with weight_left_products():
        model[0](torch.randn(4, 24, dtype=torch.float64))
    assert products == []


def test_a_model_with_it_pickles_and_copies_with_it(products):
    model = layers()
    install(model)
    x = torch.randn(3, 24)
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert type(copied[0]) is WeightLeftLinear
        assert torch.equal(copied[0](x), model[0](x))
        with weight_left_products():
            copied[0](x)
    assert products == [(3, 24), (3, 24)]


def test_the_decode_step_of_one_thread_leaves_another_threads_calls_linear():
    model = layers()
    install(model)
    x = torch.randn(4, 24)
    want = F.linear(x, model[0].weight, model[0].bias)
    entered, computed = threading.Event(), threading.Event()
    seen = {}

    def other_thread():
        if entered.wait(timeout=30):
            seen["out"] = model[0](x)
        computed.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with weight_left_products():
        entered.set()
        assert computed.wait(timeout=30)
        inside = model[0](x)
    worker.join(timeout=30)
    assert torch.equal(seen["out"], want)
    assert torch.equal(inside, weight_left_linear.weight_left_linear(x, model[0].weight, model[0].bias))


def test_decode_matmul_is_validated():
    with pytest.raises(ValueError, match="decode_matmul"):
        EngineConfig(decode_matmul="fast")
    with pytest.raises(TypeError, match="decode_matmul"):
        EngineConfig(decode_matmul=None)


def test_a_decode_step_of_several_rows_takes_it_and_keeps_the_tokens(products):
    """Four requests decoding together: the step's layers take the weight-left product (at five
    rows); the tokens equal an engine's with ``decode_matmul="linear"`` on the same model, which never
    takes it, and each single-branch request's equal ``transformers``' greedy generation."""
    model, tokenizer = make_tiny_model(0), make_char_tokenizer()
    engine = RKSCEngine(model, tokenizer, EngineConfig(decode_attention="shared_prefix"))
    plain = RKSCEngine(model, tokenizer, EngineConfig(decode_attention="shared_prefix", decode_matmul="linear"))
    again = RKSCEngine(model, tokenizer, EngineConfig(decode_attention="shared_prefix"))
    assert engine.runner.weight_left_layers > 0 and plain.runner.weight_left_layers == 0
    assert again.runner.weight_left_layers == engine.runner.weight_left_layers  # a second engine on the model
    params = SamplingParams(max_new_tokens=12)
    work = [(p, 1) for p in MIXED_LENGTH_PROMPTS[:3]] + [(MIXED_LENGTH_PROMPTS[3], 2)]

    def run(on):
        with on.exclusive():  # all four admitted in one step, so they decode together
            handles = [on.submit(p, n, params) for p, n in work]
        return [[c.token_ids for c in h.result()] for h in handles]

    got = run(engine)
    rows = [shape[0] for shape in products]
    assert rows and max(rows) == 5 and min(rows) >= MIN_ROWS
    products.clear()
    assert run(plain) == got
    assert products == []
    assert run(again) == got and products  # the second engine on the model takes it too
    for (prompt, n), tokens in zip(work, got):
        if n == 1:
            assert tuple(tokens[0]) == engine_hf_greedy(engine, prompt, params.max_new_tokens)
