"""Shared-prefix decoding: the split attention equals eager attention over the concatenated KV, the
engine's new path decodes the same tokens as the old DynamicCache path, and models the path does
not support fall back to the old one."""

import pytest
import torch
from conftest import AttentionModuleStub, batched_attention_step, make_char_tokenizer, make_tiny_model
from transformers.models.llama.modeling_llama import eager_attention_forward

from rksc_engine import EngineConfig, RKSCEngine, SamplingParams, SchedulerConfig
from rksc_engine.kvcache.probe import probe
from rksc_engine.kvcache.shared_prefix import (
    ATTENTION_NAME,
    SharedPrefixCache,
    attention_implementation,
    shared_prefix_attention,
)
from rksc_engine.runtime.model_runner import DecodeLayout


def _eager_over_concatenation(query, prefix_k, prefix_v, suffix_k, suffix_v, group):
    """Reference: transformers' eager attention over [prefix; suffix], causal among the new tokens."""
    batch, num_new = query.shape[0], query.shape[2]
    keys = torch.cat((prefix_k.expand(batch, -1, -1, -1), suffix_k), dim=2)
    values = torch.cat((prefix_v.expand(batch, -1, -1, -1), suffix_v), dim=2)
    total = keys.shape[2]
    mask = torch.zeros(num_new, total)
    for i in range(num_new):
        mask[i, total - num_new + i + 1:] = float("-inf")
    out, _ = eager_attention_forward(
        AttentionModuleStub(group), query, keys, values, mask[None, None], scaling=query.shape[-1] ** -0.5
    )
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("num_new", [1, 3])
@pytest.mark.parametrize("fused", [True, False])
def test_split_attention_equals_eager_attention_over_the_concatenated_kv(num_heads, num_kv_heads, num_new, fused):
    torch.manual_seed(num_heads * 10 + num_kv_heads + num_new)
    batch, prefix_len, suffix_len, head_dim = 5, 37, 6, 16
    prefix_k, prefix_v = torch.randn(2, 1, num_kv_heads, prefix_len, head_dim).unbind(0)
    suffix_k, suffix_v = torch.randn(2, batch, num_kv_heads, suffix_len, head_dim).unbind(0)
    query = torch.randn(batch, num_heads, num_new, head_dim)
    cache = SharedPrefixCache([(prefix_k, prefix_v)], batch, suffix_capacity=4, fused=fused)
    keys, values = cache.layers[0].update(suffix_k, suffix_v)
    group = num_heads // num_kv_heads
    got, _ = shared_prefix_attention(
        AttentionModuleStub(group), query, keys, values, None, scaling=head_dim**-0.5, **cache.forward_kwargs()
    )
    want = _eager_over_concatenation(query, prefix_k, prefix_v, suffix_k, suffix_v, group)
    assert got.shape == want.shape == (batch, num_new, num_heads, head_dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_the_suffix_is_written_in_place_and_survives_growing_past_its_capacity():
    prefix = torch.randn(1, 2, 5, 4)
    cache = SharedPrefixCache([(prefix, prefix.clone())], num_branches=3, suffix_capacity=2)
    layer = cache.layers[0]
    steps = [torch.randn(3, 2, 1, 4) for _ in range(5)]
    buffer = layer.keys
    layer.update(steps[0], steps[0])
    layer.update(steps[1], steps[1])
    assert layer.keys.data_ptr() == buffer.data_ptr(), "appends within capacity must not reallocate"
    for step in steps[2:]:
        keys, _ = layer.update(step, step)
    torch.testing.assert_close(keys, torch.cat(steps, dim=2), rtol=0, atol=0)
    assert cache.get_seq_length() == 5 + 5
    assert layer.keys.shape[2] >= 5


def test_dropping_finished_branches_keeps_the_survivors_suffixes_and_shares_the_prefix():
    prefix = torch.randn(1, 2, 5, 4)
    cache = SharedPrefixCache([(prefix, prefix.clone())], num_branches=4)
    suffix = torch.randn(4, 2, 3, 4)
    cache.layers[0].update(suffix, suffix)
    cache.batch_select_indices(torch.tensor([1, 3]))
    torch.testing.assert_close(cache.layers[0].keys[:, :, :3], suffix[[1, 3]], rtol=0, atol=0)
    assert cache.layers[0].prefix_keys is prefix, "the prefix must stay one shared tensor"
    stacked = cache.stacked_kv(1)  # (L, 2, H_kv, P + S, D) of the row that was branch 3
    torch.testing.assert_close(stacked[0, 0], torch.cat((prefix[0], suffix[3]), dim=1), rtol=0, atol=0)


def _engines(model_seed=0, **model_kwargs):
    model, tokenizer = make_tiny_model(model_seed, **model_kwargs), make_char_tokenizer()
    new = RKSCEngine(model, tokenizer, EngineConfig(decode_attention="shared_prefix"))
    old = RKSCEngine(model, tokenizer, EngineConfig(decode_attention="dynamic_cache"))
    return new, old


@pytest.mark.parametrize("model_seed", [0, 1, 2])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=30, temperature=0.9, seed=5),
        SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.9, seed=17),
        SamplingParams(max_new_tokens=30, temperature=0.8, top_k=12, seed=3, stop=("e", "q")),
        SamplingParams(max_new_tokens=20),
    ],
    ids=["temperature", "top_p", "top_k_with_stops", "greedy"],
)
def test_branches_through_the_shared_prefix_equal_the_dynamic_cache_path_token_for_token(model_seed, params):
    new, old = _engines(model_seed)
    prompt = "Shared few-shot context, long enough to matter. " * 3 + "Q: go?"
    got = new.generate_branches(prompt, 7, params)
    want = old.generate_branches(prompt, 7, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids, f"branch {g.branch_index} differs between the two decode paths"
        assert g.finish_reason == w.finish_reason and g.text == w.text
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-4)
    assert new.stats().decode_tokens == old.stats().decode_tokens


