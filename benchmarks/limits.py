"""Benchmark: how far decode and prefill are from this machine's own limits, ours vs plain ``transformers``.

Everything is measured in one run on the default model (or ``--model``), arms interleaved within
each repeat so machine drift hits all alike:

* The machine: streaming-read memory bandwidth (``sum`` over a buffer far larger than the caches)
  and the dense matmul ceiling (a prefill-shaped GEMM) in float32 and, where the CPU has native
  bf16, in bfloat16.
* Three floors of one decode step. Bandwidth: the model's weight bytes read once at that
  bandwidth (the issue's floor). Roofline: the larger of that and the step's matmul FLOPs at the
  float32 ceiling; at 8 branches the FLOPs bind. Kernel: the step's own matmuls (every linear layer
  at ``(n, in_features)``, the LM head) and its attention over the prompt's KV, timed alone with
  nothing around them: what PyTorch's CPU kernels on this machine need before any glue, Python or
  cache bookkeeping, so ``ms/step / kernel floor`` is the overhead that is ours to remove.
* Decode ms/step over a ~1,300-token prompt at 1 and ``--branches`` branches: one step is a model
  forward plus choosing the next tokens (temperature 0.7, top-p 0.95), for ``rksc`` (shared-prefix
  path), ``rksc old path`` (``decode_attention="dynamic_cache"``, the engine before shared-prefix decoding) and
  plain ``transformers`` (a ``DynamicCache`` with the prompt repeated per branch plus its own
  temperature/top-p warpers and ``torch.multinomial``, which is what ``generate`` does per step).
  Each is also a ratio to the floor.
* Prefill tokens/s of the prompt (engine, cold cache) vs plain ``model(prompt)``, and vs the ceiling
  (matmul GFLOP/s divided by the prefill's FLOPs per token).
* The end-to-end 8-branch ratio of the engine-core benchmark (``benchmarks/branches.py``): wall time
  of ``model.generate(num_return_sequences=8)`` over ``generate_branches``, with the old path (before)
  and the new one (after).
* With native bf16: the shared-prefix decode step and the prefill in bf16, and greedy agreement of
  bf16 with float32 (tokens until the first difference).

Timings are the minimum over repeats (the least-disturbed run on a shared machine) with the median
alongside. Run it:

    flock /tmp/rksc-bench.lock ./dev python benchmarks/limits.py
    ./dev python benchmarks/limits.py --repeats 5 --steps 8 --skip-e2e
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm.auto import tqdm

from rksc_bench import harness
from rksc_bench.branch_runs import TEMPERATURE, TOP_P, run_hf_batched, run_rksc
from rksc_bench.prompts import few_shot_prompt_ids
from rksc_engine import EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.evaluation.workloads import synthetic_problems
from rksc_engine.kvcache.batch_decode import BatchDecodeCache
from rksc_engine.kvcache.shared_prefix import ATTENTION_NAME, SharedPrefixCache, attention_implementation
from rksc_engine.runtime.loading import cpu_supports_bf16
from rksc_engine.runtime.sampling import choose_next_tokens, make_generators


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_count("--branches", 8, "branches of the multi-branch arms")
    parser.add_count("--prompt-tokens", 1300, "prompt length to reach")
    parser.add_count("--steps", 6, "timed decode steps per arm and repeat")
    parser.add_repeats(3, "interleaved repeats")
    parser.add_count("--e2e-max-new-tokens", 32, "tokens per branch end to end")
    parser.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end before/after arms")
    parser.add_argument("--skip-bf16", action="store_true", help="skip the bf16 arms")
    parser.add_threads()
    return parser.parse_args(argv)


# -- the machine ---------------------------------------------------------------------------------
def best_seconds(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def memory_bandwidth_gb_s(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Streaming read bandwidth: bytes / best time of one ``sum`` over a ``num_bytes`` buffer."""
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32)
    seconds = best_seconds(lambda: buffer.sum(), repeats)
    return num_bytes / seconds / 1e9


def matmul_gflop_s(dtype: torch.dtype, m: int = 1024, k: int = 1024, n: int = 1536, repeats: int = 5) -> float:
    """Dense matmul throughput of a prefill-shaped (tokens x hidden) @ (hidden x out) product."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    seconds = best_seconds(lambda: a @ b, repeats)
    return 2 * m * k * n / seconds / 1e9


def weight_bytes(model) -> int:
    """Bytes of the model's parameters, tied tensors counted once."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def kv_bytes_per_token(model) -> int:
    cfg = model.config.get_text_config()
    head_dim = head_dim_of(cfg)
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * next(model.parameters()).element_size()


