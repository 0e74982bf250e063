"""Benchmark: a tree search that must live inside a KV budget, RSBCM ``omega`` eviction versus ``lru``.

What it measures, on the default model, for each question (synthetic GSM8K-style by default, or a
GSM8K JSONL file with ``--data``): ``engine.tree_search`` with ``--breadth`` (3) children per node,
``--beam`` (2) kept per level, up to ``--depth`` (6) steps, steps of at most ``--max-step-tokens``
tokens, confidence scoring, seeded sampling (the same tree in every arm), run

* ``unbounded``: a budget far above need; its peak cache bytes define the budgets below;
* ``<policy> @ <f>``: budget ``f * unbounded peak`` (``--budgets``, default 0.5 and 0.25) for each
  policy: ``omega`` (the tree search tells the cache each step's score and depth, and marks branches
  the beam dropped with score 0), ``omega-raw`` (the same scores, no dropped-branch marking) and ``lru``.

Every arm gets a fresh engine over the same loaded model, warmed with a tiny request whose KV is then
dropped. Arms run interleaved within each repeat so machine drift hits all arms alike; repeat 0 runs
``unbounded`` first (its peak sizes the budgets), later repeats rotate the order. Reported per arm, summed over questions: peak cache bytes (and its share of the
unbounded peak), prompt tokens computed, tokens recomputed beyond the unbounded arm's, the prompt
token hit rate (reused / (reused + computed)), the median wall-time ratio to ``unbounded`` over the
repeats, whether any tree differed from the unbounded one and whether any chosen answer changed.

Run it (results also go to ``benchmarks/results/rsbcm.json``):

    flock /tmp/rksc-bench.lock ./dev python benchmarks/rsbcm.py
    flock /tmp/rksc-bench.lock ./dev python benchmarks/rsbcm.py --questions 2 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from rksc_bench import harness
from rksc_engine import EngineConfig, RKSCEngine, SamplingParams, SearchResult
from rksc_engine.config import RSBCMConfig
from rksc_engine.evaluation.workloads import load_gsm8k_jsonl, synthetic_problems
from rksc_engine.reasoning.few_shot import Problem, few_shot_messages

UNBOUNDED = "unbounded"
UNBOUNDED_MB = 4096.0


@dataclass(frozen=True)
class Arm:
    name: str
    policy: str
    budget_fraction: float | None  # of the unbounded peak; None = unbounded
    demote_pruned: bool = True


@dataclass
class Run:
    """One arm on one question in one repeat."""

    arm: str
    question: int
    repeat: int
    wall_s: float
    peak_bytes: int
    budget_bytes: int
    prompt_tokens_computed: int
    prompt_tokens_reused: int
    evicted_tokens: int
    answer: str | None
    max_depth: int
    num_expansions: int
    tree: list[tuple]


def make_arms(budgets: list[float], policies: list[str]) -> list[Arm]:
    arms = [Arm(UNBOUNDED, "omega", None)]
    for fraction in budgets:
        for policy in policies:
            if policy == "omega-raw":
                arms.append(Arm(f"omega-raw @ {fraction:g}", "omega", fraction, demote_pruned=False))
            else:
                arms.append(Arm(f"{policy} @ {fraction:g}", policy, fraction))
    return arms


def tree_signature(result: SearchResult) -> list[tuple]:
    return [(n.parent, n.token_ids, n.status) for n in result.nodes]


def build_engine(model: Any, tokenizer: Any, arm: Arm, peak_bytes: int, block_size: int) -> RKSCEngine:
    budget_mb = UNBOUNDED_MB if arm.budget_fraction is None else arm.budget_fraction * peak_bytes / 2**20
    config = EngineConfig(rsbcm=RSBCMConfig(cache_budget_mb=budget_mb, block_size=block_size, policy=arm.policy))
    engine = RKSCEngine(model, tokenizer, config)
    # Pay one-time per-engine costs (decode-path probe, allocator warm-up) outside the timed search.
    engine.generate_branches("Warm up.", 2, SamplingParams(temperature=1.0, max_new_tokens=2, seed=0))
    engine.clear_cache()
    engine.reset_stats()
    return engine


def run_arm(model: Any, tokenizer: Any, arm: Arm, problem: Problem, question: int, repeat: int, peak_bytes: int,
            args: argparse.Namespace) -> Run:
    engine = build_engine(model, tokenizer, arm, peak_bytes, args.block_size)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_step_tokens,
                            seed=args.seed + question)
    prompt = few_shot_messages(problem.question, args.shot_pool[: args.shots])
    start = time.perf_counter()
    result = engine.tree_search(problem.question, breadth=args.breadth, depth=args.depth, beam=args.beam,
                                params=params, prompt=prompt, demote_pruned=arm.demote_pruned)
    wall_s = time.perf_counter() - start
    stats = engine.stats()
    engine.prefix_cache.check_consistency()
    return Run(arm.name, question, repeat, wall_s, stats.cache_peak_bytes, engine.prefix_cache.budget_bytes,
               stats.prompt_tokens_computed, stats.prompt_tokens_reused, stats.cache_evicted_tokens,
               result.answer, max(n.depth for n in result.nodes), result.num_expansions, tree_signature(result))


def summarise(arms: list[Arm], runs: list[Run], num_questions: int, repeats: int) -> list[dict]:
    by = {(r.arm, r.question, r.repeat): r for r in runs}
    rows = []
    for arm in arms:
        mine = [by[(arm.name, q, 0)] for q in range(num_questions)]
        base = [by[(UNBOUNDED, q, 0)] for q in range(num_questions)]
        ratios = []
        for rep in range(repeats):
            arm_s = sum(by[(arm.name, q, rep)].wall_s for q in range(num_questions))
            base_s = sum(by[(UNBOUNDED, q, rep)].wall_s for q in range(num_questions))
            ratios.append(arm_s / base_s)
        computed = sum(r.prompt_tokens_computed for r in mine)
        reused = sum(r.prompt_tokens_reused for r in mine)
        over_budget = any(r.peak_bytes > r.budget_bytes for r in runs if r.arm == arm.name)
        rows.append({
            "arm": arm.name,
            "budget_fraction": arm.budget_fraction,
            "peak_mib": max(r.peak_bytes for r in mine) / 2**20,
            "peak_share_of_unbounded": sum(r.peak_bytes for r in mine) / sum(b.peak_bytes for b in base),
            "peak_over_budget": over_budget,
            "prompt_tokens_computed": computed,
            "prompt_tokens_recomputed": computed - sum(b.prompt_tokens_computed for b in base),
            "prompt_hit_rate": reused / (reused + computed) if reused + computed else 0.0,
            "evicted_tokens": sum(r.evicted_tokens for r in mine),
            "wall_ratio_median": statistics.median(ratios),
            "wall_ratios": ratios,
            "tree_changed": any(by[(arm.name, q, rep)].tree != by[(UNBOUNDED, q, rep)].tree
                                for q in range(num_questions) for rep in range(repeats)),
            "answer_changed": any(by[(arm.name, q, rep)].answer != by[(UNBOUNDED, q, 0)].answer
                                  for q in range(num_questions) for rep in range(repeats)),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| arm | peak cache MiB (share of unbounded) | prompt tokens computed | recomputed vs unbounded "
             "| prompt token hit rate | wall-time ratio to unbounded | tree / answer changed |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        changed = f"{'yes' if r['tree_changed'] else 'no'} / {'yes' if r['answer_changed'] else 'no'}"
        lines.append(
            f"| {r['arm']} | {r['peak_mib']:.2f} ({r['peak_share_of_unbounded']:.0%}) | {r['prompt_tokens_computed']:,} "
            f"| {r['prompt_tokens_recomputed']:+,} | {r['prompt_hit_rate']:.1%} | {r['wall_ratio_median']:.2f}x "
            f"| {changed} |"
        )
    return "\n".join(lines)


def run_benchmark(model: Any, tokenizer: Any, problems: list[Problem], args: argparse.Namespace) -> dict:
    """All arms on all problems; returns the summary rows and every run."""
    arms = make_arms(args.budgets, args.policies)
    load_start = os.getloadavg()
    runs: list[Run] = []
    peaks: list[int] = []
    total = len(problems) * args.repeats * len(arms)
    # Process-level warm-up (first-call allocations, thread pools), so the first timed arm is not penalised.
    warm = build_engine(model, tokenizer, arms[0], 0, args.block_size)
    warm.tree_search(problems[0].question, breadth=2, depth=1,
                     params=SamplingParams(temperature=1.0, max_new_tokens=4, seed=0))
    with tqdm(total=total, desc="rsbcm", unit="search") as bar:
        for q, problem in enumerate(problems):
            # Repeat 0 runs the unbounded arm first: its peak sets this question's budgets.
            sizing = run_arm(model, tokenizer, arms[0], problem, q, 0, 0, args)
            runs.append(sizing)
            peaks.append(sizing.peak_bytes)
            tqdm.write(f"question {q}: unbounded peak {sizing.peak_bytes / 2**20:.2f} MiB, {sizing.num_expansions} "
                       f"expansions, depth reached {sizing.max_depth}, answer {sizing.answer!r} (gold {problem.answer})")
            bar.update()
            for rep in range(args.repeats):
                shift = rep % len(arms)
                for arm in arms[shift:] + arms[:shift]:
                    if rep == 0 and arm is arms[0]:
                        continue  # already ran as the sizing run
                    run = run_arm(model, tokenizer, arm, problem, q, rep, sizing.peak_bytes, args)
                    runs.append(run)
                    tqdm.write(f"  {arm.name}: {run.wall_s:.1f}s, peak {run.peak_bytes / 2**20:.2f} MiB, "
                               f"computed {run.prompt_tokens_computed}, reused {run.prompt_tokens_reused}, "
                               f"answer {run.answer!r}")
                    bar.update()
    rows = summarise(arms, runs, len(problems), args.repeats)
    return {
        "rows": rows,
        "runs": [{k: v for k, v in asdict(r).items() if k != "tree"} for r in runs],
        "unbounded_peaks_bytes": peaks,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_count("--questions", 1, "questions searched")
    parser.add_argument("--data", type=Path, help="GSM8K JSONL file (default: synthetic problems)")
    parser.add_argument("--shots", type=int, default=0, help="worked examples in the prompt (default 0)")
    parser.add_argument("--depth", type=int, default=6, help="most steps per path (default 6)")
    parser.add_argument("--breadth", type=int, default=3, help="children per expanded node (default 3)")
    parser.add_argument("--beam", type=int, default=2, help="nodes kept per level (default 2)")
    parser.add_argument("--max-step-tokens", type=int, default=24, help="token budget per step (default 24)")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_seed(0, "seed of question 0's search; question i uses seed + i")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25],
                        help="budgets as fractions of the unbounded peak (default 0.5 0.25)")
    parser.add_argument("--policies", nargs="+", default=["omega", "omega-raw", "lru"],
                        choices=["omega", "omega-raw", "lru"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_repeats(1, "timed repeats per arm")
    args = parser.parse_args(argv)
    harness.start_run(args)

    pool = load_gsm8k_jsonl(args.data) if args.data else synthetic_problems(64, seed=3)
    problems = pool[: args.questions]
    args.shot_pool = pool[args.questions:]
    engine = harness.load_engine(args)
    model, tokenizer = engine.model, engine.tokenizer
    print(f"model {engine.model_name} on {engine.device} ({engine.dtype}), torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    result = run_benchmark(model, tokenizer, problems, args)
    print(format_table(result["rows"]))
    print(f"unbounded peaks (bytes): {result['unbounded_peaks_bytes']}; load average "
          f"{result['load_average_start'][0]:.1f} -> {result['load_average_end'][0]:.1f}")
    settings = {k: v for k, v in vars(args).items() if k != "shot_pool"}
    harness.write_json(args.json_out, {"settings": settings, **result})
    print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
