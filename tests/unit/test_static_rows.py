"""Static decode rows: the pool's slots, and a step over them against the model's own cache.

Every attention family of the matrix decodes token for token as it does through ``transformers``'
``DynamicCache`` (one request at a time), with requests of different prompt lengths sharing the
step, a hole left by a finished request, and rows moved by ``compact``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from rksc_bench.families import FAMILIES, make_family_model
from rksc_engine.kvcache.cache_layers import keeps_token_kv, layer_types, new_kv_cache
from rksc_engine.kvcache.static_rows import CAPACITY_STEP, StaticRowPool
from rksc_engine.runtime.static_decode import StaticStep

ATTENTION_FAMILIES = [f.name for f in FAMILIES if not f.recurrent]


def _pool_with(rows_per_request: list[int], length: int = 4) -> tuple[StaticRowPool, list]:
    pool = StaticRowPool(torch.device("cpu"), torch.float32)
    pool.reserve(sum(rows_per_request), 16, [(2, 4), (2, 4)])
    kv = [(torch.ones(1, 2, length, 4), torch.ones(1, 2, length, 4)) for _ in range(2)]
    handles = []
    for rows in rows_per_request:
        handle = pool.rows(rows)
        pool.write_prompt(handle.slots, kv)
        handles.append(handle)
    return pool, handles


def test_slots_are_taken_lowest_first_and_top_drops_past_free_slots_at_the_end():
    pool, (a, b, c) = _pool_with([2, 1, 2])
    assert (a.slots, b.slots, c.slots) == ([0, 1], [2], [3, 4])
    assert pool.top == 5
    c.release()
    assert pool.top == 3 and pool.num_used == 3
    a.keep([1])  # slot 0 becomes a hole below top
    assert a.slots == [1] and pool.top == 3
    d = pool.rows(2)
    assert d.slots == [0, 3], "the hole is reused before top grows"


def test_released_slots_are_zeroed_so_a_stale_nan_never_reaches_a_masked_product():
    pool, (a,) = _pool_with([1])
    pool.keys[0][0, :, 10] = float("nan")
    a.release()
    assert not torch.isnan(pool.keys[0]).any()
    assert pool.lengths.tolist()[0] == 0


def test_compact_moves_the_highest_rows_into_holes_and_renames_their_owners():
    pool, (a, b, c) = _pool_with([2, 1, 2], length=3)
    pool.keys[1][4, 0, 2, 0] = 7.0  # a mark on c's second row
    a.release()
    assert pool.top == 5
    moved = pool.compact()
    assert moved == 2 and pool.top == 3
    assert b.slots == [2] and sorted(c.slots) == [0, 1]
    assert pool.keys[1][c.slots[1], 0, 2, 0] == 7.0, "a moved row keeps its KV"
    assert pool.lengths[:3].tolist() == [3, 3, 3]
    assert float(pool.keys[1][3:].abs().sum()) == 0.0, "the slots left behind are zero"


def test_reserve_grows_slots_and_capacity_and_keeps_what_is_held():
    pool, (a,) = _pool_with([1])
    pool.keys[0][0, 1, 3, 2] = 5.0
    pool.reserve(3, CAPACITY_STEP + 1)
    assert pool.num_slots == 4 and pool.capacity == 2 * CAPACITY_STEP
    assert pool.keys[0][0, 1, 3, 2] == 5.0 and pool.length(0) == 4


def _plain_greedy(model, prompt: torch.Tensor, steps: int) -> list[int]:
    cache, ids, out = DynamicCache(config=model.config), prompt, []
    with torch.inference_mode():
        for _ in range(steps):
            token = int(model(ids, cache=cache, use_cache=True).logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


def _static_greedy(model, prompts: list[torch.Tensor], steps: int, finish_first_after: int | None = None,
                   compiled: bool = False) -> list[list[int]]:
    """Greedy decoding of ``prompts`` together over static rows; the first request stops after
    ``finish_first_after`` tokens (leaving a hole), and the pool is compacted right after."""
    config = model.config
    text = config.get_text_config()
    step = StaticStep(model, "cache", layer_types(config), getattr(text, "sliding_window", None), compiled=compiled)
    pool = StaticRowPool(torch.device("cpu"), torch.float32)
    handles, outs = [], [[] for _ in prompts]
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            cache = new_kv_cache(config)
            first = int(model(prompt, cache=cache, use_cache=True).logits[0, -1].argmax())
            kv = [(layer.keys, layer.values) for layer in cache.layers]
            pool.reserve(pool.top + 1, prompt.shape[1] + steps + 1, [(k.shape[1], k.shape[3]) for k, _ in kv])
            handle = pool.rows(1)
            pool.write_prompt(handle.slots, kv)
            pool.next_tokens[handle.slots[0]] = first
            handles.append(handle)
            outs[i].append(first)
        live = list(range(len(prompts)))
        for t in range(1, steps):
            if finish_first_after is not None and t == finish_first_after:
                handles[0].release()
                live.remove(0)
                pool.compact()
            logits = step.logits(pool, pool.next_tokens, torch.float32)
            tokens = logits.argmax(-1)
            slots = [handles[i].slots[0] for i in live]
            mask = torch.zeros(pool.top, dtype=torch.long)
            mask[slots] = 1
            pool.advance(mask, slots)
            for i, slot in zip(live, slots):
                outs[i].append(int(tokens[slot]))
                pool.next_tokens[slot] = tokens[slot]
    return outs


@pytest.mark.parametrize("name", ATTENTION_FAMILIES)
def test_static_rows_decode_as_the_models_own_cache_for_every_attention_family(name):
    model = make_family_model(name)
    assert keeps_token_kv(model.config)
    generator = torch.Generator().manual_seed(1)
    # Lengths past the families' sliding window (12) and short of it, so masks and windows differ by row.
    prompts = [torch.randint(3, 100, (1, length), generator=generator) for length in (5, 23, 40, 17)]
    steps = 12
    got = _static_greedy(model, prompts, steps, finish_first_after=6)
    want = [_plain_greedy(model, p, steps) for p in prompts]
    assert got[0] == want[0][:6]
    assert got[1:] == want[1:]


def test_static_step_operator_calls_do_not_grow_with_the_requests():
    from rksc_bench.step_overhead import OperatorCounter

    model = make_family_model("llama3")
    config = model.config
    step = StaticStep(model, "cache", layer_types(config), None)
    counts = {}
    for rows in (2, 16):
        pool = StaticRowPool(torch.device("cpu"), torch.float32)
        pool.reserve(rows, 64, [(2, 16)] * config.num_hidden_layers)
        for r in range(rows):
            handle = pool.rows(1)
            kv = [(torch.randn(1, 2, 3 + r, 16), torch.randn(1, 2, 3 + r, 16))] * config.num_hidden_layers
            pool.write_prompt(handle.slots, kv)
        counter = OperatorCounter()
        with counter:
            step.logits(pool, pool.next_tokens, torch.float32)
        counts[rows] = counter.calls
    assert counts[16] == counts[2], f"a step of 16 requests made {counts[16]} operator calls, of 2 {counts[2]}"
