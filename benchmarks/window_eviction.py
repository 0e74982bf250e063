"""Benchmark: freeing sliding-window KV out of every window (the radix cache's tombstones) against
evicting it, on the windowed families' tiny seeded configs (``rksc_bench.families``; no weights).

Workload: ``--sessions`` agent sessions, each a distinct long context prompt (``--prompt-tokens``,
character tokens), asked in turn for ``--rounds`` rounds of ``--max-new-tokens`` greedy tokens,
under a radix-cache budget that holds ``--budget-prompts`` of the prompts' KV intact. The two
arms differ only in ``RSBCMConfig.free_out_of_window``. Reported per arm: prompt tokens reused
after the first round, tokens freed out of the window and evicted, the cache's peak bytes, wall
time, and whether every completion equals the other arm's (both are exact).

    flock /tmp/rksc-bench.lock ./dev python benchmarks/window_eviction.py
"""

from __future__ import annotations

import argparse
import random
import time

from rksc_bench import harness
from rksc_bench.families import SLIDING_WINDOW, char_tokenizer, make_family_model
from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.config import EngineConfig, RSBCMConfig

DEFAULT_FAMILIES = ("gemma3", "gpt-oss", "gemma2", "cohere2", "mistral-sliding")
WORDS = ("river", "stone", "north", "mill", "bridge", "field", "lamp", "crow", "salt", "gate", "moss", "tide")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__, model=False)  # tiny seeded models, no weights
    parser.add_argument("--families", nargs="*", default=list(DEFAULT_FAMILIES),
                        help=f"windowed families (default {' '.join(DEFAULT_FAMILIES)})")
    parser.add_count("--sessions", 8, "distinct prompts asked in turn")
    parser.add_count("--prompt-tokens", 400, "tokens per prompt")
    parser.add_count("--rounds", 3, "times each prompt is asked")
    parser.add_argument("--budget-prompts", type=float, nargs="*", default=[3.0, 6.0],
                        help="cache budgets, in prompts whose KV they hold intact (default 3 6)")
    parser.add_max_new_tokens(8, "greedy tokens per request")
    args = parser.parse_args(argv)
    if args.prompt_tokens <= 2 * SLIDING_WINDOW:
        parser.error(f"--prompt-tokens must be > {2 * SLIDING_WINDOW}, so that prompts leave the window")
    if not args.budget_prompts or min(args.budget_prompts) <= 0:
        parser.error("--budget-prompts must be > 0")
    return args


def session_prompts(sessions: int, prompt_tokens: int) -> list[str]:
    """Distinct prompts of ``prompt_tokens`` characters, seeded, each starting differently."""
    rng = random.Random(0)
    prompts = []
    for index in range(sessions):
        text = f"Session {index}. Context: "
        while len(text) < prompt_tokens:
            text += rng.choice(WORDS) + " "
        prompts.append(text[:prompt_tokens - 4] + "\nA:")
    return prompts


def run_arm(model, tokenizer, prompts: list[str], budget_bytes: int, free_out_of_window: bool,
            args: argparse.Namespace) -> dict:
    config = EngineConfig(rsbcm=RSBCMConfig(cache_budget_mb=budget_bytes / 2**20,
                                            free_out_of_window=free_out_of_window))
    engine = RKSCEngine(model, tokenizer, config)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    completions, reused, later_prompt_tokens = [], 0, 0
    start = time.perf_counter()
    for round_index in range(args.rounds):
        for prompt in prompts:
            result = engine.generate(prompt, params)
            completions.append(result.token_ids)
            if round_index:
                reused += result.num_cached_tokens
                later_prompt_tokens += result.num_prompt_tokens
    seconds = time.perf_counter() - start
    stats = engine.stats()
    engine.prefix_cache.check_consistency()
    return {"reused_after_first_round": reused, "prompt_tokens_after_first_round": later_prompt_tokens,
            "reuse_rate": reused / later_prompt_tokens, "window_freed_tokens": stats.cache_window_freed_tokens,
            "evicted_tokens": stats.cache_evicted_tokens, "peak_bytes": stats.cache_peak_bytes,
            "budget_bytes": stats.cache_budget_bytes, "seconds": seconds, "completions": completions}


def measure(name: str, tokenizer, args: argparse.Namespace) -> list[dict]:
    model = make_family_model(name)
    prompts = session_prompts(args.sessions, args.prompt_tokens)
    probe = RKSCEngine(model, tokenizer)
    probe.generate(prompts[0], SamplingParams(max_new_tokens=args.max_new_tokens))
    prompt_bytes = probe.stats().cache_bytes  # one prompt and its completion, every layer kept
    rows = []
    for budget_prompts in args.budget_prompts:
        budget = int(prompt_bytes * budget_prompts)
        on = run_arm(model, tokenizer, prompts, budget, True, args)
        off = run_arm(model, tokenizer, prompts, budget, False, args)
        same = sum(a == b for a, b in zip(on.pop("completions"), off.pop("completions")))
        rows.append({"family": name, "budget_prompts": budget_prompts, "budget_bytes": budget,
                     "freed": on, "evicted": off, "same_completions": same,
                     "requests": args.sessions * args.rounds})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    harness.start_run(args)
    tokenizer = char_tokenizer()
    rows = []
    print(f"{args.sessions} sessions x {args.rounds} rounds, {args.prompt_tokens}-token prompts, "
          f"window {SLIDING_WINDOW}; reuse counts rounds 2 on")
    print("| family | budget (prompts) | reuse, window KV freed | reuse, evicted (LRU) | tokens freed out of "
          "window | tokens evicted (freed / evicted arm) | wall s (freed / evicted) | same completions |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.families:
        for row in measure(name, tokenizer, args):
            rows.append(row)
            on, off = row["freed"], row["evicted"]
            print(f"| {name} | {row['budget_prompts']:g} | {on['reuse_rate']:.1%} | {off['reuse_rate']:.1%} | "
                  f"{on['window_freed_tokens']} | {on['evicted_tokens']} / {off['evicted_tokens']} | "
                  f"{on['seconds']:.2f} / {off['seconds']:.2f} | {row['same_completions']}/{row['requests']} |",
                  flush=True)
    harness.write_json(args.json_out, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
