"""The ``rksc`` command line: ``rksc ask`` answers a question with self-consistency over
``--branches`` reasoning branches that share one computed prompt."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .cgee import CGEEConfig
from .config import SamplingParams
from .datasets import few_shot_messages, load_gsm8k_jsonl, synthetic_problems


def _ask(args: argparse.Namespace) -> int:
    from .engine import RKSCEngine

    t0 = time.perf_counter()
    engine = RKSCEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    shots = load_gsm8k_jsonl(args.shots_from, limit=args.shots) if args.shots_from else synthetic_problems(args.shots, seed=1)
    messages = few_shot_messages(args.question, shots)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, stop=("<|im_end|>",))
    cgee = CGEEConfig.off() if args.no_cgee else None  # None: the engine's EngineConfig.cgee defaults
    t0 = time.perf_counter()
    result = engine.reason(args.question, n=args.branches, params=params, prompt=messages, cgee=cgee)
    gen_s = time.perf_counter() - t0
    branches = result.branches
    winner, votes = result.answer, result.votes
    stats = engine.stats()
    if args.json:
        print(json.dumps({
            "answer": winner, "votes": dict(votes),
            "branches": [{"answer": b.answer, "confidence": b.confidence, "text": b.text} for b in branches],
            "verification": result.verification.summary(),
            "stats": stats.as_dict(), "load_s": load_s, "generate_s": gen_s,
        }, indent=2))
        return 0
    print(f"Question: {args.question}")
    print(f"Model: {engine.model_name} | branches: {args.branches}")
    for i, b in enumerate(branches):
        first_line = b.text.strip().splitlines()[0] if b.text.strip() else ""
        print(f"  branch {i}: answer={b.answer!s:>8}  confidence={b.confidence:.3f}  {first_line[:70]}")
    print(f"Majority vote: {result.vote_summary.winner}  (confidence-weighted share p={result.vote_summary.p:.2f}, "
          f"lead={result.vote_summary.lead:.2f})")
    print(result.verification.summary())
    print(f"Answer: {winner}  votes={dict(votes)}")
    print(f"Prompt tokens computed: {stats.prompt_tokens_computed} (once for all {args.branches} branches; "
          f"reused from cache: {stats.prompt_tokens_reused}) | decode tokens: {stats.decode_tokens} | "
          f"cache: {stats.cache_bytes / 2**20:.1f} MiB | generate: {gen_s:.1f}s (load {load_s:.1f}s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rksc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ask = sub.add_parser("ask", help="answer a question by self-consistency over N branches")
    ask.add_argument("question")
    ask.add_argument("--branches", "-n", type=int, default=8, help="sibling reasoning branches (default 8)")
    ask.add_argument("--model", default=None, help="local Hugging Face model directory (default: embedded SmolLM2-135M-Instruct)")
    ask.add_argument("--shots", type=int, default=8, help="worked examples in the prompt (default 8)")
    ask.add_argument("--shots-from", default=None, help="GSM8K-format JSONL to take the examples from (default: built-in synthetic set)")
    ask.add_argument("--temperature", type=float, default=0.7)
    ask.add_argument("--top-p", type=float, default=0.95)
    ask.add_argument("--max-new-tokens", type=int, default=160)
    ask.add_argument("--seed", type=int, default=0)
    ask.add_argument("--device", default="auto")
    ask.add_argument("--dtype", default="auto")
    ask.add_argument("--no-cgee", action="store_true", help="always run the verifier at full depth")
    ask.add_argument("--json", action="store_true", help="print the result as JSON")
    ask.set_defaults(func=_ask)
    bench = sub.add_parser("bench", help="measure rksc against no reuse, token-exact caching and langchain-huggingface")
    _add_bench_arguments(bench)
    return parser


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    # The bench front-end drives langchain-huggingface as a baseline, so it lives outside the engine
    # package and is imported only when asked for.
    from rksc_bench.cli import add_arguments, run

    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as exc:
        print(f"rksc: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
