"""``print(engine.stats())`` reads as a short grouped summary; ``repr`` stays every field on one line."""

from __future__ import annotations

import dataclasses

from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.results import EngineStats
from tests.conftest import make_char_tokenizer, make_tiny_model


def test_printed_stats_are_grouped_lines_a_reader_can_scan():
    engine = RKSCEngine(make_tiny_model(), make_char_tokenizer())
    engine.generate_branches("Question: 2+3?", 3, SamplingParams(max_new_tokens=5, temperature=1.0, seed=1))
    engine.generate("Question: 2+3? Again", SamplingParams(max_new_tokens=4))
    stats = engine.stats()
    lines = str(stats).splitlines()
    assert lines[0] == "EngineStats" and len(lines) >= 6, str(stats)
    assert max(len(line) for line in lines) <= 120, f"a line is too long to read:\n{stats}"
    by_group = {line.split(":")[0].strip(): line for line in lines[1:]}
    assert list(by_group)[:5] == ["requests", "prompt tokens", "decode", "prefix cache", "running KV"]
    assert f"{stats.prompt_tokens_computed:,} computed, {stats.prompt_tokens_reused:,} reused" in by_group["prompt tokens"]
    assert f"{stats.decode_tokens:,} tokens" in by_group["decode"]
    assert by_group["requests"].startswith(f"  requests: {stats.requests:,} ")
    # Bytes carry a unit that shows the number: the tiny model's cache is KiB, not "0.0 MiB".
    assert " KiB of " in by_group["prefix cache"] and "GiB budget" in by_group["prefix cache"], by_group["prefix cache"]
    # Features that did nothing stay out of the summary.
    assert not any(group.startswith(("ASKS", "retrieved chunks", "out-of-memory")) for group in by_group)


def test_repr_keeps_every_field_for_debugging():
    stats = EngineStats(requests=2, decode_tokens=7, extra={"branches_cancelled": 1})
    text = repr(stats)
    assert text.startswith("EngineStats(requests=2, ") and "\n" not in text
    assert all(f"{f.name}=" in text for f in dataclasses.fields(EngineStats))


def test_features_and_refusals_appear_once_they_have_something_to_say():
    stats = EngineStats(asks_checks=3, asks_reuses=1, asks_reused_tokens=1200, chunk_reuse_prompts=2, chunks_reused=5,
                        chunk_tokens_cached=900, oom_retries=1, prefix_cache_refusal="sliding-window model",
                        extra={"branches_cancelled": 4}, cache_bytes=3 * 2**20, cache_budget_bytes=512)
    text = str(stats)
    assert "  ASKS: 1 of 3 checked prompts reused; 1,200 tokens reused" in text
    assert "  retrieved chunks: 5 reused in 2 prompts; 900 tokens cached" in text
    assert "  out-of-memory retries: 1" in text
    assert "  prefix cache off: sliding-window model" in text
    assert "  extra: branches_cancelled=4" in text
    assert "prefix cache: 3.00 MiB of 512 B budget" in text


def test_printed_sizes_read_as_the_engine_s_refusals_write_them():
    # One byte format for the whole engine: a size in the stats summary is the size a refusal shows.
    stats = EngineStats(cache_bytes=46080, cache_budget_bytes=19_660_800_000, cache_peak_bytes=1023,
                        running_kv_bytes=3 * 2**20 // 2, peak_running_kv_bytes=1830 * 2**30)
    text = str(stats)
    assert "prefix cache: 45.0 KiB of 18.3 GiB budget (peak 1,023 B)" in text, text
    assert "running KV: 1.50 MiB (peak 1,830 GiB)" in text, text
