"""The real embedded default model (SmolLM2-135M-Instruct): loading, and exactness against plain
transformers on a real chat prompt."""

import subprocess
import sys

import pytest
import torch

from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.evaluation.workloads import synthetic_problems
from rksc_engine.reasoning.few_shot import few_shot_messages

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine():
    return RKSCEngine.from_pretrained(progress=False)  # converts once if the user cache is empty


def messages():
    return few_shot_messages(synthetic_problems(1, seed=9)[0].question, synthetic_problems(3, seed=1))


def test_a_later_load_reads_the_converted_model_without_touching_the_gguf(engine, monkeypatch):
    # Reading the GGUF dequantises every tensor (~20 s); a later load must never take that path.
    # Asserted by construction, not by a wall-clock bound that a busy CI machine could break.
    import rksc_engine.runtime.loading as loading

    converted = loading.default_model_dir()
    mtimes = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}

    def no_gguf():
        raise AssertionError("a later load went back to the GGUF file")

    monkeypatch.setattr(loading, "default_gguf_path", no_gguf)
    again = RKSCEngine.from_pretrained(progress=False)
    assert again.generate("hi", SamplingParams(max_new_tokens=3)).token_ids == engine.generate(
        "hi", SamplingParams(max_new_tokens=3)).token_ids
    assert {p.name: p.stat().st_mtime_ns for p in converted.iterdir()} == mtimes


def test_greedy_on_the_default_model_matches_transformers_cold_and_warm(engine):
    ids = engine.encode(messages())
    ref = engine.model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=40, do_sample=False
    )[0, len(ids):].tolist()
    engine.clear_cache()
    cold = engine.generate(ids, SamplingParams(max_new_tokens=40))
    warm = engine.generate(ids, SamplingParams(max_new_tokens=40))
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == len(ids) - 1
    assert list(cold.token_ids) == ref
    assert list(warm.token_ids) == ref
    assert warm.text == engine.tokenizer.decode(ref, skip_special_tokens=True)


def test_a_sampled_branch_on_the_default_model_is_the_same_alone_and_batched(engine):
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=100)
    batched = engine.generate_branches(messages(), 4, params)
    alone = engine.generate(messages(), SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=102))
    assert alone.token_ids == batched[2].token_ids


def test_rksc_ask_prints_branch_answers_majority_and_cache_stats():
    out = subprocess.run(
        [sys.executable, "-m", "rksc_cli", "ask", "Tom has 3 bags with 4 apples each. How many apples?",
         "--branches", "3", "--max-new-tokens", "48", "--shots", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("branch ") == 3
    assert "Majority vote:" in out.stdout and "Answer:" in out.stdout and "CGEE:" in out.stdout
    assert "Branches' prompt:" in out.stdout and "verifier's prompts:" in out.stdout
