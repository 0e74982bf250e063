"""Benchmark: how far decode and prefill are from this machine's own limits, ours vs plain ``transformers``.

Everything is measured in one run on the default model (or ``--model``), arms interleaved within
each repeat so machine drift hits all alike:

* The machine: streaming-read memory bandwidth (``sum`` over a buffer far larger than the caches)
  and the dense matmul ceiling (a prefill-shaped GEMM) in float32 and, where the CPU has native
  bf16, in bfloat16.
* The floor of one decode step: the model's weight bytes read once at that bandwidth. Reading the
  prompt's KV once more is also shown (the shared-prefix path's own traffic), next to the plain
  path's ``n`` copies.
* Decode ms/step over a ~1,300-token prompt at 1 and ``--branches`` branches: one step is a model
  forward plus choosing the next tokens (temperature 0.7, top-p 0.95), for ``rksc`` (shared-prefix
  path), ``rksc old path`` (``decode_attention="dynamic_cache"``, the engine before issue 8) and
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
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from branches import build_prompt_ids, load_problems, run_hf_batched, run_rksc  # noqa: E402

from rksc_engine import EngineConfig, RKSCEngine, SamplingParams  # noqa: E402
from rksc_engine.loading import cpu_supports_bf16  # noqa: E402
from rksc_engine.sampling import choose_next_tokens, make_generators  # noqa: E402

DEFAULT_JSON_OUT = Path(__file__).resolve().parent / "results" / "limits.json"
TEMPERATURE, TOP_P = 0.7, 0.95


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local HF model directory (default: embedded SmolLM2-135M)")
    parser.add_argument("--branches", type=int, default=8, help="branches of the multi-branch arms (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=1300, help="prompt length to reach (default 1300)")
    parser.add_argument("--steps", type=int, default=6, help="timed decode steps per arm and repeat (default 6)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    parser.add_argument("--e2e-max-new-tokens", type=int, default=32, help="tokens per branch end to end (default 32)")
    parser.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end before/after arms")
    parser.add_argument("--skip-bf16", action="store_true", help="skip the bf16 arms")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON_OUT)
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    for name in ("branches", "prompt_tokens", "steps", "repeats", "e2e_max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


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


def kv_bytes_per_token(model) -> int:
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * next(model.parameters()).element_size()


def prefill_flops_per_token(model, num_tokens: int) -> float:
    """Matmul FLOPs per prompt token: 2 per weight of the decoder layers, plus causal attention
    (QK^T and PV over on average half the prompt); the LM head runs for the last token only."""
    cfg = model.config.get_text_config()
    layer_params = sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * (num_tokens / 2)
    return 2 * layer_params + attention


# -- decode steps ----------------------------------------------------------------------------------
def hf_sample_step(logits: torch.Tensor, warpers) -> torch.Tensor:
    scores = logits.float()
    for warper in warpers:
        scores = warper(None, scores)
    return torch.multinomial(scores.softmax(dim=-1), 1)[:, 0]


def time_engine_steps(engine: RKSCEngine, prompt_ids: list[int], n: int, steps: int) -> list[float]:
    """Per-step seconds of the engine's own decode loop body: choose tokens, then one forward."""
    params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, seed=0)
    prefilled = engine._prefill(prompt_ids)
    shared = engine._use_shared_prefix()
    cache, kwargs = engine._decode_cache(prefilled.cache, n, steps + 2, shared)
    logits = prefilled.last_logits.expand(n, -1)
    generators = make_generators(0, n, engine.device)
    times = []
    for _ in range(steps + 1):  # the first step is untimed warm-up
        start = time.perf_counter()
        tokens, _ = choose_next_tokens(logits, params, generators)
        logits = engine._decode_forward(tokens[:, None], cache, kwargs).logits[:, -1, :]
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
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    engine = RKSCEngine.from_pretrained(args.model)
    old = RKSCEngine(engine.model, engine.tokenizer, EngineConfig(decode_attention="dynamic_cache"))
    model = engine.model
    prompt_ids, _ = build_prompt_ids(engine, load_problems(None, 0), args.prompt_tokens)
    n_branches = args.branches
    bf16_native = cpu_supports_bf16() and not args.skip_bf16 and engine.device.type == "cpu"
    bf16 = None
    if bf16_native:
        import copy

        bf16 = RKSCEngine(copy.deepcopy(model).to(torch.bfloat16), engine.tokenizer)

    print(f"model {engine.model_name}, {engine.dtype}, {torch.get_num_threads()} threads; prompt {len(prompt_ids)} "
          f"tokens; {n_branches} branches; native bf16: {bf16_native}")
    bandwidth = memory_bandwidth_gb_s()
    ceiling = {"float32": matmul_gflop_s(torch.float32)}
    if bf16_native:
        ceiling["bfloat16"] = matmul_gflop_s(torch.bfloat16)
    w_bytes, kv_token = weight_bytes(model), kv_bytes_per_token(model)
    prompt_kv = kv_token * len(prompt_ids)
    floor_ms = w_bytes / bandwidth / 1e6
    print(f"bandwidth {bandwidth:.1f} GB/s; matmul ceiling {ceiling}; weights {w_bytes / 1e6:.0f} MB, "
          f"prompt KV {prompt_kv / 1e6:.1f} MB; floor {floor_ms:.1f} ms/step")

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
            add(prefill, "rksc", time_prefill(lambda: engine._prefill(prompt_ids)))
            ids = torch.tensor([prompt_ids], device=engine.device)
            add(prefill, "transformers", time_prefill(lambda ids=ids: model(input_ids=ids, logits_to_keep=1)))
            if bf16 is not None:
                bf16.clear_cache()
                add(prefill, "rksc bf16", time_prefill(lambda: bf16._prefill(prompt_ids)))
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
    floors = {1: floor_ms, n_branches: floor_ms}
    print("\n| decode arm | ms/step min | ms/step median | ratio to floor (min) | floor + 1 prompt KV | plain-path traffic floor |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = {}
    for key, values in decode.items():
        n = int(key.rsplit("=", 1)[1])
        s = summary([v * 1000 for v in values])
        bytes_scale = 0.5 if "bf16" in key else 1.0
        floor = floors[n] * bytes_scale
        shared_floor = (w_bytes * bytes_scale + prompt_kv * bytes_scale) / bandwidth / 1e6
        plain_floor = (w_bytes * bytes_scale + n * prompt_kv * bytes_scale) / bandwidth / 1e6
        rows[key] = {**s, "floor_ms": floor, "ratio_to_floor": s["min"] / floor}
        print(f"| {key} | {s['min']:.1f} | {s['median']:.1f} | {s['min'] / floor:.2f}x | {shared_floor:.1f} ms "
              f"| {plain_floor:.1f} ms |")
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
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps({
        "setup": {"model": engine.model_name, "prompt_tokens": len(prompt_ids), "branches": n_branches,
                  "threads": torch.get_num_threads(), "repeats": args.repeats, "steps": args.steps,
                  "bf16_native": bf16_native},
        "machine": {"bandwidth_gb_s": bandwidth, "matmul_gflop_s": ceiling, "weight_bytes": w_bytes,
                    "prompt_kv_bytes": prompt_kv, "floor_ms": floor_ms},
        "decode_ms": rows, "prefill": prefill_rows, "end_to_end": e2e_rows,
        "bf16_greedy_agreement": agreement,
    }, indent=2) + "\n")
    print(f"\nwrote {args.json_out}")


if __name__ == "__main__":
    main()
