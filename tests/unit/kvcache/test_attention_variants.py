"""Sliding windows, soft-capping and attention sinks in the shared-prefix and batched attention: the
split attention equals the model's own eager attention over the concatenated KV with the
variant's mask, cap and sinks, and a request's rows keep their bits alone and batched."""

import pytest
import torch
from conftest import AttentionModuleStub, batched_attention_step
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

from rksc_engine.kvcache.shared_prefix import SharedPrefixCache, shared_prefix_attention


def _reference(query, segments, suffix_k, suffix_v, window, softcap, sinks, group):
    """Eager attention over [segments; suffix] with transformers' sliding-window rule (a key is
    visible when ``key_position > query_position - window``), soft-capping as Gemma 2's eager
    attention applies it, and sinks as gpt-oss's eager attention adds them."""
    batch, num_heads, num_new, head_dim = query.shape
    keys = torch.cat([k.expand(batch, -1, -1, -1) for k, _ in segments] + [suffix_k], dim=2)
    values = torch.cat([v.expand(batch, -1, -1, -1) for _, v in segments] + [suffix_v], dim=2)
    total = keys.shape[2]
    query_positions = torch.arange(total - num_new, total)[:, None]
    key_positions = torch.arange(total)[None, :]
    visible = key_positions <= query_positions
    if window is not None:
        visible &= key_positions > query_positions - window
    mask = torch.zeros(num_new, total).masked_fill(~visible, float("-inf"))[None, None]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    if sinks is not None:
        module = AttentionModuleStub(1)  # keys and values are repeated for the group above
        module.sinks = sinks
        out, _ = gpt_oss_eager(module, query, keys, values, mask, scaling=head_dim**-0.5, dropout=0.0)
        return out
    scores = query @ keys.transpose(-1, -2) * head_dim**-0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    weights = torch.softmax(scores + mask, dim=-1)
    return (weights @ values).transpose(1, 2)


VARIANTS = {
    "window": dict(window=7),
    "window-of-one": dict(window=1),
    "softcap": dict(softcap=3.0),
    "window+softcap": dict(window=5, softcap=2.0),
    "sinks": dict(sinks=True),
    "window+sinks": dict(window=9, sinks=True),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("num_new", [1, 4])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("segment_lengths", [(6, 13), (25,)])
def test_the_split_attention_applies_the_window_cap_and_sinks_as_eager_attention(variant, num_new, fused,
                                                                                  segment_lengths):
    settings = VARIANTS[variant]
    window, softcap = settings.get("window"), settings.get("softcap")
    gen = torch.Generator().manual_seed(len(variant) * 7 + num_new)
    batch, num_kv_heads, group, head_dim, suffix_len = 3, 2, 2, 8, 5
    segments = [tuple(torch.randn(2, 1, num_kv_heads, n, head_dim, generator=gen).unbind(0)) for n in segment_lengths]
    suffix_k, suffix_v = torch.randn(2, batch, num_kv_heads, suffix_len, head_dim, generator=gen).unbind(0)
    query = torch.randn(batch, num_kv_heads * group, num_new, head_dim, generator=gen) * 3
    sinks = torch.randn(num_kv_heads * group, generator=gen) if settings.get("sinks") else None
    cache = SharedPrefixCache.from_segments([list(segments)], batch, suffix_capacity=4, fused=fused)
    keys, values = cache.layers[0].update(suffix_k, suffix_v)
    kwargs = {"sliding_window": window, "softcap": softcap, "s_aux": sinks}
    got, _ = shared_prefix_attention(AttentionModuleStub(group), query, keys, values, None, scaling=head_dim**-0.5,
                                     **kwargs, **cache.forward_kwargs())
    want = _reference(query, segments, suffix_k, suffix_v, window, softcap, sinks, group)
    assert got.shape == want.shape == (batch, num_new, num_kv_heads * group, head_dim)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_window_shorter_than_the_suffix_sees_no_prefix_at_all():
    # Every prefix key is out of the window: the output is attention over the window's suffix
    # keys alone (the prefix must contribute nothing, not a NaN).
    gen = torch.Generator().manual_seed(3)
    prefix = tuple(torch.randn(2, 1, 1, 10, 4, generator=gen).unbind(0))
    suffix_k, suffix_v = torch.randn(2, 2, 1, 6, 4, generator=gen).unbind(0)
    query = torch.randn(2, 1, 1, 4, generator=gen)
    cache = SharedPrefixCache.from_segments([[prefix]], 2, suffix_capacity=8)
    keys, values = cache.layers[0].update(suffix_k, suffix_v)
    got, _ = shared_prefix_attention(AttentionModuleStub(1), query, keys, values, None, sliding_window=3,
                                     **cache.forward_kwargs())
    weights = torch.softmax(query @ suffix_k[:, :, -3:].transpose(-1, -2) * 0.5, dim=-1)
    torch.testing.assert_close(got, (weights @ suffix_v[:, :, -3:]).transpose(1, 2))


def _requests(seed):
    """Three requests sharing one prefix segment (a radix node) and each with private ones, at
    different lengths, so that each one's window starts somewhere else."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim, group = 2, 16, 2

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    shared = (randn(1, num_kv_heads, 9, head_dim), randn(1, num_kv_heads, 9, head_dim))
    requests = []
    for rows, private, suffix in ((1, 3, 2), (4, 0, 6), (2, 8, 1)):
        segments = [shared] + ([(randn(1, num_kv_heads, private, head_dim), randn(1, num_kv_heads, private, head_dim))]
                               if private else [])
        requests.append((rows, segments, (randn(rows, num_kv_heads, suffix, head_dim),
                                          randn(rows, num_kv_heads, suffix, head_dim)),
                         (randn(rows, num_kv_heads, 1, head_dim), randn(rows, num_kv_heads, 1, head_dim)),
                         randn(rows, num_kv_heads * group, 1, head_dim)))
    return requests, group


@pytest.mark.parametrize("variant", [dict(sliding_window=6), dict(sliding_window=14, softcap=4.0),
                                     dict(s_aux="sinks"), dict(sliding_window=10, s_aux="sinks")])
@pytest.mark.parametrize("seed", range(3))
def test_each_requests_rows_are_bit_identical_alone_and_batched_under_a_variant(variant, seed):
    requests, group = _requests(seed)
    if variant.get("s_aux") == "sinks":
        variant = {**variant, "s_aux": torch.randn(requests[0][4].shape[1], generator=torch.Generator().manual_seed(9))}
    alone = [batched_attention_step([request], group, **variant) for request in requests]
    together = batched_attention_step(requests, group, **variant)
    assert torch.equal(torch.cat(alone), together)
    # ... and each request's rows equal the model's eager attention over its own sequence.
    for (_, segments, (suffix_k, suffix_v), (new_k, new_v), query), got in zip(requests, alone):
        want = _reference(query, segments, torch.cat([suffix_k, new_k], dim=2), torch.cat([suffix_v, new_v], dim=2),
                          variant.get("sliding_window"), variant.get("softcap"), variant.get("s_aux"), group)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_layer_with_sinks_it_does_not_pass_is_refused():
    module = AttentionModuleStub(1)
    module.sinks = torch.zeros(1)
    cache = SharedPrefixCache([(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4))], 1)
    keys, values = cache.layers[0].update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
    with pytest.raises(NotImplementedError, match="sinks"):
        shared_prefix_attention(module, torch.randn(1, 1, 1, 4), keys, values, None, **cache.forward_kwargs())
