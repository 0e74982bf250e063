"""``rksc bench``: parse arguments into a ``BenchConfig``, run, print the table, save JSON and plots."""

from __future__ import annotations

import argparse
from pathlib import Path

from rksc_bench.config import ARMS, WORKLOADS, BenchConfig
from rksc_bench.paper import run_bench, save_report
from rksc_bench.report import render_markdown

BENCH_HELP = "measure rksc against no reuse, token-exact caching and langchain-huggingface"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``rksc bench``'s arguments to ``parser`` and make ``run`` its handler (``args.func``)."""
    defaults = BenchConfig()
    parser.add_argument("--workload", choices=list(WORKLOADS), default=defaults.workload,
                        help="gsm8k: 8-shot chain of thought; choice: multiple-choice few-shot; ladder: the "
                             "difficulty ladder, generated word problems of 1 to 4 steps after one-step "
                             "worked examples, --questions spread evenly over --levels")
    parser.add_argument("--levels", default=",".join(map(str, defaults.levels)),
                        help="ladder only: comma-separated levels (steps) from 1 to 4 to ask (default: all)")
    parser.add_argument("--data", default=None,
                        help="JSONL of questions (default: built-in synthetic set); not with --workload ladder, "
                             "which is always generated: run a GSM8K JSONL with --workload gsm8k")
    parser.add_argument("--model", default=None, help="local model directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--questions", type=int, default=defaults.questions)
    parser.add_argument("--branches", type=int, default=defaults.branches)
    parser.add_argument("--shots", type=int, default=defaults.shots)
    parser.add_argument("--ensemble", type=int, default=defaults.ensemble,
                        help="split branches over this many instruction wordings (prompt-ensemble SC)")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--tree-depth", type=int, default=defaults.tree_depth,
                        help="depth of the RSBCM tree search whose cache bytes are plotted (0: skip)")
    parser.add_argument("--tree-budget-mb", type=float, default=defaults.tree_budget_mb)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    parser.add_argument("--out", default="rksc-bench-results", help="folder for bench.json, bench.md and PNG plots")
    parser.add_argument("--no-plots", action="store_true")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``rksc bench`` with the parsed ``args``; returns the exit status."""
    try:
        config = BenchConfig(
            workload=args.workload, data=args.data, model=args.model, questions=args.questions,
            branches=args.branches, shots=args.shots, ensemble=args.ensemble,
            max_new_tokens=args.max_new_tokens, seed=args.seed,
            tree_depth=args.tree_depth, tree_budget_mb=args.tree_budget_mb,
            arms=tuple(a.strip() for a in args.arms.split(",") if a.strip()),
            levels=_parse_levels(args.levels),
        )
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"rksc bench: {exc}") from None
    report = run_bench(config)
    print(render_markdown(report))
    paths = save_report(report, Path(args.out), plots=not args.no_plots)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


def _parse_levels(text: str) -> tuple[int, ...]:
    """``"1,3"`` -> ``(1, 3)``; ``BenchConfig`` checks the range."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"levels must be comma-separated ints from 1 to 4, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rksc bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
