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
# In the fast tier: full attention, sliding windows with soft-capping, sliding windows with sinks.
FAST_FAMILIES = ("llama3", "gemma2", "gpt-oss")
FAMILY_CASES = [pytest.param(name, marks=() if name in FAST_FAMILIES else pytest.mark.slow)
                for name in ATTENTION_FAMILIES]


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
            logits = step.logits(pool, pool.next_tokens)
            tokens = logits.argmax(-1)
            slots = [handles[i].slots[0] for i in live]
            mask = torch.zeros(pool.top, dtype=torch.long)
            mask[slots] = 1
            pool.advance(mask, slots)
            for i, slot in zip(live, slots):
                outs[i].append(int(tokens[slot]))
                pool.next_tokens[slot] = tokens[slot]
    return outs


@pytest.mark.parametrize("name", FAMILY_CASES)
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
            step.logits(pool, pool.next_tokens)
        counts[rows] = counter.calls
    assert counts[16] == counts[2], f"a step of 16 requests made {counts[16]} operator calls, of 2 {counts[2]}"


def pool_with_prompts(model, prompts: list[torch.Tensor], num_slots: int) -> StaticRowPool:
    """A pool of ``num_slots`` slots holding each of ``prompts``' KV in a row of its own, next token 11."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pool = StaticRowPool(torch.device("cpu"), torch.float32)
    pool.reserve(num_slots, 16, [(config.num_key_value_heads, head_dim)] * config.num_hidden_layers)
    for prompt in prompts:
        kept = new_kv_cache(config)
        with torch.inference_mode():
            model(input_ids=prompt, past_key_values=kept, use_cache=True)
        handle = pool.rows(1)
        pool.write_prompt(handle.slots, [(layer.keys, layer.values) for layer in kept.layers])
        pool.next_tokens[handle.slots[0]] = 11
    return pool


def test_bucket_rows_pads_to_a_power_of_two_within_the_pools_slots():
    from rksc_engine.runtime.static_decode import bucket_rows

    assert [bucket_rows(top, 64) for top in (1, 2, 3, 5, 8, 9, 33)] == [1, 2, 4, 8, 8, 16, 64]
    assert bucket_rows(3, 2) == 3, "never fewer rows than are live"


def test_a_step_padded_to_its_row_bucket_gives_the_live_rows_the_unpadded_logits():
    """What a compiled step runs (eagerly here): 3 live rows padded to 4, the padded one a free slot;
    the live rows' logits equal an unpadded step's, and a request that later takes the padded slot
    decodes as it would in a fresh pool."""
    model = make_family_model("llama3")
    config = model.config
    types = layer_types(config)
    padded = StaticStep(model, "cache", types, None, compiled=True)
    padded._run = padded._forward  # the padding without the compiler
    plain = StaticStep(model, "cache", types, None)
    prompts = [torch.tensor([[5 + i, 9, 3 + 2 * i, 7][: 2 + i]]) for i in range(4)]

    a, b = pool_with_prompts(model, prompts[:3], 4), pool_with_prompts(model, prompts[:3], 4)
    got = padded.logits(a, a.next_tokens)
    want = plain.logits(b, b.next_tokens)
    assert got.shape == want.shape == (3, config.vocab_size)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert a.lengths[3] == 0, "the padded row holds no token"
    # The padded row wrote its key at position 0 of the free slot; a prompt taking the slot
    # overwrites it and leaves zeros after itself, as a fresh pool holds.
    kept = new_kv_cache(config)
    with torch.inference_mode():
        model(input_ids=prompts[3], past_key_values=kept, use_cache=True)
    handle = a.rows(1)
    assert handle.slots == [3]
    a.write_prompt(handle.slots, [(layer.keys, layer.values) for layer in kept.layers])
    length = prompts[3].shape[1]
    for keys, layer in zip(a.keys, kept.layers):
        assert torch.equal(keys[3, :, :length], layer.keys[0]) and not keys[3, :, length:].any()


# -- through the engine ------------------------------------------------------------------------------
from conftest import MIXED_LENGTH_PROMPTS, engine_hf_greedy, make_char_tokenizer, no_locked_nodes  # noqa: E402

from rksc_engine import EngineConfig, RKSCEngine, SamplingParams  # noqa: E402
from rksc_engine.runtime.model_runner import DecodeLayout  # noqa: E402

STATIC = EngineConfig(decode_attention="static_rows")
PROMPT = "System: answer in one line.\nContext: " + "north river stone " * 3 + "\nQ: where?\nA:"
OTHER_PROMPTS = ["A different and somewhat longer request, to batch with the first one.", "hi"]


@pytest.fixture(scope="module")
def tokenizer():
    return make_char_tokenizer()


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_every_attention_family_decodes_greedy_as_transformers_generate_over_static_rows(name, tokenizer):
    engine = RKSCEngine(make_family_model(name), tokenizer, STATIC)
    params = SamplingParams(max_new_tokens=12)
    prompts = [PROMPT, *MIXED_LENGTH_PROMPTS[:3]]
    with engine.exclusive():  # admitted together: they decode in one forward
        handles = [engine.submit(p, 1, params) for p in prompts]
    got = [h.result()[0].token_ids for h in handles]
    assert got == [engine_hf_greedy(engine, p, 12) for p in prompts]
    assert engine.runner.static_step is not None and engine.runner.static_step.num_steps > 0
    assert engine.scheduler.kv.static_pool.num_used == 0, "every row's slot was freed"
    assert no_locked_nodes(engine)


@pytest.mark.parametrize("name", ["llama3", "gemma2", "gpt-oss", "mistral-sliding"])
def test_a_seeded_static_branch_is_the_same_alone_among_siblings_and_among_other_requests(name, tokenizer):
    model = make_family_model(name)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.9, seed=21)
    together = RKSCEngine(model, tokenizer, STATIC)
    handles = [together.submit(PROMPT, 4, sampled)] + [together.submit(p, 2, sampled) for p in OTHER_PROMPTS]
    results = [[c.token_ids for c in handle.result()] for handle in handles]
    assert len(set(results[0])) > 1, "sampled siblings should differ"
    for branch in (0, 3):
        alone = RKSCEngine(model, tokenizer, STATIC).generate(
            PROMPT, SamplingParams(max_new_tokens=12, temperature=0.9, seed=21 + branch))
        assert results[0][branch] == alone.token_ids, f"branch {branch} changed among other requests"
    shared = RKSCEngine(model, tokenizer, EngineConfig(decode_attention="shared_prefix"))
    assert [c.token_ids for c in shared.generate_branches(PROMPT, 4, sampled)] == results[0]
    assert [c.token_ids for c in shared.generate_branches(OTHER_PROMPTS[0], 2, sampled)] == results[1]


def test_rows_that_finish_at_different_steps_leave_holes_that_compact_and_tokens_that_stay_exact(tokenizer):
    model = make_family_model("qwen2.5")
    engine = RKSCEngine(model, tokenizer, STATIC)
    work = [(p, 1, SamplingParams(max_new_tokens=t)) for p, t in zip(MIXED_LENGTH_PROMPTS, (3, 14, 6, 20, 9))]
    with engine.exclusive():
        handles = [engine.submit(p, n, params) for p, n, params in work]
    got = [h.result()[0].token_ids for h in handles]
    for (prompt, _, params), tokens in zip(work, got):
        assert tokens == engine_hf_greedy(engine, prompt, params.max_new_tokens)
    pool = engine.scheduler.kv.static_pool
    assert pool.num_used == 0 and pool.top == 0


class _StopOneAddTwo:
    """After each branch's third token, stops branch 1 and adds two branches (once each)."""

    def __init__(self):
        self.acted = False

    def observe(self, events):
        from rksc_engine.results import BranchControl

        if not self.acted and any(e.num_tokens == 3 for e in events):
            self.acted = True
            return BranchControl(stop=frozenset({1}), add=2)
        return None