def prefill_flops_per_token(model, num_tokens: int) -> float:
    """Matmul FLOPs per prompt token: 2 per weight of the decoder layers, plus causal attention
    (QK^T and PV over on average half the prompt); the LM head runs for the last token only."""
    cfg = model.config.get_text_config()
    layer_params = sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2)
    head_dim = head_dim_of(cfg)
    attention = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * (num_tokens / 2)
    return 2 * layer_params + attention


def decode_flops(model, n: int, num_prompt_tokens: int) -> float:
    """Matmul FLOPs of one decode step of ``n`` branches: 2 per weight of every linear layer (the LM
    head included, it runs for every branch) per branch, plus attention over the prompt."""
    cfg = model.config.get_text_config()
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = head_dim_of(cfg)
    attention = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * num_prompt_tokens
    return n * (2 * linear_params + attention)


def kernel_floor_seconds(model, n: int, num_prompt_tokens: int, repeats: int) -> float:
    """What this machine's kernels need for one decode step with no glue around them: every linear
    layer of the model, in forward order, on an (n, in_features) input, the LM head, and each
    layer's attention of n queries over the prompt's KV (the fused kernel the shared-prefix path
    uses). Weights are the model's own, so they stream from memory as they do in a real step."""
    cfg = model.config.get_text_config()
    head_dim = head_dim_of(cfg)
    kv_heads, group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    layers = [[m for m in layer.modules() if isinstance(m, torch.nn.Linear)] for layer in model.model.layers]
    inputs = {m.in_features: torch.randn(n, m.in_features, dtype=dtype, device=device)
              for block in layers for m in block}
    inputs.setdefault(model.lm_head.in_features,
                      torch.randn(n, model.lm_head.in_features, dtype=dtype, device=device))
    prompt_kv = [torch.randn(2, 1, kv_heads, num_prompt_tokens, head_dim, dtype=dtype, device=device)
                 for _ in layers]
    query = torch.randn(1, kv_heads, n * group, head_dim, dtype=dtype, device=device)

    def step() -> None:
        for block, (keys, values) in zip(layers, prompt_kv):
            for linear in block:
                linear(inputs[linear.in_features])
            fused_attention(query, keys, values, head_dim**-0.5)
        model.lm_head(inputs[model.lm_head.in_features])

    return best_seconds(step, repeats)


def fused_attention(query, keys, values, scale):
    from rksc_engine.kvcache.split_attention import fused_cpu_attention, partial_attention

    return fused_cpu_attention(query, keys, values, scale) or partial_attention(query, keys, values, scale)


# -- decode steps ----------------------------------------------------------------------------------
def hf_sample_step(logits: torch.Tensor, warpers) -> torch.Tensor:
    scores = logits.float()
    for warper in warpers:
        scores = warper(None, scores)
    return torch.multinomial(scores.softmax(dim=-1), 1)[:, 0]


def time_engine_steps(engine: RKSCEngine, prompt_ids: list[int], n: int, steps: int) -> list[float]:
    """Per-step seconds of the engine's own decode loop body: choose tokens, then one forward."""
    params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, seed=0)
    # The scheduler's decode step for one request, built from the same public pieces it uses: the
    # prompt's KV shared by the n branches, seen by the forward as a one-request BatchDecodeCache.
    prefilled = engine.prefill(prompt_ids)
    plain = engine.config.decode_attention == "dynamic_cache"  # the path before shared-prefix decoding
    if plain:
        prefilled.cache.batch_repeat_interleave(n)
    else:
        branches = SharedPrefixCache.from_dynamic_cache(prefilled.cache, n, suffix_capacity=steps + 2)
    logits = prefilled.last_logits.expand(n, -1)
    generators = make_generators(0, n, engine.device)
    times = []
    for _ in range(steps + 1):  # the first step is untimed warm-up
        start = time.perf_counter()
        tokens, _ = choose_next_tokens(logits, params, generators)
        if plain:
            out = engine.forward(tokens[:, None], prefilled.cache)
        else:
            batch = BatchDecodeCache([branches])
            with attention_implementation(engine.model, ATTENTION_NAME):
                out = engine.forward(tokens[:, None], batch, position_ids=batch.position_ids(engine.device),
                                     **batch.forward_kwargs())
        logits = out.logits[:, -1, :]
        times.append(time.perf_counter() - start)
    return times[1:]


def time_hf_steps(model, prompt_ids: list[int], n: int, steps: int) -> list[float]:
    """Per-step seconds of plain transformers: DynamicCache repeated per branch, its own warpers."""
    from transformers import DynamicCache
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    warpers = [TemperatureLogitsWarper(TEMPERATURE), TopPLogitsWarper(TOP_P)]
    ids = torch.tensor([prompt_ids], device=model.device)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    cache.batch_repeat_interleave(n)
    logits = logits.expand(n, -1)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        tokens = hf_sample_step(logits, warpers)
        logits = model(input_ids=tokens[:, None], cache=cache, use_cache=True).logits[:, -1]
        times.append(time.perf_counter() - start)
    return times[1:]