def test_a_generation_that_outgrows_the_preallocated_suffix_still_matches_the_dynamic_cache_path(monkeypatch):
    import rksc_engine.kvcache.shared_prefix as shared_prefix

    monkeypatch.setattr(shared_prefix, "MAX_INITIAL_SUFFIX_CAPACITY", 3)  # force several doublings
    new, old = _engines(1)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=2)
    got = new.generate_branches("grow", 3, params)
    want = old.generate_branches("grow", 3, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert max(len(g.token_ids) for g in got) > 12, "test setup: some branch must outgrow 3 -> 6 -> 12 tokens"


def test_the_models_attention_implementation_is_restored_after_decoding(tiny_model, tiny_tokenizer):
    before = tiny_model.config._attn_implementation
    engine = RKSCEngine(tiny_model, tiny_tokenizer)
    engine.generate_branches("abc", 3, SamplingParams(max_new_tokens=6, temperature=1.0, seed=0))
    assert engine.runner.shared_prefix_probe.supported
    assert tiny_model.config._attn_implementation == before
    with pytest.raises(RuntimeError):
        with attention_implementation(tiny_model, ATTENTION_NAME):
            raise RuntimeError("boom")
    assert tiny_model.config._attn_implementation == before


def _sliding_window_model():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=102, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, sliding_window=8, eos_token_id=1, pad_token_id=0,
        bos_token_id=None, tie_word_embeddings=False,
    )
    model = MistralForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model


def test_a_sliding_window_model_takes_the_shared_prefix_path_and_stays_exact(tiny_tokenizer):
    model = _sliding_window_model()
    engine = RKSCEngine(model, tiny_tokenizer)  # decode_attention="auto"
    prompt = "a prompt longer than the eight-token window"
    got = engine.generate(prompt, SamplingParams(max_new_tokens=16))
    assert engine.runner.shared_prefix_probe.supported
    ids = torch.tensor([tiny_tokenizer(prompt)["input_ids"]])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    assert got.token_ids == tuple(want[0, ids.shape[1]:].tolist())