def test_a_monitor_that_stops_and_adds_branches_decodes_the_same_over_static_rows(tokenizer):
    model = make_family_model("llama3")
    results = {}
    params = SamplingParams(max_new_tokens=10, temperature=0.8, seed=5)
    for layout in ("shared_prefix", "static_rows"):
        engine = RKSCEngine(model, tokenizer, EngineConfig(decode_attention=layout))
        with engine.exclusive():  # with another request in the batch, so the waves share steps with it
            other = engine.submit(OTHER_PROMPTS[0], 2, params)
            handle = engine.submit(PROMPT, 3, params, monitor=_StopOneAddTwo(), max_branches=5)
        results[layout] = ([(c.token_ids, c.finish_reason) for c in handle.result()],
                           [c.token_ids for c in other.result()])
        assert engine.scheduler.kv.static_pool.num_used == 0
    branches, _ = results["static_rows"]
    assert len(branches) == 5 and branches[1][1] == "cancelled"
    assert results["static_rows"] == results["shared_prefix"]


def test_out_of_memory_in_a_static_step_preempts_a_request_that_then_decodes_the_same(tokenizer, monkeypatch):
    from rksc_engine.kvcache.memory import ForwardOutOfMemoryError

    model = make_family_model("llama3")
    engine = RKSCEngine(model, tokenizer, STATIC)
    real = engine.runner.decode_static
    calls = {"n": 0}

    def failing(pool):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ForwardOutOfMemoryError("injected: out of memory in a static step")
        return real(pool)

    monkeypatch.setattr(engine.runner, "decode_static", failing)
    params = SamplingParams(max_new_tokens=10)
    with engine.exclusive():
        handles = [engine.submit(p, 1, params) for p in MIXED_LENGTH_PROMPTS[:3]]
    got = [h.result()[0].token_ids for h in handles]
    assert engine.stats().extra.get("preemptions") == 1
    assert got == [engine_hf_greedy(engine, p, 10) for p in MIXED_LENGTH_PROMPTS[:3]]
    assert engine.scheduler.kv.static_pool.num_used == 0


