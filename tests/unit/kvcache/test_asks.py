"""ASKS on tiny seeded models: alignment, similarity, rotary re-rotation, the engine's reuse and
fallback paths, and what reaches the token-exact prefix cache."""

import pytest
import torch
from conftest import make_char_tokenizer, make_tiny_model

from rksc_engine import ASKSConfig, EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.kvcache.asks import (
    align_after_prefix,
    candidate_sequences,
    kv_deviation,
    layer_weights,
    recompute_positions,
    rerotate_keys,
    rotary_embedding_of,
    run_first_layers,
    span_similarity,
)
from rksc_engine.kvcache.radix import RadixPrefixCache

BODY = " and the same long shared body of text follows here, unchanged, for many tokens." * 2
CACHED = "Hi Ann." + BODY + " Q1?"
REQUEST = "Hello, Bob!" + BODY + " Q1?"  # a span of different length before the same body


def hf_greedy(model, tokenizer, prompt, max_new_tokens):
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return tuple(out[0, ids.shape[1]:].tolist())


def asks_engine(model, tokenizer, **asks):
    return RKSCEngine(model, tokenizer, EngineConfig(asks=ASKSConfig(enabled=True, **asks)))


class PositionCounter:
    """Counts token positions run through the first decoder layer."""

    def __init__(self, model):
        self.positions = 0
        self.handle = model.model.layers[0].register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        self.positions += hidden.shape[1]

    def remove(self):
        self.handle.remove()


# -- alignment ------------------------------------------------------------------------------------
def test_alignment_finds_spans_of_different_length_and_the_shared_remainder():
    request = [1, 2, 3, 50, 51, 52] + list(range(10, 30)) + [99]
    cached = [1, 2, 3, 60] + list(range(10, 30)) + [98, 97]
    found = align_after_prefix(request, cached, max_span_tokens=8, min_reuse_tokens=4)
    assert found is not None
    assert (found.prefix_tokens, found.request_span_tokens, found.cached_span_tokens) == (3, 3, 1)
    assert found.remainder_tokens == 20
    assert found.position_shift == 2


def test_alignment_never_covers_the_request_last_token():
    request = [1, 9] + list(range(10, 20))
    cached = [1, 8] + list(range(10, 20)) + [5]
    found = align_after_prefix(request, cached, max_span_tokens=4, min_reuse_tokens=3)
    assert found.remainder_tokens == 9, "the last prompt token must stay computed for its logits"


def test_alignment_gives_up_when_the_remainder_is_too_short_or_the_span_too_long():
    request = [1, 2, 3, 4, 5, 6, 7, 8, 0]
    cached = [1, 9, 9, 9, 9, 9, 5, 6, 7, 8]
    assert align_after_prefix(request, cached, max_span_tokens=8, min_reuse_tokens=5) is None
    assert align_after_prefix(request, cached, max_span_tokens=3, min_reuse_tokens=2) is None
    assert align_after_prefix(request, cached, max_span_tokens=8, min_reuse_tokens=3) is not None


def test_candidate_sequences_are_cached_paths_that_branch_off_the_request():
    cache = RadixPrefixCache(1 << 20)
    kv = lambda n: torch.zeros(1, 2, 1, n, 2)  # noqa: E731
    cache.insert([1, 2, 3, 4, 5], kv(5))
    cache.insert([1, 2, 7, 8], kv(4))
    cache.insert([1, 2, 3, 9], kv(4))
    found = candidate_sequences(cache, [1, 2, 3, 4, 6], max_candidates=8)
    assert found[0] == (1, 2, 3, 4, 5), "the deepest branch point comes first"
    assert set(found) == {(1, 2, 3, 4, 5), (1, 2, 3, 9), (1, 2, 7, 8)}
    assert len(candidate_sequences(cache, [1, 2, 3, 4, 6], max_candidates=1)) == 1


# -- similarity and rotation ----------------------------------------------------------------------
def test_layer_weights_grow_with_depth_and_alpha_zero_weighs_layers_equally():
    weights = layer_weights(4, alpha=2.0)
    assert torch.all(weights[1:] > weights[:-1])
    assert torch.allclose(layer_weights(4, 0.0), torch.ones(4, dtype=torch.float64))


