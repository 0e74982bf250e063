"""Benchmark: the family matrix, one row per model family (tiny seeded random configs from
``rksc_bench.families``; no weights needed).

For each family:

* **exact**: greedy decoding equals ``model.generate``, cold and served from the cache, and a
  seeded branch is the same among its siblings as alone;
* **reuse**: prompt tokens served from the cache when a ~500-token prompt is sent again;
* **batched decode**: whether concurrent requests decode in one forward (and why not, if not);
* **tok/s**: 8 concurrent greedy requests (``--max-new-tokens`` each) on rksc against the same
  model's ``transformers`` ``generate_batch`` (continuous batching) and ``generate`` on the 8
  prompts left-padded into one batch, arms alternating, median of ``--repeats``; tokens counted as
  each side generated them (up to EOS). The 8 requests are submitted together and this thread
  runs rksc's steps (inside ``exclusive()``), as it runs ``transformers``' arms: with
  ``--engine-thread`` the engine's own thread runs them, and the two threads' OpenMP teams and
  allocators meet on this machine's 2 cores.

    flock /tmp/rksc-bench.lock ./dev python benchmarks/families.py
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings

import torch
from transformers import GenerationConfig

from rksc_bench import harness
from rksc_bench.families import FAMILIES, char_tokenizer, make_family_model
from rksc_engine import EngineConfig, RKSCEngine, SamplingParams

# rksc's arms: the engine's settings for each.
ENGINE_ARMS = {
    "rksc": EngineConfig(),
    "static": EngineConfig(decode_attention="static_rows"),
    "compiled": EngineConfig(decode_capture="compile"),
}
REPEATED_PROMPT = ("System: you are a careful assistant. Use the context.\nContext: "
                   + "the river runs north past the old mill and the stone bridge. " * 7 + "\nQ: which way? A:")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__, model=False)  # tiny seeded models, no weights
    parser.add_argument("--families", nargs="*", default=None, help="family names (default: all)")
    parser.add_max_new_tokens(32, "tokens per request")
    parser.add_repeats(2)
    parser.add_argument("--arms", default="rksc,static,generate_batch,generate",
                        help="comma-separated, of rksc (the default layout), static (decode_attention='static_rows'), "
                             "compiled (decode_capture='compile'; each family compiles once, slow), generate_batch, "
                             "generate (default rksc,static,generate_batch,generate)")
    parser.add_argument("--engine-thread", action="store_true",
                        help="run rksc's steps on the engine's own thread, as a server's requests run, instead of "
                             "on the benchmark's thread, where transformers' arms run too (see docs/bench/families.md)")
    args = parser.parse_args(argv)
    args.arms = args.arms.split(",")
    unknown = set(args.arms) - set(ENGINE_ARMS) - {"generate_batch", "generate"}
    if unknown or "rksc" not in args.arms:
        parser.error(f"--arms must include rksc and be of rksc, static, compiled, generate_batch, generate; got {args.arms}")
    return args


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> tuple[int, ...]:
    tensor = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=max_new_tokens,
                             do_sample=False)
    return tuple(out[0, len(ids):].tolist())


def measure(name: str, tokenizer, args: argparse.Namespace) -> dict:
    model = make_family_model(name)
    engine = RKSCEngine(model, tokenizer)
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens)
    ids = engine.encode(REPEATED_PROMPT)
    want = hf_greedy(model, ids, args.max_new_tokens)
    cold = engine.generate(ids, greedy)
    warm = engine.generate(ids, greedy)
    sampled = SamplingParams(max_new_tokens=16, temperature=0.9, seed=5)
    siblings = engine.generate_branches(ids, 4, sampled)
    alone = RKSCEngine(model, tokenizer).generate(ids, SamplingParams(max_new_tokens=16, temperature=0.9, seed=7))
    exact = cold.token_ids == want and warm.token_ids == want and siblings[2].token_ids == alone.token_ids

    prompts = [engine.encode(f"Request {i}: " + "tell me about the mill. " * (2 + i)) for i in range(8)]
    eos = sorted(engine.runner.eos_token_ids)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos[0])

    def rksc_arm(on: RKSCEngine):
        def run() -> int:
            on.clear_cache()
            # Held, all 8 are submitted before the first step, and this thread runs the steps.
            with contextlib.nullcontext() if args.engine_thread else on.exclusive():
                handles = [on.submit(list(p), 1, greedy) for p in prompts]
                return sum(len(h.result()[0].token_ids) for h in handles)
        return run

    run_rksc = rksc_arm(engine)

    def run_hf() -> int:
        with torch.inference_mode():
            outputs = model.generate_batch(inputs=[list(p) for p in prompts], generation_config=config,
                                           progress_bar=False)
        count = sum(len([t for t in o.generated_tokens if t not in eos]) for o in outputs.values())
        if not count:  # it logs a failed generation and returns empty outputs
            raise RuntimeError("generate_batch generated no tokens (see its log)")
        return count

    def run_generate() -> int:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[eos[0]] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])
        count = 0
        for row in out[:, width:].tolist():
            count += next((i for i, t in enumerate(row) if t in eos), len(row))
        return count

    engine.reset_stats()
    run_rksc()
    refusal = engine.stats().batched_decode_refusal
    batched = not refusal
    arms = {"rksc": run_rksc, "generate_batch": run_hf, "generate": run_generate}
    for arm_name in ("static", "compiled"):
        if arm_name in args.arms:
            arms[arm_name] = rksc_arm(RKSCEngine(model, tokenizer, ENGINE_ARMS[arm_name]))
    arms = {arm_name: arm for arm_name, arm in arms.items() if arm_name in args.arms}
    errors: dict[str, str] = {}
    for arm_name, arm in list(arms.items()):  # warm up, untimed; an arm that fails is reported, not timed
        try:
            arm()
        except Exception as error:  # noqa: BLE001 - a family transformers' continuous batching cannot run
            errors[arm_name] = f"{type(error).__name__}: {str(error)[:120]}"
            del arms[arm_name]
    timings = harness.side_by_side(arms, args.repeats)
    tok_s = {arm_name: timing.result / timing.median_s for arm_name, timing in timings.items()}
    return {
        "family": name, "exact": exact, "prompt_tokens": len(ids), "reused_tokens": warm.num_cached_tokens,
        "batched_decode": batched, "batched_decode_refusal": refusal,
        "prefix_cache_refusal": engine.stats().prefix_cache_refusal, "tok_s": tok_s, "errors": errors,
        "ratio": tok_s["rksc"] / tok_s["generate_batch"] if "generate_batch" in tok_s else None,
        "ratio_generate": tok_s["rksc"] / tok_s["generate"] if "generate" in tok_s else None,
        "ratios_to_generate": {arm_name: value / tok_s["generate"] for arm_name, value in tok_s.items()
                               if "generate" in tok_s and arm_name in ENGINE_ARMS},
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    harness.start_run(args)
    warnings.filterwarnings("ignore")
    tokenizer = char_tokenizer()
    names = args.families or [f.name for f in FAMILIES]
    rows = []
    extra = [arm for arm in ("static", "compiled") if arm in args.arms]
    print("| family | attention | exact | reuse of a repeated prompt | batched decode | rksc tok/s "
          "| generate_batch tok/s | rksc / generate_batch | generate tok/s | rksc / generate |"
          + "".join(f" {arm} tok/s | {arm} / generate |" for arm in extra) + "\n"
          "|---|---|---|---:|---|---:|---:|---:|---:|---:|" + "---:|---:|" * len(extra))
    for name in names:
        attention = next(f.attention for f in FAMILIES if f.name == name)
        row = measure(name, tokenizer, args)
        rows.append(row)

        def cell(arm: str, ratio_key: str, row: dict = row) -> str:
            value = row["tok_s"].get(arm)
            if value is None:
                return "fails | n/a"
            return f"{value:.0f} | {row[ratio_key]:.1f}x"

        print(f"| {name} | {attention} | {'yes' if row['exact'] else 'NO'} "
              f"| {row['reused_tokens']}/{row['prompt_tokens']} | {'yes' if row['batched_decode'] else 'no'} "
              f"| {row['tok_s'].get('rksc', float('nan')):.0f} | {cell('generate_batch', 'ratio')} "
              f"| {cell('generate', 'ratio_generate')} |"
              + "".join(f" {row['tok_s'][arm]:.0f} | {row['ratios_to_generate'].get(arm, float('nan')):.1f}x |"
                        if arm in row["tok_s"] else " fails | n/a |" for arm in extra), flush=True)
    for row in rows:
        for arm_name, error in row["errors"].items():
            print(f"{row['family']}: {arm_name} failed: {error}", file=sys.stderr)
    harness.write_json(args.json_out, {"max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