def test_a_model_with_recurrent_layers_is_refused_static_rows_by_name(tokenizer):
    engine = RKSCEngine(make_family_model("lfm2"), tokenizer, STATIC)
    with pytest.raises(ValueError, match="static_rows"):
        engine.generate("hi", SamplingParams(max_new_tokens=2))
    assert engine.runner.decode_layout is not None


def test_decode_capture_is_validated_and_compile_implies_static_rows():
    assert EngineConfig(decode_capture="compile").decode_attention == "static_rows"
    with pytest.raises(ValueError, match="decode_capture"):
        EngineConfig(decode_capture="cuda")
    with pytest.raises(ValueError, match="static_rows"):
        EngineConfig(decode_capture="compile", decode_attention="shared_prefix")
    with pytest.raises(TypeError, match="decode_capture"):
        EngineConfig(decode_capture=None)


def test_the_runner_reports_the_layout_it_chose(tokenizer):
    engine = RKSCEngine(make_family_model("llama3"), tokenizer, STATIC)
    assert engine.runner.decode_layout() is DecodeLayout.STATIC_ROWS
    auto = RKSCEngine(make_family_model("llama3"), tokenizer)
    assert auto.runner.decode_layout() is DecodeLayout.SHARED_PREFIX


def test_a_finished_single_branch_answer_is_cached_from_its_static_row_for_the_next_turn(tokenizer):
    engine = RKSCEngine(make_family_model("llama3"), tokenizer, STATIC)
    params = SamplingParams(max_new_tokens=8)
    first = engine.generate(PROMPT, params)
    follow = PROMPT + tokenizer.decode(list(first.token_ids)) + " and then?"
    ids = engine.encode(PROMPT) + list(first.token_ids)[:-1]
    assert engine.cached_prefix_length(ids) == len(ids), "the prompt and the answer's fed tokens are cached"
    again = engine.generate(follow, params)
    assert again.token_ids == engine_hf_greedy(engine, follow, 8)