def test_span_similarity_is_one_for_the_same_span_and_lower_for_a_different_one():
    torch.manual_seed(0)
    hidden = [torch.randn(1, 5, 16) for _ in range(3)]
    other = [torch.randn(1, 3, 16) for _ in range(3)]
    assert span_similarity(hidden, hidden, alpha=1.0) == pytest.approx(1.0)
    assert span_similarity(hidden, other, alpha=1.0) < 0.9
    # alpha moves the weight towards the layer that agrees.
    mixed = [other[0], other[1], hidden[2]]
    assert span_similarity(hidden, mixed, alpha=8.0) > span_similarity(hidden, mixed, alpha=0.0)


@pytest.mark.parametrize("shift", [3, -2, 17])
def test_rerotated_keys_equal_keys_computed_at_the_shifted_positions(shift):
    model = make_tiny_model(0)
    attn, rotary = model.model.layers[0].self_attn, rotary_embedding_of(model)
    torch.manual_seed(1)
    hidden = torch.randn(1, 6, model.config.hidden_size)
    raw = attn.k_proj(hidden).view(1, 6, -1, attn.head_dim).transpose(1, 2)  # (1, H_kv, 6, D)

    def keys_at(start):
        cos, sin = rotary(hidden, torch.arange(start, start + 6)[None])
        cos, sin = cos[:, None], sin[:, None]
        half = raw.shape[-1] // 2
        return raw * cos + torch.cat((-raw[..., half:], raw[..., :half]), dim=-1) * sin

    with torch.no_grad():
        moved = rerotate_keys(keys_at(20), shift, rotary)
        assert torch.allclose(moved, keys_at(20 + shift), atol=1e-5), "re-rotation must equal recomputed keys"
        assert not torch.allclose(keys_at(20), keys_at(20 + shift), atol=1e-3)


# -- the engine -------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_tau_one_and_disabled_asks_are_token_identical_to_transformers(model_seed, tiny_tokenizer):
    model = make_tiny_model(model_seed)
    params = SamplingParams(max_new_tokens=16)
    for engine in (asks_engine(model, tiny_tokenizer, tau=1.0), RKSCEngine(model, tiny_tokenizer)):
        for prompt in (CACHED, REQUEST, "Hey Cy" + BODY + " Q2?"):
            got = engine.generate(prompt, params)
            assert got.token_ids == hf_greedy(model, tiny_tokenizer, prompt, 16), f"differs for {prompt[:12]!r}"
            assert got.asks is None, "ASKS must not act at tau = 1"
        assert engine.stats().asks_checks == 0


def test_forced_reuse_skips_the_remainder_and_shifts_positions_exactly():
    # One decoder layer: a remainder token's KV depends only on its token and position, so reused KV
    # re-rotated to the new positions is exact and greedy output must equal full recompute.
    model, tokenizer = make_tiny_model(4, num_layers=1), make_char_tokenizer()
    engine = asks_engine(model, tokenizer, tau=0.0, min_reuse_tokens=16)
    engine.generate(CACHED, SamplingParams(max_new_tokens=4))
    counter = PositionCounter(model)
    try:
        got = engine.generate(REQUEST, SamplingParams(max_new_tokens=20))
    finally:
        counter.remove()
    decision = got.asks
    assert decision is not None and decision.reused
    assert decision.position_shift == decision.request_span_tokens - decision.cached_span_tokens != 0
    remainder = decision.remainder_tokens
    assert remainder == len(BODY) + 3, "the whole shared body and the question but its last token are reused"
    prompt_len = len(tokenizer(REQUEST)["input_ids"])
    computed = prompt_len - decision.prefix_tokens - remainder
    # Prefill positions: the cached span (check) + the request's span + its tail; decode one per new token.
    assert counter.positions == decision.check_tokens + computed + len(got.token_ids) - 1
    stats = engine.stats()
    assert stats.asks_reuses == 1 and stats.asks_reused_tokens == remainder
    assert got.num_cached_tokens == decision.prefix_tokens + remainder
    assert got.token_ids == hf_greedy(model, tokenizer, REQUEST, 20), "shifted reuse must match full recompute"
    exact = RKSCEngine(model, tokenizer).generate(REQUEST, SamplingParams(max_new_tokens=20))
    assert got.logprobs == pytest.approx(exact.logprobs, abs=1e-4), "and so must the token log-probabilities"


