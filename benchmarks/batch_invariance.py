"""Benchmark: does a request's output depend on its batch? Bits of the matmuls, then tokens.

Two measurements on the model's own weight shapes:

* ``gemm``: one row multiplied by each linear layer's weight inside batches of ``M`` rows, for M from
  1 to 128. Rows of batches in the same class give identical bits; the classes are printed. The
  batched decode puts every running row of every request in one matmul, so a row's class changes
  with the number of rows it runs among.
* ``tokens``: ``--requests`` greedy chat requests decoded alone, in batches of 4, and all together,
  and one request's ``--branches`` sampled branches (seeds ``s, s + 1, ...``) against each branch
  decoded alone. It counts the requests and branches whose tokens differ, and where they first do.

    flock /tmp/rksc-bench.lock ./dev python benchmarks/batch_invariance.py
"""

from __future__ import annotations

import argparse

import torch

from rksc_bench import harness
from rksc_bench.prompts import essay_chat
from rksc_engine import RKSCEngine, SamplingParams

BATCH_ROWS = (1, 2, 3, 4, 5, 8, 9, 12, 15, 16, 17, 24, 32, 48, 64, 128)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_count("--requests", 24, "greedy chat requests")
    parser.add_count("--branches", 16, "sampled branches of one request")
    parser.add_max_new_tokens(64, "tokens per request")
    return parser.parse_args(argv)


def gemm_classes(weight: torch.Tensor) -> list[list[int]]:
    """Batch sizes grouped by the bits they give one fixed row of ``x @ weight.T``."""
    generator = torch.Generator().manual_seed(0)
    row = torch.randn(1, weight.shape[1], generator=generator, dtype=weight.dtype)
    classes: list[tuple[torch.Tensor, list[int]]] = []
    with torch.inference_mode():
        for rows in BATCH_ROWS:
            others = torch.randn(rows - 1, weight.shape[1], generator=generator, dtype=weight.dtype)
            out = torch.nn.functional.linear(torch.cat([row, others]), weight)[:1]
            for bits, members in classes:
                if torch.equal(bits, out):
                    members.append(rows)
                    break
            else:
                classes.append((out, [rows]))
    return [members for _, members in classes]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_tokens(engine: RKSCEngine, count: int, group: int, params: SamplingParams) -> list[list[int]]:
    tokens: list[list[int]] = []
    for start in range(0, count, group):
        engine.clear_cache()
        handles = [engine.submit(essay_chat(i), 1, params) for i in range(start, min(count, start + group))]
        tokens += [h.result()[0].token_ids for h in handles]
    return tokens


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    harness.start_run(args)
    engine = harness.load_engine(args)
    report: dict = {"gemm": {}, "tokens": {}}
    seen_shapes = set()
    print("| weight (out x in) | batch sizes whose bits agree for a row |\n|---|---|")
    for name, module in engine.runner.model.named_modules():
        if isinstance(module, torch.nn.Linear) and tuple(module.weight.shape) not in seen_shapes:
            seen_shapes.add(tuple(module.weight.shape))
            classes = gemm_classes(module.weight.detach())
            report["gemm"][name] = {"shape": list(module.weight.shape), "classes": classes}
            print(f"| {module.weight.shape[0]} x {module.weight.shape[1]} (`{name}`) | "
                  + " · ".join("{" + ", ".join(map(str, c)) + "}" for c in classes) + " |", flush=True)

    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    alone = greedy_tokens(engine, args.requests, 1, params)
    print("\n| decoded | requests whose tokens differ from alone | first differing token |\n|---|---:|---|")
    for group in sorted({4, args.requests}):
        got = greedy_tokens(engine, args.requests, group, params)
        differ = [i for i in range(args.requests) if got[i] != alone[i]]
        firsts = [first_difference(got[i], alone[i]) for i in differ]
        report["tokens"][f"greedy_batches_of_{group}"] = {"differ": len(differ), "of": args.requests, "first": firsts}
        print(f"| greedy, batches of {group} | {len(differ)}/{args.requests} | {firsts or '-'} |", flush=True)

    seed = 7
    sampled = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.8, seed=seed)
    engine.clear_cache()
    together = engine.submit(essay_chat(0), args.branches, sampled).result()
    differ, firsts = 0, []
    for branch in range(args.branches):
        engine.clear_cache()
        one = engine.submit(essay_chat(0), 1, SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.8,
                                                       seed=seed + branch)).result()[0]
        if one.token_ids != together[branch].token_ids:
            differ += 1
            firsts.append(first_difference(one.token_ids, together[branch].token_ids))
    report["tokens"]["sampled_branches"] = {"differ": differ, "of": args.branches, "first": firsts}
    print(f"| sampled, {args.branches} siblings vs each alone | {differ}/{args.branches} | {firsts or '-'} |")
    harness.write_json(args.json_out, report)


if __name__ == "__main__":
    main()
