"""Benchmark: CGEE's skip and layer exit against always-full verification, on the default model.

For every question the 8 branches are generated once (seeded, so every arm sees the same
branches), then the verification decision is made under each arm:

* ``full``: every candidate verified at full depth (the reference decision);
* ``skip``: CGEE level 1 only;
* ``skip+exit``: level 1 and the level-2 layer exit;
* ``exit``: level 2 only.

Per arm it prints the skip rate, the mean exit layer (of 30), verification time and its ratio to
``full``, the end-to-end time ratio (generation + verification) and the CGEE error rate: decisions
that differ from ``full`` divided by verifier calls of ``full`` (one per question), with its Wilson
95% interval.

    ./dev python benchmarks/cgee.py                      # built-in synthetic questions
    ./dev python benchmarks/cgee.py --data gsm8k.jsonl --questions 50
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm.auto import tqdm

from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.answers import extract_gsm8k_answer
from rksc_engine.cgee import CGEEConfig, wilson_interval
from rksc_engine.datasets import few_shot_messages, load_gsm8k_jsonl, synthetic_problems
from rksc_engine.reasoning import BranchAnswer, verify_and_pick
from rksc_engine.verifier import LLMJudgeVerifier

ARMS = {
    "full": CGEEConfig.off(),
    "skip": CGEEConfig(skip_enabled=True, exit_enabled=False),
    "skip+exit": CGEEConfig(skip_enabled=True, exit_enabled=True),
    "exit": CGEEConfig(skip_enabled=False, exit_enabled=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--data", default=None, help="GSM8K-format JSONL (default: synthetic)")
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--branches", type=int, default=8)
    parser.add_argument("--shots", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json-out", default="benchmarks/results/cgee.json")
    args = parser.parse_args()

    engine = RKSCEngine.from_pretrained(args.model)
    questions = (load_gsm8k_jsonl(args.data, limit=args.questions) if args.data
                 else synthetic_problems(args.questions, seed=1234))
    shots = synthetic_problems(args.shots, seed=1)
    judge = LLMJudgeVerifier(engine)
    params = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=args.max_new_tokens, stop=("<|im_end|>",))
    totals = {arm: {"verify_s": 0.0, "skips": 0, "exit_layers": [], "differ": 0, "correct": 0, "check_s": 0.0}
              for arm in ARMS}
    generate_s = 0.0
    for qi, problem in enumerate(tqdm(questions, desc="questions")):
        start = time.perf_counter()
        completions = engine.generate_branches(few_shot_messages(problem.question, shots), args.branches,
                                               SamplingParams(**{**params.__dict__, "seed": 1000 + qi}))
        generate_s += time.perf_counter() - start
        branches = [BranchAnswer(c.text, extract_gsm8k_answer(c.text), c.confidence) for c in completions]
        decisions = {}
        # Interleaved per question, in an order rotated each question, so drift and the cache
        # warmth the first arm leaves behind do not always favour the same arm.
        names = list(ARMS)
        rotated = names[qi % len(names):] + names[: qi % len(names)]
        for arm, cgee in ((name, ARMS[name]) for name in rotated):
            start = time.perf_counter()
            answer, report, _ = verify_and_pick(problem.question, branches, judge, cgee)
            t = totals[arm]
            t["verify_s"] += time.perf_counter() - start
            t["skips"] += report.skipped
            t["exit_layers"] += [layer for layer in report.exit_layers if layer is not None]
            t["check_s"] += report.check_s
            t["correct"] += answer == problem.answer
            decisions[arm] = answer
        for arm in ARMS:
            totals[arm]["differ"] += decisions[arm] != decisions["full"]

    n = len(questions)
    full_verify = totals["full"]["verify_s"]
    rows = []
    for arm, t in totals.items():
        low, high = wilson_interval(t["differ"], n)
        exits = t["exit_layers"]
        rows.append({
            "arm": arm, "skip_rate": t["skips"] / n,
            "mean_exit_layer": (sum(exits) / len(exits) + 1) if exits else None,
            "verify_s": t["verify_s"], "verify_ratio": t["verify_s"] / full_verify,
            "end_to_end_ratio": (generate_s + t["verify_s"]) / (generate_s + full_verify),
            "check_ms": t["check_s"] * 1000, "errors": t["differ"], "error_rate": t["differ"] / n,
            "wilson_low": low, "wilson_high": high, "accuracy": t["correct"] / n,
        })
    print(f"\n{n} questions x {args.branches} branches, {args.shots}-shot, model {engine.model_name}; "
          f"generation {generate_s:.1f}s in all (shared by every arm)\n")
    print("| arm | skip rate | mean exit layer (of 30) | verify s | verify vs full | end-to-end vs full | "
          "exit-check ms | decisions differing from full | error rate [Wilson 95%] | accuracy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        exit_layer = f"{r['mean_exit_layer']:.1f}" if r["mean_exit_layer"] else "-"
        print(f"| {r['arm']} | {r['skip_rate']:.0%} | {exit_layer} | {r['verify_s']:.2f} | {r['verify_ratio']:.2f}x | "
              f"{r['end_to_end_ratio']:.3f}x | {r['check_ms']:.1f} | {r['errors']}/{n} | "
              f"{r['error_rate']:.1%} [{r['wilson_low']:.1%}, {r['wilson_high']:.1%}] | {r['accuracy']:.0%} |")
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"questions": n, "branches": args.branches, "generate_s": generate_s, "arms": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