def test_reuse_without_the_position_shift_would_change_the_output(monkeypatch):
    # The same one-layer setup, with re-rotation disabled: the output must differ, so the previous
    # test really checks the shift.
    import rksc_engine.kvcache.asks as asks_module

    model, tokenizer = make_tiny_model(4, num_layers=1), make_char_tokenizer()
    monkeypatch.setattr(asks_module, "rerotate_keys", lambda keys, shift, rotary: keys)
    engine = asks_engine(model, tokenizer, tau=0.0, min_reuse_tokens=16)
    engine.generate(CACHED, SamplingParams(max_new_tokens=4))
    got = engine.generate(REQUEST, SamplingParams(max_new_tokens=20))
    assert got.asks.reused and got.asks.position_shift != 0
    exact = RKSCEngine(model, tokenizer).generate(REQUEST, SamplingParams(max_new_tokens=20))
    gap = max(abs(x - y) for x, y in zip(got.logprobs, exact.logprobs))
    assert gap > 1e-3, f"unshifted keys should change the log-probabilities, max gap {gap:.2e}"


def test_below_threshold_falls_back_and_matches_full_recompute(tiny_model, tiny_tokenizer):
    engine = asks_engine(tiny_model, tiny_tokenizer, tau=0.999999, min_reuse_tokens=16)
    engine.generate(CACHED, SamplingParams(max_new_tokens=4))
    got = engine.generate(REQUEST, SamplingParams(max_new_tokens=24))
    assert got.asks is not None and not got.asks.reused and got.asks.sigma < 0.999999
    assert got.asks.reused_tokens == 0 and got.asks.recomputed_tokens == got.asks.remainder_tokens
    assert got.token_ids == hf_greedy(tiny_model, tiny_tokenizer, REQUEST, 24)
    stats = engine.stats()
    assert stats.asks_checks == 1 and stats.asks_reuses == 0 and stats.asks_reused_tokens == 0


def test_approximate_kv_never_reaches_the_exact_cache(tiny_tokenizer):
    model = make_tiny_model(2)
    engine = asks_engine(model, tiny_tokenizer, tau=0.0, min_reuse_tokens=16)
    engine.generate(CACHED, SamplingParams(max_new_tokens=4))
    reused = engine.generate(REQUEST, SamplingParams(max_new_tokens=12))
    assert reused.asks.reused
    # Only the shared prefix and the request's own span were cached for the request.
    exact_part = reused.asks.prefix_tokens + reused.asks.request_span_tokens
    request_ids = tiny_tokenizer(REQUEST)["input_ids"]
    assert engine.prefix_cache.match_prefix(request_ids).num_tokens == exact_part
    # A later request that extends the earlier one token for token is exact (ASKS off for it).
    later = REQUEST + tiny_tokenizer.decode(reused.token_ids) + " more"
    exact_engine = RKSCEngine(model, tiny_tokenizer, engine.config.__class__())
    engine.config = EngineConfig(asks=ASKSConfig(enabled=False))
    got = engine.generate(later, SamplingParams(max_new_tokens=16))
    assert got.token_ids == hf_greedy(model, tiny_tokenizer, later, 16)
    assert got.token_ids == exact_engine.generate(later, SamplingParams(max_new_tokens=16)).token_ids