def test_static_step_operator_calls_per_step_do_not_grow_with_the_requests_and_stay_near_generate():
    """Counted per decode step through the engine: 16 independent requests cost what one request of
    16 siblings costs, and at most 1.25x ``transformers``' own step on the same rows."""
    from rksc_bench.families import char_tokenizer
    from rksc_bench.step_overhead import engine_run, generate_run, no_end_of_text, per_step, workload

    model = make_family_model("llama3")
    prompts = [f"Question {i}: a shelf holds {i + 3} boxes of {2 * i + 5} books. How many?" for i in range(16)]
    with no_end_of_text(model, char_tokenizer()) as quiet:
        engine = RKSCEngine(model, quiet, STATIC)
        counts = {layout: per_step(engine_run(engine, workload(layout, 16, prompts)), 3, 7, count_python=False)
                  for layout in ("siblings", "independent", "mix")}
        generate = per_step(generate_run(model, quiet, workload("independent", 16, prompts)), 3, 7,
                            count_python=False)
    siblings = counts["siblings"].operator_calls
    for layout, cost in counts.items():
        assert cost.operator_calls <= 1.2 * siblings, f"{layout}: {cost.operator_calls} against {siblings}"
        assert cost.operator_calls <= 1.25 * generate.operator_calls, (
            f"{layout}: {cost.operator_calls} against generate's {generate.operator_calls}")


def test_a_decode_steps_python_work_barely_grows_with_the_requests_and_stays_near_generate():
    """Python function calls per decode step (the host's work besides the operators): 16
    independent greedy requests cost at most 30 calls a request more than 2 do, and at most 1.1x
    ``transformers``' own step on the same 16 rows. Recording a token, its text, the finish checks
    and the stop checks once per row and request would cost about 100 calls a row."""
    from rksc_bench.families import char_tokenizer
    from rksc_bench.step_overhead import engine_run, generate_run, no_end_of_text, per_step, workload

    model = make_family_model("llama3")
    prompts = [f"Question {i}: a shelf holds {i + 3} boxes of {2 * i + 5} books. How many?" for i in range(16)]
    with no_end_of_text(model, char_tokenizer()) as quiet:
        engine = RKSCEngine(model, quiet, STATIC)
        calls = {rows: per_step(engine_run(engine, workload("independent", rows, prompts)), 3, 7).python_calls
                 for rows in (2, 16)}
        generate = per_step(generate_run(model, quiet, workload("independent", 16, prompts)), 3, 7).python_calls
    assert calls[16] - calls[2] <= 30 * 14, f"16 requests: {calls[16]:.0f} calls a step, 2: {calls[2]:.0f}"
    assert calls[16] <= 1.1 * generate, f"{calls[16]:.0f} calls a step against generate's {generate:.0f}"


@pytest.mark.parametrize("layout", ["static_rows", "shared_prefix"])
def test_an_unwatched_requests_text_is_decoded_once_when_its_branch_ends(tokenizer, layout):
    """A request nobody reads while it runs (no stream, stop string or monitor) gets the same tokens
    and text as a streamed one, its text decoded once per branch instead of at every step; a branch
    its caller stops mid-way still ends with the text of its tokens. On either decode layout."""
    model = make_family_model("llama3")
    engine = RKSCEngine(model, tokenizer, EngineConfig(decode_attention=layout))
    decoder = engine.scheduler.detokenizer
    real, decodes = decoder._decode, []
    decoder._decode = lambda ids: decodes.append(len(ids)) or real(ids)
    prompts = [PROMPT, *MIXED_LENGTH_PROMPTS[:3]]
    params = SamplingParams(max_new_tokens=12)
    with engine.exclusive():
        handles = [engine.submit(p, 1, params) for p in prompts]
    quiet = [h.result()[0] for h in handles]
    assert len(decodes) <= len(prompts), f"{len(decodes)} decodes for {len(prompts)} branches"
    for prompt, done in zip(prompts, quiet):
        assert done.token_ids == engine_hf_greedy(engine, prompt, 12)
        assert done.text == tokenizer.decode(list(done.token_ids), skip_special_tokens=True)
        streamed = "".join(chunk.text for chunk in engine.stream(prompt, params))
        assert streamed == done.text
    with engine.exclusive():
        handle = engine.submit(PROMPT, 3, SamplingParams(max_new_tokens=12))
        for _ in range(5):
            engine.scheduler.step()
        handle.cancel_branches([1])
    stopped = handle.result()
    assert stopped[1].finish_reason == "cancelled" and 0 < len(stopped[1].token_ids) < 12
    assert stopped[1].text == tokenizer.decode(list(stopped[1].token_ids), skip_special_tokens=True)
    assert stopped[0].text == quiet[0].text


