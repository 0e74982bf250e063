"""Benchmark: n sampled branches of one long few-shot prompt, rksc versus plain ``transformers``.

What it measures, in one run on the same model, prompt and sampling settings (temperature 0.7,
top-p 0.95, top-k off), for ``--branches`` (default 8) branches:

* ``rksc cold``: ``engine.generate_branches(prompt, 8)`` on an empty prefix cache. The prompt is
  prefilled once and its KV fanned out to the 8 branches, which decode as one batch.
* ``rksc warm``: the same call again; the radix cache already holds the prompt, so only its last
  token is computed.
* ``HF num_return_sequences``: ``model.generate(num_return_sequences=8)``, which expands the input to
  8 rows and prefills the prompt 8 times.
* ``HF 8 sequential``: 8 separate ``model.generate`` calls, each prefilling the prompt again.

Every arm runs ``--repeats`` times, interleaved arm by arm within each repeat so that machine drift
hits all arms alike, and the table reports the median wall time, the wall-time ratio of each arm to
``rksc cold`` (above 1 means rksc cold is that many times faster), the prompt tokens computed per run
(engine counters for rksc, ``branches * prompt length`` for HF), the generated tokens per run and
generated tokens per second. Generated tokens count each branch up to and including its EOS token,
so HF's padding after EOS is not counted; branch lengths are sampled, so they differ between arms
and tokens/s is the fairer throughput figure.

Run it (results also go to ``benchmarks/results/branches.json``):

    ./dev python benchmarks/branches.py
    .venv/bin/python benchmarks/branches.py --repeats 3 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.evaluation.workloads import load_gsm8k_jsonl, synthetic_problems
from rksc_engine.reasoning.few_shot import Problem, few_shot_messages

DEFAULT_JSON_OUT = Path(__file__).resolve().parent / "results" / "branches.json"
TEMPERATURE = 0.7
TOP_P = 0.95
# Enough synthetic problems to pass any sensible --prompt-tokens (each shot is ~100 tokens).
SYNTHETIC_POOL = 400

ARM_RKSC_COLD = "rksc cold (1 prefill)"
ARM_RKSC_WARM = "rksc warm (prompt cached)"
ARM_HF_BATCH = "HF generate(num_return_sequences=n)"
ARM_HF_SEQUENTIAL = "HF generate x n sequential"


@dataclass
class RunResult:
    """What one timed run of one arm did."""

    wall_s: float
    prompt_tokens_computed: int
    generated_tokens: int


@dataclass
class ArmSummary:
    """One arm's row of the table: medians over the repeats."""

    arm: str
    median_wall_s: float
    rksc_cold_speedup: float  # this arm's time / rksc cold's time
    prompt_tokens_computed: int
    generated_tokens: int
    generated_tokens_per_s: float
    wall_s_per_repeat: list[float]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="local HF model directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--branches", type=int, default=8, help="branches per prompt (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="token budget per branch (default 64)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per arm; the median is reported (default 2)")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=1300,
        help="add few-shot examples until the prompt has at least this many tokens (default 1300)",
    )
    parser.add_argument(
        "--shots-from",
        type=Path,
        default=None,
        help="GSM8K-format JSONL to take the question and shots from (default: synthetic problems)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the synthetic problems and of sampling (default 0)"
    )
    parser.add_argument(
        "--json-out",
        type=Path,
        default=DEFAULT_JSON_OUT,
        help=f"where to write the results (default {DEFAULT_JSON_OUT})",
    )
    args = parser.parse_args(argv)
    for name in ("branches", "max_new_tokens", "repeats", "prompt_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# -- the prompt ----------------------------------------------------------------------------------
def build_prompt_ids(engine: RKSCEngine, problems: list[Problem], target_tokens: int) -> tuple[list[int], int]:
    """Few-shot prompt token ids: ``problems[0]`` is the question, shots are added from the rest
    until the rendered prompt reaches ``target_tokens``.

    Returns:
        ``(token_ids, number_of_shots)``.
    """
    question, pool = problems[0].question, problems[1:]
    ids = engine.encode(few_shot_messages(question, []))
    num_shots = 0
    while len(ids) < target_tokens and num_shots < len(pool):
        num_shots += 1
        ids = engine.encode(few_shot_messages(question, pool[:num_shots]))
    if len(ids) < target_tokens:
        print(f"warning: only {len(ids)} prompt tokens with all {num_shots} available shots", file=sys.stderr)
    return ids, num_shots


def load_problems(shots_from: Path | None, seed: int) -> list[Problem]:
    """The question plus candidate shots: from a GSM8K JSONL file, else seeded synthetic problems."""
    if shots_from is not None:
        problems = load_gsm8k_jsonl(shots_from)
        if not problems:
            raise SystemExit(f"{shots_from} holds no problems")
        return problems
    return synthetic_problems(SYNTHETIC_POOL, seed)


# -- the arms --------------------------------------------------------------------------------------
def timed(fn: Callable[[], int]) -> tuple[float, int]:
    """Run ``fn`` and return ``(wall seconds, fn's result)``."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run_rksc(engine: RKSCEngine, prompt_ids: list[int], n: int, params: SamplingParams) -> RunResult:
    """One ``generate_branches`` call; prompt tokens computed come from the engine's own counters."""
    before = engine.stats()
    wall_s, generated = timed(
        lambda: sum(c.num_generated_tokens for c in engine.generate_branches(prompt_ids, n, params))
    )
    computed = engine.stats().prompt_tokens_computed - before.prompt_tokens_computed
    return RunResult(wall_s, computed, generated)


def count_generated(new_tokens: torch.Tensor, eos_ids: set[int]) -> int:
    """Generated tokens in a (rows, steps) block, each row counted up to and including its first EOS.

    HF pads rows that finished early (here the pad id is the EOS id), so that padding is cut off.
    """
    total = 0
    for row in new_tokens.tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos_ids), len(row))
        total += end
    return total