def test_full_recompute_fraction_is_exact_and_reuses_nothing(tiny_model, tiny_tokenizer):
    engine = asks_engine(tiny_model, tiny_tokenizer, tau=0.0, min_reuse_tokens=16, recompute_fraction=1.0)
    engine.generate(CACHED, SamplingParams(max_new_tokens=4))
    got = engine.generate(REQUEST, SamplingParams(max_new_tokens=20))
    assert not got.asks.reused and got.asks.recomputed_tokens == got.asks.remainder_tokens
    assert got.token_ids == hf_greedy(tiny_model, tiny_tokenizer, REQUEST, 20)
    request_ids = tiny_tokenizer(REQUEST)["input_ids"]
    assert engine.prefix_cache.match_prefix(request_ids).num_tokens == len(request_ids), "exact KV is cached"


def test_partial_recompute_counts_recomputed_and_reused_tokens(tiny_model, tiny_tokenizer):
    engine = asks_engine(tiny_model, tiny_tokenizer, tau=0.0, min_reuse_tokens=16, recompute_fraction=0.25)
    engine.generate(CACHED, SamplingParams(max_new_tokens=4))
    decision = engine.generate(REQUEST, SamplingParams(max_new_tokens=4)).asks
    assert decision.reused
    assert decision.recomputed_tokens == round(0.25 * decision.remainder_tokens)
    assert decision.reused_tokens + decision.recomputed_tokens == decision.remainder_tokens


def test_a_prompt_the_cache_holds_exactly_keeps_its_exact_kv(tiny_model, tiny_tokenizer):
    engine = asks_engine(tiny_model, tiny_tokenizer, tau=0.0, min_reuse_tokens=16)
    engine.generate(CACHED, SamplingParams(max_new_tokens=4))
    engine.generate("Hey Cy" + BODY + " Q1?", SamplingParams(max_new_tokens=4))  # another cached branch
    before = engine.stats()
    again = engine.generate(CACHED, SamplingParams(max_new_tokens=8))
    assert again.asks is None, "token-exact reuse beats any approximate one here"
    assert engine.stats().prompt_tokens_computed - before.prompt_tokens_computed == 1
    assert again.token_ids == hf_greedy(tiny_model, tiny_tokenizer, CACHED, 8)


def test_unrelated_prompts_after_a_shared_prefix_do_not_trigger_asks(tiny_model, tiny_tokenizer):
    engine = asks_engine(tiny_model, tiny_tokenizer, tau=0.0, min_reuse_tokens=16)
    engine.generate(BODY + "first question, quite different?", SamplingParams(max_new_tokens=4))
    got = engine.generate(BODY + "a second, unrelated one!", SamplingParams(max_new_tokens=8))
    assert got.asks is None
    assert got.token_ids == hf_greedy(tiny_model, tiny_tokenizer, BODY + "a second, unrelated one!", 8)


# -- config -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"tau": 1.5}, ValueError, r"asks\.tau must be in \[0, 1\]"),
        ({"tau": -0.1}, ValueError, r"asks\.tau must be in \[0, 1\]"),
        ({"alpha": -1.0}, ValueError, r"asks\.alpha must be finite and >= 0"),
        ({"max_span_tokens": 0}, ValueError, r"asks\.max_span_tokens must be >= 1"),
        ({"min_reuse_tokens": 0}, ValueError, r"asks\.min_reuse_tokens must be >= 1"),
        ({"recompute_fraction": 2}, ValueError, r"asks\.recompute_fraction must be in \[0, 1\]"),
        ({"recompute_selection": "random"}, ValueError, r"asks\.recompute_selection must be one of"),
        ({"max_mean_deviation": -1.0}, ValueError, r"asks\.max_mean_deviation must be >= 0"),
        ({"max_mean_deviation": 0.1, "recompute_selection": "nearest"}, ValueError, r"needs asks\.recompute_selection"),
        ({"enabled": 1}, TypeError, r"asks\.enabled must be bool"),
        ({"max_span_tokens": 4.0}, TypeError, r"asks\.max_span_tokens must be int"),
    ],
)
def test_bad_asks_config_is_rejected_with_the_field_and_range(kwargs, error, message):
    with pytest.raises(error, match=message):
        ASKSConfig(**kwargs)