@pytest.mark.parametrize("layout", ["static_rows", "shared_prefix"])
def test_sampled_requests_that_sample_alike_take_their_tokens_from_one_call_a_step(tokenizer, layout, monkeypatch):
    """Independent sampled requests with the same temperature and top-p choose their rows' tokens
    in one call a decode step, not one call a request, and each gets the tokens it gets alone."""
    from rksc_engine.runtime import sampling, scheduler

    model = make_family_model("llama3")
    params = [SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=s) for s in (1, 5, 9, 13)]
    prompts = [PROMPT, *MIXED_LENGTH_PROMPTS[:3]]
    alone = [RKSCEngine(model, tokenizer, EngineConfig(decode_attention=layout)).generate_branches(p, 2, q)
             for p, q in zip(prompts, params)]
    calls = []
    real = sampling.choose_next_tokens
    counting = lambda *args: calls.append(args[0].shape[0]) or real(*args)  # noqa: E731
    monkeypatch.setattr(sampling, "choose_next_tokens", counting)
    monkeypatch.setattr(scheduler, "choose_next_tokens", counting)
    engine = RKSCEngine(model, tokenizer, EngineConfig(decode_attention=layout))
    steps = 0
    with engine.exclusive():
        handles = [engine.submit(p, 2, q) for p, q in zip(prompts, params)]
        while not all(h.done() for h in handles):
            engine.scheduler.step()
            steps += 1
    got = [h.result() for h in handles]
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in a] for a in alone]
    # Each request's first tokens come from its own prompt's logits; every decode step then makes one
    # call for the 8 rows (before: one call per request, 4 a step).
    assert calls.count(8) >= 5 and len(calls) <= steps + len(prompts), f"{len(calls)} calls in {steps} steps"


@pytest.mark.slow
def test_a_compiled_static_step_decodes_as_the_eager_one_and_as_transformers(tokenizer):
    """``decode_capture="compile"``: greedy requests of different lengths, one of which finishes
    early (a new shape of rows), and seeded siblings, equal the eager static rows and ``transformers``."""
    model = make_family_model("llama3")
    compiled = RKSCEngine(model, tokenizer, EngineConfig(decode_capture="compile"))
    eager = RKSCEngine(model, tokenizer, STATIC)
    assert compiled.runner.weight_left_layers == 0
    work = [(p, 1, SamplingParams(max_new_tokens=t)) for p, t in zip(MIXED_LENGTH_PROMPTS[:3], (4, 10, 10))]
    work.append((PROMPT, 3, SamplingParams(max_new_tokens=10, temperature=0.9, seed=2)))
    got = {}
    for name, engine in (("compiled", compiled), ("eager", eager)):
        with engine.exclusive():
            handles = [engine.submit(p, n, params) for p, n, params in work]
        got[name] = [[c.token_ids for c in h.result()] for h in handles]
    assert got["compiled"] == got["eager"]
    for (prompt, _, params), tokens in zip(work[:3], got["compiled"][:3]):
        assert tokens[0] == engine_hf_greedy(compiled, prompt, params.max_new_tokens)
    assert compiled.runner.static_step.compiled and compiled.runner.static_step.num_steps > 0


@pytest.mark.slow
def test_compiled_steps_of_two_models_keep_their_graphs_apart():
    """Dynamo counts its graphs per code object and, past its recompile limit (8), runs a step
    eagerly without a word: two models' compiled steps must not share one code object's graphs, or
    a process that builds a few engines (a benchmark's families, a test session) loses the compiler."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    prompts = [torch.tensor([[5, 9, 3]]), torch.tensor([[4, 8, 2, 7, 6]])]

    def graphs(step: StaticStep) -> int:
        return len(_debug_get_cache_entry_list(step._run._torchdynamo_orig_callable.__func__.__code__))

    steps = {}
    for family in ("llama3", "qwen2.5"):
        model = make_family_model(family)
        config = model.config
        step = StaticStep(model, "cache", layer_types(config), None, compiled=True)
        pool = pool_with_prompts(model, prompts, 2)
        step.logits(pool, pool.next_tokens)
        steps[family] = step
    assert graphs(steps["llama3"]) == 1, "the second model's step added its graph to the first's"
    assert graphs(steps["qwen2.5"]) == 1