def hf_eos_ids(model) -> set[int]:
    """The EOS ids ``model.generate`` stops on."""
    eos = model.generation_config.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


def hf_generate(model, input_ids: torch.Tensor, num_return_sequences: int, max_new_tokens: int) -> torch.Tensor:
    """Sampled ``model.generate``; returns only the generated part, shape (num_return_sequences, steps)."""
    output = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=True,
        temperature=TEMPERATURE,
        top_p=TOP_P,
        top_k=0,  # HF would otherwise default to top-k 50; rksc samples with top-k off
        max_new_tokens=max_new_tokens,
        num_return_sequences=num_return_sequences,
        pad_token_id=model.generation_config.pad_token_id,
    )
    return output[:, input_ids.shape[1] :]


def run_hf_batched(model, input_ids: torch.Tensor, n: int, max_new_tokens: int, seed: int) -> RunResult:
    """One ``generate(num_return_sequences=n)``: HF repeats the prompt n times, so it prefills n*T tokens."""
    torch.manual_seed(seed)
    eos_ids = hf_eos_ids(model)
    wall_s, generated = timed(lambda: count_generated(hf_generate(model, input_ids, n, max_new_tokens), eos_ids))
    return RunResult(wall_s, n * input_ids.shape[1], generated)


def run_hf_sequential(model, input_ids: torch.Tensor, n: int, max_new_tokens: int, seed: int) -> RunResult:
    """n separate ``generate`` calls, each prefilling the whole prompt: n*T prompt tokens."""
    torch.manual_seed(seed)
    eos_ids = hf_eos_ids(model)

    def all_calls() -> int:
        return sum(count_generated(hf_generate(model, input_ids, 1, max_new_tokens), eos_ids) for _ in range(n))

    wall_s, generated = timed(all_calls)
    return RunResult(wall_s, n * input_ids.shape[1], generated)


def run_one_repeat(
    engine: RKSCEngine, prompt_ids: list[int], args: argparse.Namespace, seed: int
) -> dict[str, RunResult]:
    """Every arm once, in a fixed order (warm must directly follow cold, which fills the cache)."""
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=TEMPERATURE, top_p=TOP_P, seed=seed)
    input_ids = torch.tensor([prompt_ids], device=engine.device)
    n, model = args.branches, engine.model
    engine.clear_cache()  # cold: the prompt must be prefilled
    results = {ARM_RKSC_COLD: run_rksc(engine, prompt_ids, n, params)}
    results[ARM_RKSC_WARM] = run_rksc(engine, prompt_ids, n, params)
    results[ARM_HF_BATCH] = run_hf_batched(model, input_ids, n, args.max_new_tokens, seed)
    results[ARM_HF_SEQUENTIAL] = run_hf_sequential(model, input_ids, n, args.max_new_tokens, seed)
    return results