def time_prefill(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def greedy_agreement(fp32: RKSCEngine, bf16: RKSCEngine, prompt_ids: list[int], max_new: int) -> tuple[int, int]:
    """Greedy tokens until bf16 first differs from float32, and the float32 length."""
    want = fp32.generate(prompt_ids, SamplingParams(max_new_tokens=max_new)).token_ids
    got = bf16.generate(prompt_ids, SamplingParams(max_new_tokens=max_new)).token_ids
    same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    return same, len(want)


# -- main ----------------------------------------------------------------------------------------
def summary(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "n": len(values)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    harness.start_run(args)
    torch.manual_seed(0)
    engine = harness.load_engine(args)
    old = RKSCEngine(engine.model, engine.tokenizer, EngineConfig(decode_attention="dynamic_cache"))
    model = engine.model
    prompt_ids, _ = few_shot_prompt_ids(engine, synthetic_problems(400, 0), args.prompt_tokens)
    n_branches = args.branches
    bf16_native = cpu_supports_bf16() and not args.skip_bf16 and engine.device.type == "cpu"
    bf16 = None
    if bf16_native:
        import copy

        bf16 = RKSCEngine(copy.deepcopy(model).to(torch.bfloat16), engine.tokenizer)

    print(f"model {engine.model_name}, {engine.dtype}, {torch.get_num_threads()} threads; prompt {len(prompt_ids)} "
          f"tokens; {n_branches} branches; native bf16: {cpu_supports_bf16()}, bf16 arms: {bf16_native}")
    bandwidth = memory_bandwidth_gb_s()
    ceiling = {"float32": matmul_gflop_s(torch.float32)}
    if bf16_native:
        ceiling["bfloat16"] = matmul_gflop_s(torch.bfloat16)
    w_bytes, kv_token = weight_bytes(model), kv_bytes_per_token(model)
    prompt_kv = kv_token * len(prompt_ids)
    floor_ms = w_bytes / bandwidth / 1e6
    print(f"bandwidth {bandwidth:.1f} GB/s; matmul ceiling {ceiling}; weights {w_bytes / 1e6:.0f} MB, "
          f"prompt KV {prompt_kv / 1e6:.1f} MB; bandwidth floor {floor_ms:.1f} ms/step")
    # One step is bounded by reading the weights once (bandwidth) and by its matmul FLOPs at the
    # machine's best GEMM rate (compute); at 8 branches the second can be the larger.
    compute_floor_ms = {n: decode_flops(model, n, len(prompt_ids)) / (ceiling["float32"] * 1e9) * 1e3
                        for n in (1, n_branches)}
    with torch.inference_mode():
        kernel_floor_ms = {n: kernel_floor_seconds(model, n, len(prompt_ids), 3 * args.repeats) * 1e3
                           for n in (1, n_branches)}
    print(f"compute floor (FLOPs / float32 ceiling) {compute_floor_ms} ms/step; kernel floor (the step's "
          f"matmuls and attention alone) {kernel_floor_ms} ms/step")

    decode: dict[str, list[float]] = {}
    prefill: dict[str, list[float]] = {}
    e2e: dict[str, list[float]] = {}
    e2e_tokens: dict[str, list[int]] = {}

    def add(store, key, values):
        store.setdefault(key, []).extend(values if isinstance(values, list) else [values])

    with torch.inference_mode():
        for _ in tqdm(range(args.repeats), desc="repeats"):
            for n in (1, n_branches):
                engine.clear_cache()
                old.clear_cache()
                add(decode, f"rksc n={n}", time_engine_steps(engine, prompt_ids, n, args.steps))
                add(decode, f"rksc old path n={n}", time_engine_steps(old, prompt_ids, n, args.steps))
                add(decode, f"transformers n={n}", time_hf_steps(model, prompt_ids, n, args.steps))
                if bf16 is not None and n == n_branches:
                    bf16.clear_cache()
                    add(decode, f"rksc bf16 n={n}", time_engine_steps(bf16, prompt_ids, n, args.steps))
            engine.clear_cache()
            add(prefill, "rksc", time_prefill(lambda: engine.warm_cache(prompt_ids)))
            ids = torch.tensor([prompt_ids], device=engine.device)
            add(prefill, "transformers", time_prefill(lambda ids=ids: model(input_ids=ids, logits_to_keep=1)))
            if bf16 is not None:
                bf16.clear_cache()
                add(prefill, "rksc bf16", time_prefill(lambda: bf16.warm_cache(prompt_ids)))
            if not args.skip_e2e:
                params = SamplingParams(max_new_tokens=args.e2e_max_new_tokens, temperature=TEMPERATURE,
                                        top_p=TOP_P, seed=0)
                for name, eng in (("rksc before (old path)", old), ("rksc after", engine)):
                    eng.clear_cache()
                    run = run_rksc(eng, prompt_ids, n_branches, params)
                    add(e2e, name, run.wall_s)
                    add(e2e_tokens, name, run.generated_tokens)
                run = run_hf_batched(model, ids, n_branches, args.e2e_max_new_tokens, 0)
                add(e2e, "HF num_return_sequences", run.wall_s)
                add(e2e_tokens, "HF num_return_sequences", run.generated_tokens)
        agreement = greedy_agreement(engine, bf16, prompt_ids, 64) if bf16 is not None else None

    # -- report ----------------------------------------------------------------------------------
    print("\n| decode arm | ms/step min | ms/step median | bandwidth floor | / bandwidth floor | roofline floor "
          "| / roofline floor | kernel floor | / kernel floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for key, values in decode.items():
        n = int(key.rsplit("=", 1)[1])
        s = summary([v * 1000 for v in values])
        bf16_arm = "bf16" in key
        bytes_scale = 0.5 if bf16_arm else 1.0
        floor = floor_ms * bytes_scale
        roofline = max(floor, compute_floor_ms[n] * (ceiling["float32"] / ceiling.get("bfloat16", 1) if bf16_arm else 1))
        kernel = None if bf16_arm else kernel_floor_ms[n]  # the kernel floor is timed in float32
        rows[key] = {**s, "floor_ms": floor, "ratio_to_floor": s["min"] / floor, "roofline_floor_ms": roofline,
                     "ratio_to_roofline": s["min"] / roofline, "kernel_floor_ms": kernel,
                     "ratio_to_kernel_floor": None if kernel is None else s["min"] / kernel}
        kernel_cells = "- | -" if kernel is None else f"{kernel:.1f} | {s['min'] / kernel:.2f}x"
        print(f"| {key} | {s['min']:.1f} | {s['median']:.1f} | {floor:.1f} | {s['min'] / floor:.2f}x | {roofline:.1f} "
              f"| {s['min'] / roofline:.2f}x | {kernel_cells} |")
    print("\n| prefill arm | tokens/s (best) | tokens/s (median) | ceiling tokens/s | ratio to ceiling |")
    print("|---|---:|---:|---:|---:|")
    flops = prefill_flops_per_token(model, len(prompt_ids))
    prefill_rows = {}
    for key, values in prefill.items():
        ceil = ceiling["bfloat16" if "bf16" in key else "float32"] * 1e9 / flops
        best, med = len(prompt_ids) / min(values), len(prompt_ids) / statistics.median(values)
        prefill_rows[key] = {"best_tok_s": best, "median_tok_s": med, "ceiling_tok_s": ceil}
        print(f"| {key} | {best:.0f} | {med:.0f} | {ceil:.0f} | {ceil / best:.2f}x |")
    e2e_rows = {}
    if e2e:
        hf = e2e["HF num_return_sequences"]
        print(f"\n| end to end, {n_branches} branches x {args.e2e_max_new_tokens} tokens | wall s (min) | wall s (median) "
              "| HF time / this arm (medians) | generated tokens (median) |")
        print("|---|---:|---:|---:|---:|")
        for key, values in e2e.items():
            ratio = statistics.median(hf) / statistics.median(values)
            e2e_rows[key] = {**summary(values), "hf_over_arm": ratio}
            print(f"| {key} | {min(values):.2f} | {statistics.median(values):.2f} | {ratio:.2f}x "
                  f"| {statistics.median(e2e_tokens[key]):.0f} |")
    if agreement is not None:
        print(f"\nbf16 vs float32 greedy: first {agreement[0]} of {agreement[1]} tokens identical")
    harness.write_json(args.json_out, {
        "setup": {"model": engine.model_name, "prompt_tokens": len(prompt_ids), "branches": n_branches,
                  "threads": torch.get_num_threads(), "repeats": args.repeats, "steps": args.steps,
                  "bf16_native": bf16_native},
        "machine": {"bandwidth_gb_s": bandwidth, "matmul_gflop_s": ceiling, "weight_bytes": w_bytes,
                    "prompt_kv_bytes": prompt_kv, "floor_ms": floor_ms,
                    "compute_floor_ms": compute_floor_ms, "kernel_floor_ms": kernel_floor_ms},
        "decode_ms": rows, "prefill": prefill_rows, "end_to_end": e2e_rows,
        "bf16_greedy_agreement": agreement,
    })
    print(f"\nwrote {args.json_out}")


if __name__ == "__main__":
    main()
