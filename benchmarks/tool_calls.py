"""Forced tool calls on the default model: token-masked values vs scaffold-and-coerce only.

Both arms write the same JSON scaffold and coerce every value to its schema type
(``rksc_engine.structured.tools.decode_tool_call``); the masked arm also restricts each value's tokens to those
that can continue a value of its type. Two tasks, each question asked to both arms in alternating
order on the same engine:

    * add: "What is A plus B?" with ``add(a: int, b: int)``; correct when {a, b} = {A, B}.
    * colour: "The X is C. What colour is the X?" with ``paint(colour: enum)``; correct when colour = C.

Prints per arm and task: correct calls, mean wall time per call with its ratio to unmasked, and the
seconds spent inside the mask hooks (``ConstrainedResult.mask_s``) as a share of the masked calls'
time. Wall times on a shared machine are noisy (the order alternates per question to spread that);
the hook time is the mask's own cost.

    flock /tmp/rksc-bench.lock ./dev python benchmarks/tool_calls.py --questions 12
"""

from __future__ import annotations

import random
import time

from tqdm import tqdm

from rksc_bench import harness
from rksc_engine import SamplingParams
from rksc_engine.structured import tools as T

COLOURS = ["red", "green", "blue", "yellow", "black", "white"]
OBJECTS = ["door", "car", "kite", "cup", "hat", "boat", "fence", "chair"]
ADD = {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
PAINT = {"name": "paint", "description": "Record the colour of an object.", "parameters": {
    "type": "object", "properties": {"colour": {"enum": COLOURS}}, "required": ["colour"]}}


def questions(n: int, seed: int) -> list[tuple[str, str, dict, object]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            out.append(("add", f"What is {a} plus {b}?", ADD, {a, b}))
        else:
            thing, colour = rng.choice(OBJECTS), rng.choice(COLOURS)
            out.append(("colour", f"The {thing} is {colour}. What colour is the {thing}?", PAINT, colour))
    return out


def correct(task: str, arguments: dict, expected: object) -> bool:
    if task == "add":
        return {arguments.get("a"), arguments.get("b")} == expected
    return arguments.get("colour") == expected


def main(argv: list[str] | None = None) -> None:
    parser = harness.bench_parser(__file__, __doc__, json_out="optional")
    parser.add_count("--questions", 12)
    parser.add_seed(0, "seed of the questions")
    args = parser.parse_args(argv)
    harness.start_run(args)
    engine = harness.load_engine(args, progress=False)
    params = SamplingParams(max_new_tokens=24)
    # Outside the timings: warm both arms up on questions not asked, which also builds the token index
    # and its per-kind masks once (about 0.2 s the first time a mask kind is used).
    for tool, question in ((ADD, "What is 1 plus 1?"), (PAINT, "The sun is yellow. What colour is the sun?")):
        warm = T.ToolRequest.build([tool], "any")
        warm_ids = T.encode_with_tools(engine, [{"role": "user", "content": question}], warm)
        for masked in (True, False):
            T.decode_tool_call(engine, warm_ids, params, warm, token_masks=masked)
    results: dict[tuple[str, bool], list[tuple[bool, float, float]]] = {}
    for i, (task, question, tool, expected) in enumerate(tqdm(questions(args.questions, args.seed), desc="questions")):
        request = T.ToolRequest.build([tool], "any")
        ids = T.encode_with_tools(engine, [{"role": "user", "content": question}], request)
        for masked in ((True, False) if i % 4 < 2 else (False, True)):
            start = time.perf_counter()
            result = T.decode_tool_call(engine, ids, params, request, token_masks=masked)
            seconds = time.perf_counter() - start
            ok = correct(task, result.tool_calls[0].arguments, expected)
            results.setdefault((task, masked), []).append((ok, seconds, result.mask_s))
            tqdm.write(f"q{i} {task} {'masked' if masked else 'unmasked'}: {result.tool_calls[0].arguments} "
                       f"correct={ok} {seconds:.2f}s mask_hooks={result.mask_s * 1000:.1f}ms")
    print(f"\n{'task':<8} {'arm':<10} {'correct':>9} {'s/call':>8} {'time vs unmasked':>17} {'mask hooks':>11}")
    table = []
    for task in ("add", "colour"):
        base = sum(s for _, s, _ in results[(task, False)]) / len(results[(task, False)])
        for masked in (False, True):
            rows = results[(task, masked)]
            mean = sum(s for _, s, _ in rows) / len(rows)
            hits = sum(ok for ok, _, _ in rows)
            share = sum(m for _, _, m in rows) / sum(s for _, s, _ in rows)
            table.append({"task": task, "masked": masked, "correct": hits, "calls": len(rows), "mean_s": mean,
                          "time_vs_unmasked": mean / base, "mask_hook_share": share})
            print(f"{task:<8} {'masked' if masked else 'unmasked':<10} {hits:>4}/{len(rows):<4} {mean:>8.3f} "
                  f"{mean / base:>16.2f}x {share:>10.1%}")
    if args.json_out:
        harness.write_json(args.json_out, {"questions": args.questions, "seed": args.seed, "rows": table})


if __name__ == "__main__":
    main()