def test_asks_is_off_by_default_so_the_default_engine_stays_token_exact():
    assert EngineConfig().asks.enabled is False
    assert 0 < ASKSConfig().tau < 1


def test_engine_config_rejects_a_non_asks_config():
    with pytest.raises(TypeError, match="asks must be ASKSConfig"):
        EngineConfig(asks={"tau": 0.5})


# -- deviation probe and selective recompute (CacheBlend-style repair) ------------------------------
def _prefilled_cache(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache


def _forward(model):
    return lambda input_ids, cache, **kw: model(input_ids=input_ids, past_key_values=cache, use_cache=True, **kw)


def test_recompute_positions_restores_exact_kv_at_scattered_positions():
    model = make_tiny_model(3, num_layers=4)
    ids = [(7 * i) % 90 + 5 for i in range(40)]
    exact = _prefilled_cache(model, ids)
    damaged = _prefilled_cache(model, ids)
    positions = torch.tensor([3, 10, 11, 25, 39])
    generator = torch.Generator().manual_seed(0)
    for layer in damaged.layers[1:]:  # layer 0's KV never depends on context; damage the rest
        layer.keys[:, :, positions] += torch.randn(layer.keys[:, :, positions].shape, generator=generator)
        layer.values[:, :, positions] += torch.randn(layer.values[:, :, positions].shape, generator=generator)
    with torch.no_grad():
        recompute_positions(_forward(model), model, ids, positions, damaged)
    assert damaged.get_seq_length() == len(ids)
    for got, want in zip(damaged.layers, exact.layers):
        assert torch.allclose(got.keys, want.keys, atol=1e-5) and torch.allclose(got.values, want.values, atol=1e-5)


def test_recompute_positions_only_fixes_the_positions_it_is_given():
    # Damage two positions, repair one: the other stays damaged, and so do the later positions
    # whose recomputation attends to it (the mask really hides nothing it should show).
    model = make_tiny_model(3, num_layers=4)
    ids = [(5 * i) % 90 + 5 for i in range(30)]
    exact = _prefilled_cache(model, ids)
    damaged = _prefilled_cache(model, ids)
    for layer in damaged.layers[1:]:
        layer.values[:, :, [4, 20]] += 1.0
    with torch.no_grad():
        recompute_positions(_forward(model), model, ids, torch.tensor([20]), damaged)
    last = damaged.layers[-1]
    assert not torch.allclose(last.values[:, :, 4], exact.layers[-1].values[:, :, 4], atol=1e-3)
    assert not torch.allclose(last.values[:, :, 20], exact.layers[-1].values[:, :, 20], atol=1e-5), \
        "position 20 was recomputed over the still-damaged position 4, so it cannot be exact"
    with torch.no_grad():
        recompute_positions(_forward(model), model, ids, torch.tensor([4, 20]), damaged)
    assert torch.allclose(damaged.layers[-1].values, exact.layers[-1].values, atol=1e-5)


def test_run_first_layers_fills_only_the_first_layers_with_exact_kv():
    from transformers import DynamicCache

    model = make_tiny_model(3, num_layers=4)
    ids = [(3 * i) % 90 + 5 for i in range(24)]
    exact = _prefilled_cache(model, ids)
    cache = DynamicCache(ddp_cache_data=[(layer.keys[:, :, :10].clone(), layer.values[:, :, :10].clone())
                                          for layer in exact.layers], config=model.config)
    with torch.no_grad():
        run_first_layers(_forward(model), model, ids[10:], cache, last_layer=1)
    assert [layer.get_seq_length() for layer in cache.layers] == [24, 24, 10, 10]
    for got, want in zip(cache.layers[:2], exact.layers[:2]):
        assert torch.allclose(got.keys, want.keys, atol=1e-5) and torch.allclose(got.values, want.values, atol=1e-5)


def test_kv_deviation_is_relative_and_per_token():
    keys, values = torch.ones(2, 3, 4), torch.ones(2, 3, 4)
    moved_keys = keys.clone()
    moved_keys[:, 1] *= 2.0  # token 1's keys double: ||diff|| = ||k||, against ||(k, v)|| = sqrt(2) ||k||
    deviation = kv_deviation(keys, values, moved_keys, values)
    assert deviation.shape == (3,)
    assert deviation[0] == 0 and deviation[2] == 0
    assert deviation[1].item() == pytest.approx(2 ** -0.5)


def _gap_to_exact(model, tokenizer, **asks):
    engine = asks_engine(model, tokenizer, tau=0.0, min_reuse_tokens=16, **asks)
    engine.generate(CACHED, SamplingParams(max_new_tokens=4))
    got = engine.generate(REQUEST, SamplingParams(max_new_tokens=12))
    exact = RKSCEngine(model, tokenizer).generate(REQUEST, SamplingParams(max_new_tokens=12))
    return got, max(abs(x - y) for x, y in zip(got.logprobs, exact.logprobs))


@pytest.mark.slow
def test_deviation_probe_is_recorded_and_repair_brings_reuse_close_to_exact(tiny_tokenizer):
    model = make_tiny_model(0, num_layers=6)
    plain, plain_gap = _gap_to_exact(model, tiny_tokenizer)
    decision = plain.asks
    assert decision.reused and decision.probe_tokens == decision.remainder_tokens
    assert 0 < decision.mean_deviation <= decision.max_deviation
    assert plain_gap > 1e-2, "a six-layer random model should show that reused KV is approximate"
    repaired, repaired_gap = _gap_to_exact(model, tiny_tokenizer, recompute_fraction=0.95)
    assert repaired.asks.reused and repaired.asks.recomputed_tokens == round(0.95 * decision.remainder_tokens)
    assert repaired_gap < plain_gap / 10, f"recomputing 95% should nearly close the gap ({repaired_gap:.2e})"
    stats_engine = asks_engine(model, tiny_tokenizer, tau=0.0, min_reuse_tokens=16)
    assert stats_engine.config.asks.recompute_selection == "deviation"


def test_deviation_gate_falls_back_to_the_exact_output(tiny_tokenizer):
    model = make_tiny_model(0, num_layers=6)
    engine = asks_engine(model, tiny_tokenizer, tau=0.0, min_reuse_tokens=16, max_mean_deviation=1e-9)
    engine.generate(CACHED, SamplingParams(max_new_tokens=4))
    got = engine.generate(REQUEST, SamplingParams(max_new_tokens=16))
    assert got.asks is not None and not got.asks.reused
    assert got.asks.mean_deviation > 1e-9 and got.asks.probe_tokens == got.asks.remainder_tokens
    assert got.token_ids == hf_greedy(model, tiny_tokenizer, REQUEST, 16)
    request_ids = tiny_tokenizer(REQUEST)["input_ids"]
    assert engine.prefix_cache.match_prefix(request_ids).num_tokens == len(request_ids), "exact KV is cached"
    # A loose gate lets the same request reuse.
    loose = asks_engine(model, tiny_tokenizer, tau=0.0, min_reuse_tokens=16, max_mean_deviation=10.0)
    loose.generate(CACHED, SamplingParams(max_new_tokens=4))
    assert loose.generate(REQUEST, SamplingParams(max_new_tokens=4)).asks.reused


def test_asks_reuses_nothing_over_kv_freed_out_of_a_sliding_window(monkeypatch):
    from rksc_engine.kvcache.radix import PrefixMatch

    model, tokenizer = make_tiny_model(4, num_layers=1), make_char_tokenizer()
    engine = asks_engine(model, tokenizer, tau=0.0, min_reuse_tokens=16)
    engine.generate(CACHED, SamplingParams(max_new_tokens=4))
    # The request's span is computed at the shared prefix's end, whose window may reach freed KV.
    monkeypatch.setattr(PrefixMatch, "window_freed", property(lambda match: bool(match.segments)))
    got = engine.generate(REQUEST, SamplingParams(max_new_tokens=20))
    assert got.asks is None and engine.stats().asks_reuses == 0
    assert got.token_ids == hf_greedy(model, tokenizer, REQUEST, 20)
