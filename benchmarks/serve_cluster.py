"""Benchmark: prefix-cache hit rate of ``rksc serve --replicas`` under prefix-aware routing (Ray Serve
LLM's ``PrefixCacheAffinityRouter``) against round-robin and Ray Serve's default (power of two choices).

Workload: ``rksc_serve.cluster.routing_workload``: ``--system-prompts`` assistants' system prompts x
``--questions`` short questions, sent one at a time in a seeded shuffled order, each answered with
``--max-tokens`` tokens. Every arm deploys fresh replicas and sees the same requests.

Hit rate: prompt tokens served from a replica's prefix cache over all prompt tokens
(``usage.prompt_tokens_details.cached_tokens`` / ``usage.prompt_tokens``, pooled over requests).

Each replica's cache budget is ``--cache-prompts`` system prompts' worth of KV (measured on the
model before the run). Routing matters when a replica cannot cache every system prompt, as in a
service with more prompts (or documents) than a replica's KV memory holds; with ``--cache-prompts
0`` (the engine's default budget, which holds everything here) round-robin only pays one extra cold
miss per system prompt and replica.

    ./dev python benchmarks/serve_cluster.py                                  # default model, 4 x 32
    ./dev python benchmarks/serve_cluster.py --out docs/bench/serve_cluster.md
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from rksc_bench import harness
from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.config import EngineConfig, RSBCMConfig
from rksc_engine.runtime.loading import ensure_default_model
from rksc_serve.cluster import ROUTINGS, ReplicaSpec, compare_routing, markdown_table, routing_workload


def cache_budget_mb(model: str, chats: list, prompts: float) -> float:
    """``prompts`` times the KV of the longest system-prompt chat in ``chats``, in MiB."""
    engine = RKSCEngine.from_pretrained(model, progress=False)
    tokens = max(engine.generate(c, SamplingParams(max_new_tokens=1)).num_prompt_tokens for c in chats)
    stats = engine.stats()
    return prompts * tokens * stats.cache_bytes / stats.cache_tokens / 2**20


def main(argv: list[str] | None = None) -> None:
    parser = harness.bench_parser(__file__, __doc__, model=False, json_out="optional")
    parser.add_model("the model directory every replica loads")
    parser.add_count("--replicas", 2)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--cache-prompts", type=float, default=2.5,
                        help="each replica's cache budget in system prompts' KV (0: the engine's default budget)")
    parser.add_argument("--routings", default="prefix,round_robin,pow2", help=f"comma-separated, of {list(ROUTINGS)}")
    parser.add_argument("--replica-cpus", type=float, default=1.0)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_seed(0, "seed of the request order")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    harness.start_run(args)
    import ray  # after the flags: --help needs no Ray

    logging.getLogger("httpx").setLevel(logging.WARNING)
    model = args.model or str(ensure_default_model())
    chats = routing_workload(args.system_prompts, args.questions, args.seed)
    config = None
    if args.cache_prompts > 0:
        budget = cache_budget_mb(model, chats[: 4 * args.system_prompts], args.cache_prompts)
        config = EngineConfig(rsbcm=RSBCMConfig(cache_budget_mb=budget))
    started = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        results = compare_routing(ReplicaSpec(model=model, engine_config=config), chats,
                                  [r.strip() for r in args.routings.split(",")], args.replicas,
                                  port=args.port, max_tokens=args.max_tokens, replica_cpus=args.replica_cpus)
    finally:
        ray.shutdown()
    budget_text = (f"{config.rsbcm.cache_budget_mb:.2f} MiB per replica ({args.cache_prompts:g} system prompts' KV)"
                   if config else "the engine's default")
    note = (f"{args.replicas} Ray Serve replicas of {Path(model).name}, {args.system_prompts} system prompts x "
            f"{args.questions} questions sent one at a time (seed {args.seed}), max_tokens {args.max_tokens}; "
            f"cache budget {budget_text}. Total {time.perf_counter() - started:.0f} s with deployments.")
    table = markdown_table(results, note)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"# Ray Serve replicas: prefix-cache hit rate by routing\n\n{table}\n")
    if args.json_out:
        harness.write_json(args.json_out, {"args": vars(args), "note": note, "results": results})


if __name__ == "__main__":
    main()