def test_a_recurrent_model_falls_back_to_its_own_cache_and_stays_exact(tiny_tokenizer):
    from rksc_bench.families import make_family_model

    model = make_family_model("lfm2")
    engine = RKSCEngine(model, tiny_tokenizer)
    prompt = "a prompt for a model with convolution layers"
    got = engine.generate(prompt, SamplingParams(max_new_tokens=16))
    assert not engine.runner.shared_prefix_probe.supported
    assert "conv" in engine.runner.shared_prefix_probe.reason
    ids = torch.tensor([tiny_tokenizer(prompt)["input_ids"]])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    assert got.token_ids == tuple(want[0, ids.shape[1]:].tolist())


def test_a_model_whose_attention_ignores_the_registry_fails_the_probe(tiny_model):
    # The probe must notice when the attention function is never reached, whatever the reason.
    class IgnoresRegistry(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, cache, **kwargs):
            kwargs.pop("rksc_shared_prefix_cache", None)
            return self.inner(input_ids=input_ids, cache=cache, use_cache=True)

    wrapped = IgnoresRegistry(tiny_model)
    result = probe(wrapped, wrapped.forward)
    assert not result.supported
    assert "failed" in result.reason or "layers" in result.reason


def test_forcing_shared_prefix_on_an_unsupported_model_raises_and_leaves_the_engine_usable(tiny_tokenizer):
    from rksc_bench.families import make_family_model

    model = make_family_model("lfm2")
    engine = RKSCEngine(model, tiny_tokenizer, EngineConfig(decode_attention="shared_prefix"))
    with pytest.raises(ValueError, match="decode_attention"):
        engine.generate("hello there", SamplingParams(max_new_tokens=4))
    assert engine.stats().requests == 0 and engine.stats().prompt_tokens_computed == 0
    assert model.config._attn_implementation != ATTENTION_NAME
    plain = RKSCEngine(model, tiny_tokenizer, EngineConfig(decode_attention="dynamic_cache"))
    assert plain.generate("hello there", SamplingParams(max_new_tokens=4)).num_generated_tokens == 4


def test_an_unknown_decode_attention_mode_is_rejected_naming_the_field():
    with pytest.raises(ValueError, match="decode_attention must be one of"):
        EngineConfig(decode_attention="flash")
    with pytest.raises(TypeError, match="decode_attention"):
        EngineConfig(decode_attention=1)


def test_a_composite_models_per_sub_config_attention_implementations_are_restored():
    from transformers import LlavaConfig

    config = LlavaConfig()
    config._attn_implementation = {"": "sdpa", "text_config": "eager", "vision_config": "sdpa"}

    class Composite:
        pass

    Composite.config = config
    with attention_implementation(Composite, ATTENTION_NAME):
        assert config.text_config._attn_implementation == ATTENTION_NAME
    assert (config._attn_implementation, config.text_config._attn_implementation,
            config.vision_config._attn_implementation) == ("sdpa", "eager", "sdpa")


def test_a_prefill_cache_that_cannot_be_shared_decodes_through_the_plain_path(tiny_engine):
    from transformers import DynamicCache

    layers = [(torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16)) for _ in range(2)]  # batch 2: not a prefill
    cache = DynamicCache(ddp_cache_data=layers, config=tiny_engine.model.config)
    assert not SharedPrefixCache.can_share(cache)
    decode_cache = tiny_engine.scheduler.kv.decode_cache(cache, 1, 8, DecodeLayout.SHARED_PREFIX)
    assert decode_cache is cache


