"""A request's branches are refused up front when they cannot fit: their KV against the cache budget,
and their logits and sampling buffers (``n`` rows over the whole vocabulary) against the memory the
device has; the refusal names ``n`` and shows its sizes in a unit that shows them."""

from __future__ import annotations

import pytest
from conftest import make_char_tokenizer, make_tiny_model

import rksc_engine.engine as engine_module
from rksc_engine import EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.config import RSBCMConfig
from rksc_engine.kvcache.memory import available_memory_bytes
from rksc_engine.runtime.sampling import SAMPLING_BYTES_PER_LOGIT, decode_bytes_per_row
from rksc_engine.units import format_bytes

SMOLLM_VOCAB = 49152  # the default model's vocabulary
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head dim x float32


@pytest.mark.parametrize("num_bytes, text", [
    (0, "0 B"), (512, "512 B"), (1023, "1,023 B"), (1024, "1.00 KiB"), (10485, "10.2 KiB"), (46080, "45.0 KiB"),
    (3 * 2**20 // 2, "1.50 MiB"), (19_660_800_000, "18.3 GiB"), (1830 * 2**30, "1,830 GiB"),
])
def test_bytes_are_written_in_the_largest_unit_they_fill_with_three_digits(num_bytes, text):
    assert format_bytes(num_bytes) == text


def test_the_cache_budget_refusal_shows_sizes_below_a_mib(tiny_model, tiny_tokenizer):
    engine = RKSCEngine(tiny_model, tiny_tokenizer, EngineConfig(rsbcm=RSBCMConfig(cache_budget_mb=0.01)))
    with pytest.raises(ValueError) as refused:
        engine.submit("hi", 8, SamplingParams(max_new_tokens=64))
    message = str(refused.value)
    # 8 branches x 64 tokens x 512 bytes = 256 KiB, against a budget of 0.01 MiB = 10,485 bytes.
    assert message.startswith("n=8 branches of up to 64 new tokens need 256 KiB of KV"), message
    assert "cache budget of 10.2 KiB" in message, message
    assert "0 MiB" not in message, message


def test_a_row_costs_its_logits_their_float_copy_and_the_sampling_buffers():
    import torch

    assert decode_bytes_per_row(SMOLLM_VOCAB, torch.float32) == SMOLLM_VOCAB * (4 + SAMPLING_BYTES_PER_LOGIT)
    assert decode_bytes_per_row(SMOLLM_VOCAB, torch.bfloat16) == SMOLLM_VOCAB * (2 + 4 + SAMPLING_BYTES_PER_LOGIT)


@pytest.fixture(scope="module")
def wide_vocab_engine():
    """A tiny model with the default model's 49k vocabulary: each branch's logits cost what they do there."""
    return RKSCEngine(make_tiny_model(vocab_size=SMOLLM_VOCAB), make_char_tokenizer())


def test_n_whose_logits_cannot_fit_in_memory_is_refused_up_front_naming_n(wide_vocab_engine):
    engine = wide_vocab_engine
    prompt_ids = engine.encode("Q: 2+3?\nA:")
    per_row = decode_bytes_per_row(SMOLLM_VOCAB, engine.dtype) + TINY_KV_BYTES_PER_TOKEN
    available = available_memory_bytes(engine.device)
    if available is None or 100_000 * per_row <= available:
        pytest.skip(f"this machine has {available} bytes available: 100,000 branches would fit")
    with pytest.raises(ValueError, match=r"^n=100000 branches need about .* of memory") as refused:
        engine.validate_request(prompt_ids, 100_000, SamplingParams(max_new_tokens=1))
    message = str(refused.value)
    assert format_bytes(100_000 * per_row) in message and f"{format_bytes(per_row)} a branch" in message, message
    assert "vocabulary of 49,152 entries at float32" in message and "n can be at most" in message, message
    # Reasonable widths pass: 64 and 256 branches of this vocabulary need about 108 MiB and 432 MiB.
    for n in (64, 256):
        engine.validate_request(prompt_ids, n, SamplingParams(max_new_tokens=1))


def test_the_memory_refusal_comes_before_anything_is_queued(wide_vocab_engine, monkeypatch):
    engine = wide_vocab_engine
    per_row = decode_bytes_per_row(SMOLLM_VOCAB, engine.dtype) + TINY_KV_BYTES_PER_TOKEN
    # A device with room for 10 branches (a configured bound would read the same).
    monkeypatch.setattr(engine_module, "available_memory_bytes", lambda device: 10 * per_row + per_row // 2)
    before = engine.stats()
    with pytest.raises(ValueError, match=r"^n=11 branches .* n can be at most 10; lower n"):
        engine.submit("Q: 2+3?\nA:", 11, SamplingParams(max_new_tokens=1))
    # Branches an early-stop monitor may add are counted too.
    with pytest.raises(ValueError, match=r"^max_branches=12 branches"):
        engine.submit("Q: 2+3?\nA:", 2, SamplingParams(max_new_tokens=1), monitor=_NoMonitor(), max_branches=12)
    after = engine.stats()
    assert (after.requests, after.waiting_requests, after.prefills) == (before.requests, 0, before.prefills)
    assert len(engine.generate_branches("Q: 2+3?\nA:", 10, SamplingParams(max_new_tokens=1))) == 10


class _NoMonitor:
    def observe(self, events):
        return None
