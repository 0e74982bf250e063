"""Benchmark: independent chat requests on rksc against ``transformers``' continuous batching.

``--requests`` single-branch greedy chat turns (the prompts of ``batch_curve.py``,
``rksc_bench.prompts.essay_chat``), up to
``--max-new-tokens`` each, all submitted at once: to ``RKSCEngine.submit``, and as one
``model.generate_batch`` call (``transformers``' continuous batching with paged attention) on a
second copy of the same weights, and as one ``model.generate`` call on the prompts left-padded into
a static batch. Arms alternate, the prefix cache is cleared before each rksc run,
and tokens/s counts the tokens each side generated. It also reports how many requests decoded the
same tokens on both sides.

    flock /tmp/rksc-bench.lock ./dev python benchmarks/vs_generate_batch.py
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from rksc_bench import harness
from rksc_bench.prompts import essay_chat
from rksc_engine import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_count("--requests", 16, "independent requests")
    parser.add_max_new_tokens(64, "tokens per request")
    parser.add_repeats(2)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    harness.start_run(args)
    engine = harness.load_engine(args)
    model_dir = engine.model.config._name_or_path
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=engine.dtype).eval()
    prompts = [engine.encode_chat(essay_chat(i)) for i in range(args.requests)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    eos = sorted(engine.runner.eos_token_ids)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos[0])

    def run_rksc() -> list[list[int]]:
        engine.clear_cache()
        handles = [engine.submit(list(p), 1, params) for p in prompts]
        return [list(h.result()[0].token_ids) for h in handles]

    def run_hf() -> list[list[int]]:
        with torch.inference_mode():
            outputs = hf_model.generate_batch(inputs=[list(p) for p in prompts], generation_config=config,
                                              progress_bar=False)
        ordered = sorted(outputs.values(), key=lambda o: int(str(o.request_id).rsplit("_", 1)[-1]))
        return [[t for t in o.generated_tokens if t not in eos] for o in ordered]

    def run_generate() -> list[list[int]]:
        # The prompts left-padded into one static batch, as a pipeline batching its calls would run them.
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[eos[0]] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=mask, generation_config=config)
        rows = []
        for row in out[:, width:].tolist():
            rows.append(row[:next((i for i, t in enumerate(row) if t in eos), len(row))])
        return rows

    arms = {"rksc": run_rksc, "transformers generate_batch": run_hf, "transformers generate, padded batch": run_generate}
    for arm in arms.values():  # warm up both, untimed
        arm()
    timings = harness.side_by_side(arms, args.repeats)
    tokens = {name: timing.result for name, timing in timings.items()}
    rksc_tokens = [[t for t in seq if t not in eos] for seq in tokens["rksc"]]
    same = sum(a == b for a, b in zip(rksc_tokens, tokens["transformers generate_batch"]))
    report = {"requests": args.requests, "max_new_tokens": args.max_new_tokens, "same_tokens": same, "arms": {}}
    print(f"{args.requests} independent greedy chat requests, up to {args.max_new_tokens} new tokens each\n")
    print("| arm | median wall s | generated tokens | tok/s |\n|---|---:|---:|---:|")
    for name in arms:
        count = sum(len(seq) for seq in tokens[name])
        wall = timings[name].median_s
        report["arms"][name] = {"wall_s": wall, "generated_tokens": count, "tok_s": count / wall,
                                "runs": timings[name].runs_s}
        print(f"| {name} | {wall:.2f} | {count} | {count / wall:.1f} |")
    ratio = report["arms"]["rksc"]["tok_s"] / report["arms"]["transformers generate_batch"]["tok_s"]
    report["ratio"] = ratio
    padded = report["arms"]["rksc"]["tok_s"] / report["arms"]["transformers generate, padded batch"]["tok_s"]
    report["ratio_padded_generate"] = padded
    print(f"\nrksc / transformers generate_batch (tok/s): {ratio:.2f}x; same tokens: {same}/{args.requests}")
    print(f"rksc / transformers generate on one padded batch (tok/s): {padded:.2f}x")
    harness.write_json(args.json_out, report)


if __name__ == "__main__":
    main()