def _requests_for_batching(seed: int):
    """Three requests (1, 8 and 2 rows) over different prefix segments, suffixes of 5 tokens each,
    and the next token's queries and KV: tensors only, so each arm builds fresh caches from them."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim, group = 3, 64, 3

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    requests = []
    for rows, segment_lengths in ((1, (37,)), (8, (20, 30)), (2, (12,))):
        segments = [(randn(1, num_kv_heads, n, head_dim), randn(1, num_kv_heads, n, head_dim)) for n in segment_lengths]
        suffix = (randn(rows, num_kv_heads, 5, head_dim), randn(rows, num_kv_heads, 5, head_dim))
        new = (randn(rows, num_kv_heads, 1, head_dim), randn(rows, num_kv_heads, 1, head_dim))
        query = randn(rows, num_kv_heads * group, 1, head_dim)
        requests.append((rows, segments, suffix, new, query))
    return requests, group


@pytest.mark.parametrize("seed", range(4))
def test_each_requests_rows_are_bit_identical_alone_and_batched_with_other_requests(seed):
    requests, group = _requests_for_batching(seed)
    alone = [batched_attention_step([request], group) for request in requests]
    assert torch.equal(batched_attention_step(requests, group), torch.cat(alone))


@pytest.mark.parametrize("seed", range(6))
def test_a_branch_is_bit_identical_alone_and_among_its_siblings(seed, one_thread):
    """Row ``i`` of a request of 8 branches against the same branch decoded as a request of one:
    the prefix segments' merge and the suffix's merge must not depend on how many rows share them
    (PyTorch's elementwise kernels finish a tensor's tail with scalar code, see VECTOR_ALIGNMENT).
    The request's last segment (30 tokens) is copied into every branch's suffix."""
    (_, (rows, segments, suffix, new, query), _), group = _requests_for_batching(seed)
    together = batched_attention_step([(rows, segments, suffix, new, query)], group)
    for i in range(rows):
        one = (1, segments, tuple(t[i:i + 1] for t in suffix), tuple(t[i:i + 1] for t in new), query[i:i + 1])
        assert torch.equal(batched_attention_step([one], group), together[i:i + 1]), f"branch {i} changed among its siblings"


# -- a prompt's short last segment copied into every branch's suffix ------------------------------
def _two_segments(tail: int, num_kv_heads: int = 2, head_dim: int = 16):
    gen = torch.Generator().manual_seed(tail)
    return [(torch.randn(1, num_kv_heads, n, head_dim, generator=gen), torch.randn(1, num_kv_heads, n, head_dim,
                                                                                     generator=gen))
            for n in (24, tail)]


def test_a_short_last_segment_moves_into_every_branchs_suffix_and_stays_the_prompts():
    segments = _two_segments(5)
    cache = SharedPrefixCache.from_segments([segments], 3, suffix_capacity=2)
    layer = cache.layers[0]
    assert len(layer.segments) == 1 and layer.num_copied_prompt_tokens == 5
    assert layer.prompt_segments[1][0] is segments[1][0], "the fork must get the segment itself"
    assert [s[0] for s in cache.prompt_segments()[0]] == [s[0] for s in segments]
    assert layer.get_seq_length() == 29 and layer.num_prefix_tokens == 24
    for row in range(3):
        assert torch.equal(layer.keys[row, :, :5], segments[1][0][0])
    new = torch.randn(3, 2, 4, 16)
    layer.update(new, new)
    assert layer.get_seq_length() == 33
    assert cache.suffix_kv(1).shape[3] == 4, "the branch's own tokens only: the copied tail is the prompt's"
    assert torch.equal(cache.suffix_kv(1)[0, 0], new[1])
    assert torch.equal(cache.stacked_kv(2)[0, 0], torch.cat([segments[0][0][0], segments[1][0][0], new[2]], dim=1))
    with pytest.raises(ValueError, match="4-token suffix"):
        layer.crop(-5)
    layer.crop(-4)
    assert layer.get_seq_length() == 29
    layer.update(new, new)
    layer.reset()
    assert layer.num_suffix_tokens == 5


@pytest.mark.parametrize("tail,limit,copied", [(5, 4, 0), (5, 5, 5), (5, 0, 0)])
def test_only_a_tail_within_the_limit_is_copied(tail, limit, copied):
    cache = SharedPrefixCache.from_segments([_two_segments(tail)], 2, max_copied_tail=limit)
    assert cache.layers[0].num_copied_prompt_tokens == copied
    assert len(cache.layers[0].prompt_segments) == 2


@pytest.mark.parametrize("limit,copied", [(8, 0), (9, 9), (13, 9), (14, 14), (100, 14)])
def test_the_last_segments_within_the_limit_are_copied_and_the_first_stays(limit, copied):
    """A prompt read as [24, 5, 9]: a short node a few prompts share (5) and the prompt's own tokens
    (9) are copied together when they fit, else the own tokens alone."""
    gen = torch.Generator().manual_seed(1)
    segments = [(torch.randn(1, 2, n, 16, generator=gen), torch.randn(1, 2, n, 16, generator=gen)) for n in (24, 5, 9)]
    cache = SharedPrefixCache.from_segments([segments], 2, suffix_capacity=2, max_copied_tail=limit)
    layer = cache.layers[0]
    assert layer.num_copied_prompt_tokens == copied
    assert [k.shape[2] for k, _ in layer.segments] == [24, 5, 9][:3 - {0: 0, 9: 1, 14: 2}[copied]]
    assert [k for k, _ in layer.prompt_segments] == [k for k, _ in segments], "the fork must get the segments themselves"
    assert torch.equal(cache.stacked_kv(1)[0, 0], torch.cat([k[0] for k, _ in segments], dim=1))
    query = torch.randn(2, 4, 1, 16, generator=gen)
    new_k, new_v = torch.randn(2, 2, 1, 16, generator=gen), torch.randn(2, 2, 1, 16, generator=gen)
    keys, values = layer.update(new_k, new_v)
    got, _ = shared_prefix_attention(AttentionModuleStub(2), query, keys, values, None, **cache.forward_kwargs())
    prefix_k = torch.cat([k for k, _ in segments], dim=2)
    prefix_v = torch.cat([v for _, v in segments], dim=2)
    want = _eager_over_concatenation(query, prefix_k, prefix_v, new_k, new_v, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    layer.reset()
    assert layer.num_suffix_tokens == copied


def test_a_single_segment_is_never_copied_and_a_negative_limit_is_refused():
    one = _two_segments(5)[:1]
    assert SharedPrefixCache.from_segments([one], 2).layers[0].num_copied_prompt_tokens == 0
    with pytest.raises(ValueError, match="max_copied_tail"):
        SharedPrefixCache.from_segments([one], 2, max_copied_tail=-1)


@pytest.mark.parametrize("num_new", [1, 3])
def test_attention_with_a_copied_tail_equals_eager_attention_over_the_whole_sequence(num_new):
    segments = _two_segments(7)
    query = torch.randn(4, 4, num_new, 16)
    new_k, new_v = torch.randn(4, 2, num_new, 16), torch.randn(4, 2, num_new, 16)
    cache = SharedPrefixCache.from_segments([segments], 4, suffix_capacity=4)
    assert cache.layers[0].num_copied_prompt_tokens == 7
    keys, values = cache.layers[0].update(new_k, new_v)
    got, _ = shared_prefix_attention(AttentionModuleStub(2), query, keys, values, None, **cache.forward_kwargs())
    prefix_k = torch.cat([k for k, _ in segments], dim=2)
    prefix_v = torch.cat([v for _, v in segments], dim=2)
    want = _eager_over_concatenation(query, prefix_k, prefix_v, new_k, new_v, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _count_tail_copies(monkeypatch) -> list[int]:
    from rksc_engine.kvcache.shared_prefix import SharedPrefixLayer

    copies: list[int] = []
    original = SharedPrefixLayer.copy_prompt_tail

    def counting(layer, num_segments=1):
        original(layer, num_segments)
        copies.append(layer.num_copied_prompt_tokens)

    monkeypatch.setattr(SharedPrefixLayer, "copy_prompt_tail", counting)
    return copies


def test_a_request_whose_own_tail_is_copied_equals_a_cold_one_in_every_wave(monkeypatch):
    from tests.unit.runtime.test_branch_monitor import Waves

    shared = "System: you are terse.\nContext: " + "abc def " * 10
    prompt = shared + "Question two?"
    params = SamplingParams(temperature=0.9, max_new_tokens=16, seed=5)
    cold = RKSCEngine(make_tiny_model(0), make_char_tokenizer()).generate_branches(prompt, 5, params)
    copies = _count_tail_copies(monkeypatch)
    warm = RKSCEngine(make_tiny_model(0), make_char_tokenizer())
    warm.generate(shared + "Question one?", SamplingParams(max_new_tokens=4))
    assert not copies, "a cold prompt is one segment: nothing to copy"
    waved = warm.submit(prompt, 1, params, monitor=Waves(first=1, wave=2, total=5), max_branches=5).result(timeout=120)
    # Its own node ("two?", after the cached "...Question "), in both layers, for the first wave and the two added.
    assert copies == [len("two?")] * 2 * 3, "the warm prompt's own node should be copied for every wave"
    assert [c.token_ids for c in waved] == [c.token_ids for c in cold]
    assert warm.stats().running_kv_bytes == 0
    warm.prefix_cache.check_consistency()


def test_a_completion_after_a_copied_tail_is_cached_as_the_branchs_own_tokens(monkeypatch):
    engine = RKSCEngine(make_tiny_model(0), make_char_tokenizer())
    engine.generate("user: plan the step\n", SamplingParams(max_new_tokens=2))
    copies = _count_tail_copies(monkeypatch)
    first_prompt = engine.encode("user: plan the step\nassistant:")
    first = engine.generate(first_prompt, SamplingParams(max_new_tokens=12))
    assert copies, "the second prompt's own tail should be copied"
    next_prompt = first_prompt + list(first.token_ids) + engine.encode("\nuser: go on\nassistant:")
    served = engine.generate(next_prompt, SamplingParams(max_new_tokens=12))
    assert served.num_cached_tokens == len(first_prompt) + len(first.token_ids) - 1
    cold = RKSCEngine(make_tiny_model(0), make_char_tokenizer()).generate(next_prompt, SamplingParams(max_new_tokens=12))
    assert served.token_ids == cold.token_ids


@pytest.mark.parametrize("value,error", [(-1, ValueError), ("256", TypeError), (True, TypeError)])
def test_the_copied_tail_limit_is_a_non_negative_int(value, error):
    with pytest.raises(error, match="scheduler.max_copied_prompt_tail"):
        SchedulerConfig(max_copied_prompt_tail=value)


def test_a_zero_limit_leaves_every_prompt_segment_in_place(monkeypatch):
    copies = _count_tail_copies(monkeypatch)
    config = EngineConfig(scheduler=SchedulerConfig(max_copied_prompt_tail=0))
    engine = RKSCEngine(make_tiny_model(0), make_char_tokenizer(), config)
    engine.generate("a shared prefix, then one", SamplingParams(max_new_tokens=3))
    engine.generate("a shared prefix, then two", SamplingParams(max_new_tokens=3))
    assert engine.stats().prompt_tokens_reused > 0 and not copies


def test_consecutive_requests_over_the_same_segments_read_them_as_one_run_with_the_same_bits():
    from rksc_engine.kvcache.split_attention import same_segment_runs

    gen = torch.Generator().manual_seed(3)
    num_kv_heads, head_dim, group = 3, 64, 3

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    shared = [(randn(1, num_kv_heads, 20, head_dim), randn(1, num_kv_heads, 20, head_dim))]
    other = [(randn(1, num_kv_heads, 9, head_dim), randn(1, num_kv_heads, 9, head_dim))]
    requests = []
    for rows, segments in ((2, shared), (1, shared), (3, other), (1, shared)):
        suffix = (randn(rows, num_kv_heads, 4, head_dim), randn(rows, num_kv_heads, 4, head_dim))
        new = (randn(rows, num_kv_heads, 1, head_dim), randn(rows, num_kv_heads, 1, head_dim))
        requests.append((rows, list(segments), suffix, new, randn(rows, num_kv_heads * group, 1, head_dim)))
    assert same_segment_runs([r[1] for r in requests]) == [(0, 2), (2, 3), (3, 4)]
    alone = [batched_attention_step([request], group) for request in requests]
    assert torch.equal(batched_attention_step(requests, group), torch.cat(alone))
    assert same_segment_runs([shared, [(shared[0][0][:, :, :5], shared[0][1][:, :, :5])]]) == [(0, 1), (1, 2)]
