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
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rksc_bench import harness
from rksc_bench.branch_runs import (
    TEMPERATURE,
    TOP_P,
    RunResult,
    hf_generate,
    run_hf_batched,
    run_hf_sequential,
    run_rksc,
)
from rksc_bench.prompts import few_shot_prompt_ids
from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.evaluation.workloads import load_gsm8k_jsonl, synthetic_problems
from rksc_engine.reasoning.few_shot import Problem

# Enough synthetic problems to pass any sensible --prompt-tokens (each shot is ~100 tokens).
SYNTHETIC_POOL = 400

ARM_RKSC_COLD = "rksc cold (1 prefill)"
ARM_RKSC_WARM = "rksc warm (prompt cached)"
ARM_HF_BATCH = "HF generate(num_return_sequences=n)"
ARM_HF_SEQUENTIAL = "HF generate x n sequential"


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
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_count("--branches", 8, "branches per prompt")
    parser.add_max_new_tokens(64, "token budget per branch")
    parser.add_repeats(2)
    parser.add_count("--prompt-tokens", 1300, "add few-shot examples until the prompt has at least this many tokens")
    parser.add_argument(
        "--shots-from",
        type=Path,
        default=None,
        help="GSM8K-format JSONL to take the question and shots from (default: synthetic problems)",
    )
    parser.add_seed(0, "seed of the synthetic problems and of sampling")
    return parser.parse_args(argv)


# -- the prompt ----------------------------------------------------------------------------------
def load_problems(shots_from: Path | None, seed: int) -> list[Problem]:
    """The question plus candidate shots: from a GSM8K JSONL file, else seeded synthetic problems."""
    if shots_from is not None:
        problems = load_gsm8k_jsonl(shots_from)
        if not problems:
            raise SystemExit(f"{shots_from} holds no problems")
        return problems
    return synthetic_problems(SYNTHETIC_POOL, seed)


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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    harness.start_run(args)
    engine = harness.load_engine(args)
    prompt_ids, num_shots = few_shot_prompt_ids(engine, load_problems(args.shots_from, args.seed), args.prompt_tokens)
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
    harness.write_json(args.json_out, {"setup": setup, "arms": [asdict(r) for r in rows]})
    print(f"\nwrote {args.json_out}")


if __name__ == "__main__":
    main()