def warm_up(engine: RKSCEngine, prompt_ids: list[int]) -> None:
    """A short untimed pass through both code paths, so one-off setup does not land in the first repeat."""
    engine.generate_branches(prompt_ids, 2, SamplingParams(max_new_tokens=2, temperature=TEMPERATURE, seed=0))
    hf_generate(engine.model, torch.tensor([prompt_ids], device=engine.device), 2, 2)
    engine.clear_cache()
    engine.reset_stats()


# -- reporting -------------------------------------------------------------------------------------
def summarise(per_repeat: list[dict[str, RunResult]]) -> list[ArmSummary]:
    """Medians over the repeats, one row per arm, speedups relative to rksc cold."""
    arms = list(per_repeat[0])
    medians = {arm: statistics.median(r[arm].wall_s for r in per_repeat) for arm in arms}
    rows = []
    for arm in arms:
        runs = [r[arm] for r in per_repeat]
        rows.append(
            ArmSummary(
                arm=arm,
                median_wall_s=medians[arm],
                rksc_cold_speedup=medians[arm] / medians[ARM_RKSC_COLD],
                prompt_tokens_computed=int(statistics.median(run.prompt_tokens_computed for run in runs)),
                generated_tokens=int(statistics.median(run.generated_tokens for run in runs)),
                generated_tokens_per_s=statistics.median(run.generated_tokens / run.wall_s for run in runs),
                wall_s_per_repeat=[round(run.wall_s, 3) for run in runs],
            )
        )
    return rows


def markdown_table(rows: list[ArmSummary]) -> str:
    """The results as a markdown table."""
    lines = [
        "| arm | median wall s | rksc-cold speedup (arm s / rksc cold s) | prompt tokens computed | generated tokens | generated tok/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.arm} | {row.median_wall_s:.2f} | {row.rksc_cold_speedup:.2f}x | {row.prompt_tokens_computed:,} "
            f"| {row.generated_tokens:,} | {row.generated_tokens_per_s:.1f} |"
        )
    return "\n".join(lines)


def write_json(path: Path, setup: dict, rows: list[ArmSummary]) -> None:
    """Write the setup and every row (with per-repeat times) as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"setup": setup, "arms": [asdict(r) for r in rows]}, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    engine = RKSCEngine.from_pretrained(args.model)
    prompt_ids, num_shots = build_prompt_ids(engine, load_problems(args.shots_from, args.seed), args.prompt_tokens)
    setup = {
        "model": engine.model_name,
        "device": str(engine.device),
        "dtype": str(engine.dtype),
        "torch_threads": torch.get_num_threads(),
        "prompt_tokens": len(prompt_ids),
        "shots": num_shots,
        "shots_from": str(args.shots_from) if args.shots_from else "synthetic",
        "branches": args.branches,
        "max_new_tokens": args.max_new_tokens,
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "repeats": args.repeats,
        "seed": args.seed,
    }
    print(
        f"model {setup['model']} on {setup['device']} ({setup['dtype']}, {setup['torch_threads']} threads); "
        f"prompt {len(prompt_ids)} tokens ({num_shots} shots); {args.branches} branches x {args.max_new_tokens} "
        f"new tokens; {args.repeats} repeats"
    )

    with torch.inference_mode():
        warm_up(engine, prompt_ids)
        per_repeat = [
            run_one_repeat(engine, prompt_ids, args, seed=args.seed + repeat * args.branches)
            for repeat in tqdm(range(args.repeats), desc="repeats")
        ]

    rows = summarise(per_repeat)
    print()
    print(markdown_table(rows))
    write_json(args.json_out, setup, rows)
    print(f"\nwrote {args.json_out}")


if __name__ == "__main__":
    main()
