"""Benchmark: early stop of ``reason`` over a server saves what it saves locally.

The ladder workload (``ladder_problems``: 1- to 4-step arithmetic word problems after one-step worked
examples), each question answered by ``reason`` with ``--branches`` seeded branches under
``early_stop=None``, ``"decided"`` and ``"length"``, on up to four engines over the same model:

    local               the ``RKSCEngine`` in this process;
    rksc serve          that engine's app (``rksc_serve.app``) on a loopback port in this process,
                        reached through a ``RemoteEngine``;
    transformers serve  ``transformers serve`` over the model's directory (a copy whose generation
                        config samples: ``rksc_bench.servers.sampling_model_dir``) as a subprocess on
                        a loopback port, offline, through a ``RemoteEngine``. It sends no log-probs
                        (every branch weighs 1), ignores per-request seeds and decodes one request at
                        a time.
    llama.cpp server    llama.cpp's own HTTP server (``llama-server``, C++; the binary is
                        ``--llama-server PATH``) as a subprocess on a loopback port over the embedded
                        model's GGUF file itself, through a ``RemoteEngine``. It computes with the
                        file's Q4_1 weights as they are (and an f16 KV cache), where rksc dequantizes
                        them to fp32 once, so its samples and answers are other ones. It gets what the
                        other engines get: the same chat prompts (its rendering and tokens are
                        checked against rksc's before it runs, and it is not run when they differ),
                        ``--threads`` (default torch's), rksc's sampling chain (temperature, top-k
                        off, top-p; not llama.cpp's top-k 40 and min-p 0.05), one slot per branch
                        (``--llama-server-parallel``, default 8, so the branches decode together),
                        each slot a context of the longest prompt plus ``--max-new-tokens``, prompt
                        caching on. Its decode tokens (server) come from its ``/metrics``. It seeds
                        choice i of a request of n with seed + i, as rksc does, but its seeded samples
                        depend on what else is in the batch (alone, beside other requests, or as a
                        choice of n, the same seed parts after a few tokens), so its "same answer as
                        none" also measures that.

Per engine and rule: decode tokens (``server``: what the engine decoded, from its own counters, for
the local engine and ``rksc serve``, from ``/metrics`` for llama.cpp; ``client``: what the
``RemoteEngine`` received, ``usage.completion_tokens`` of finished branches plus the tokens a closed
branch had streamed, which misses what a server decodes between the close and noticing it), their
share of ``early_stop=None``'s, the wall time of the ``reason`` calls (summed over the questions)
and its share of ``early_stop=None``'s, branches cancelled, answers equal to the same engine's
``early_stop=None`` answer, and right answers. The rules run one after another on each question, so
a slow spell of the machine falls on one rule: take timings under the bench lock (``start_run``
holds it).
The verifier is a constant scorer, so only the branches' tokens are counted (the log-prob judge's
one token per candidate, the local judge's forward pass, are not). ``rksc serve``'s seeded branches
are the local engine's; ``transformers serve``'s and llama.cpp's are other samples, and their answers
differ for that.

    flock /tmp/rksc-bench.lock ./dev python benchmarks/remote_early_stop.py --per-level 2 \
        --llama-server PATH/TO/llama-server --md docs/bench/remote_early_stop.md
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from rksc_bench import harness
from rksc_bench.servers import (
    app_in_thread,
    llama_server,
    llama_server_ctx_size,
    llama_server_decode_tokens,
    llama_server_prompt_difference,
    llama_server_version,
    sampling_model_dir,
    transformers_serve,
)
from rksc_engine import RemoteEngine, SamplingParams
from rksc_engine.evaluation.workloads import ladder_problems, ladder_shots
from rksc_engine.reasoning.few_shot import few_shot_messages
from rksc_engine.runtime.loading import default_gguf_path, ensure_default_model

RULES: dict[str, Any] = {"none": None, "decided": "decided", "length": "length"}
LLAMA_CPP = "llama.cpp server"
ENGINES = ("local", "rksc serve", "transformers serve", LLAMA_CPP)


def constant_scores(question: str, candidates: list[str]) -> list[float]:
    """A verifier that costs no tokens: the benchmark counts the branches' decode tokens only."""
    return [1.0] * len(candidates)


def settled(engine: Any) -> Any:
    """``engine.stats()`` once no request of its is in flight (a closed branch's worker counts the
    tokens it received when its connection is down, which can be after its request answered)."""
    deadline = time.monotonic() + 60
    while engine.stats().running_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.stats()


def run_arm(name: str, engine: Any, problems: list, shots: list, args: Any,
            server_tokens: Callable[[], int] | None) -> dict[str, Any]:
    """Every question under every rule on ``engine``; per rule the counts the module docstring lists."""
    rows: dict[str, dict[str, Any]] = {rule: {"server_decode_tokens": 0 if server_tokens else None,
                                              "client_decode_tokens": 0, "wall_s": 0.0, "branches_cancelled": 0,
                                              "right": 0,
                                              "same_answer_as_none": 0, "questions": 0, "server_limits": []}
                                       for rule in RULES}
    if callable(getattr(engine, "capabilities", None)):
        engine.capabilities()  # the probe's few tokens, before anything is counted
    for index, problem in enumerate(tqdm(problems, desc=name, unit="question")):
        params = SamplingParams(temperature=args.temperature, top_p=0.95, max_new_tokens=args.max_new_tokens,
                                seed=args.seed + 1000 * (index + 1), stop=("<|im_end|>",))
        answers = {}
        for rule, early_stop in RULES.items():
            before_server = server_tokens() if server_tokens else 0
            before_client = settled(engine).decode_tokens
            messages = few_shot_messages(problem.question, shots)
            start = time.perf_counter()
            result = engine.reason(problem.question, n=args.branches, params=params, prompt=messages,
                                   verifier=constant_scores, early_stop=early_stop)
            wall_s = time.perf_counter() - start
            row = rows[rule]
            row["wall_s"] += wall_s
            if server_tokens:
                row["server_decode_tokens"] += server_tokens() - before_server
            row["client_decode_tokens"] += (settled(engine).decode_tokens - before_client if name != "local"
                                            else sum(c.num_generated_tokens for c in result.completions))
            row["branches_cancelled"] += result.early_stop.branches_cancelled if result.early_stop else 0
            row["right"] += result.answer == problem.answer
            row["questions"] += 1
            row["server_limits"] = list(result.server_limits)
            answers[rule] = result.answer
        for rule in RULES:
            rows[rule]["same_answer_as_none"] += answers[rule] == answers["none"]
    return rows


def markdown(arms: dict[str, dict[str, dict[str, Any]]], args: Any, llama_settings: dict[str, Any] | None = None
             ) -> str:
    lines = [f"Ladder: {args.per_level} question(s) per level 1-4, {args.shots} shots, {args.branches} branches, "
             f"max {args.max_new_tokens} new tokens, temperature {args.temperature}, seed {args.seed}.", ""]
    if llama_settings is not None:
        lines += [f"{LLAMA_CPP}: llama-server {llama_settings['version']} over the GGUF file's Q4_1 weights as they "
                  f"are (rksc dequantizes them to fp32), {llama_settings['threads']} threads, "
                  f"{llama_settings['parallel']} slots of {llama_settings['ctx_size'] // llama_settings['parallel']} "
                  f"tokens, rksc's sampling chain; its server decode tokens are its /metrics' count.", ""]
    lines += ["| engine | early_stop | decode tokens (server) | decode tokens (client) | vs none | wall s | vs none "
              "| branches cancelled | same answer as none | right |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rows in arms.items():
        if "not_run" in rows:
            lines.append(f"| {name} | not run: {rows['not_run']} | | | | | | | | |")
            continue
        base = rows["none"]["server_decode_tokens"] or rows["none"]["client_decode_tokens"]
        for rule, row in rows.items():
            tokens = row["server_decode_tokens"] if row["server_decode_tokens"] is not None else row["client_decode_tokens"]
            server = "" if row["server_decode_tokens"] is None else str(row["server_decode_tokens"])
            wall_share = row["wall_s"] / rows["none"]["wall_s"] if rows["none"]["wall_s"] else float("nan")
            lines.append(f"| {name} | {rule} | {server} | {row['client_decode_tokens']} | {tokens / base:.2f} | "
                         f"{row['wall_s']:.1f} | {wall_share:.2f} | "
                         f"{row['branches_cancelled']} | {row['same_answer_as_none']}/{row['questions']} | "
                         f"{row['right']}/{row['questions']} |")
    limits = {line for rows in arms.values() if "not_run" not in rows for line in rows["none"]["server_limits"]}
    if limits:
        lines += ["", "What the servers did not provide (`ReasoningResult.server_limits`):", ""]
        lines += [f"- {line}" for line in sorted(limits)]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.servers`` becomes the list of engines to run, each one of ``ENGINES``."""
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_seed()
    parser.add_max_new_tokens(160, "tokens per branch, at most")
    parser.add_threads()
    parser.add_count("--per-level", 2, "ladder questions per level (4 levels)")
    parser.add_count("--shots", 4, "one-step worked examples in the prompt")
    parser.add_count("--branches", 8, "branches per question")
    parser.add_argument("--temperature", type=float, default=0.7, help="branch temperature (default 0.7)")
    parser.add_argument("--servers", default=None,
                        help=f"the engines to run, comma-separated, of: {', '.join(ENGINES)} (default: all, "
                             f"'{LLAMA_CPP}' only with --llama-server)")
    parser.add_argument("--llama-server", type=Path, default=None, metavar="PATH",
                        help=f"the llama-server binary of a llama.cpp build: adds the '{LLAMA_CPP}' engine")
    parser.add_count("--llama-server-parallel", 8, "llama-server slots (--parallel), one per branch")
    parser.add_argument("--md", type=Path, default=None, help="also write the table as Markdown here")
    args = parser.parse_args(argv)
    if args.servers is None:
        args.servers = [name for name in ENGINES if name != LLAMA_CPP or args.llama_server is not None]
    else:
        args.servers = [name.strip() for name in args.servers.split(",") if name.strip()]
    unknown = [name for name in args.servers if name not in ENGINES]
    if unknown or not args.servers:
        parser.error(f"--servers: unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}" if unknown
                     else "--servers names no engine")
    if LLAMA_CPP in args.servers:
        if args.llama_server is None:
            parser.error(f"--servers names '{LLAMA_CPP}', which needs --llama-server PATH (the llama-server binary)")
        if not (args.llama_server.is_file() and os.access(args.llama_server, os.X_OK)):
            parser.error(f"--llama-server {args.llama_server} is not an executable file")
        if args.model is not None:
            parser.error(f"'{LLAMA_CPP}' runs the embedded default model's GGUF file: leave out --model, or "
                         f"leave '{LLAMA_CPP}' out of --servers")
    return args


def llama_cpp_arm(args: argparse.Namespace, engine: Any, problems: list, shots: list) -> tuple[dict, dict]:
    """The ``llama.cpp server`` engine: ``llama-server`` over the embedded GGUF, checked to prompt the
    model as ``engine`` does, then every question under every rule. Returns the arm's rows (or
    ``{"not_run": why}``) and how the server was run."""
    prompts = [few_shot_messages(problem.question, shots) for problem in problems]
    max_prompt_tokens = max(len(engine.encode_chat(messages)) for messages in prompts)
    settings = {"binary": str(args.llama_server), "version": llama_server_version(args.llama_server),
                "gguf": str(default_gguf_path()), "threads": args.threads or torch.get_num_threads(),
                "parallel": args.llama_server_parallel, "max_prompt_tokens": max_prompt_tokens,
                "ctx_size": llama_server_ctx_size(max_prompt_tokens, args.max_new_tokens, args.llama_server_parallel)}
    try:
        with llama_server(args.llama_server, settings["gguf"], threads=settings["threads"],
                          parallel=settings["parallel"], ctx_size=settings["ctx_size"]) as url:
            difference = llama_server_prompt_difference(url, engine, prompts)
            if difference is not None:
                return {"not_run": f"it would prompt the model otherwise than rksc: {difference}"[:300]}, settings
            with RemoteEngine(f"{url}/v1", timeout=600) as remote:
                return run_arm(LLAMA_CPP, remote, problems, shots, args, lambda: llama_server_decode_tokens(url)), settings
    except RuntimeError as error:
        return {"not_run": str(error)[:300]}, settings


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    harness.start_run(args)
    wanted = args.servers
    problems, shots = ladder_problems(args.per_level, seed=args.seed), ladder_shots(args.shots, seed=1)
    engine = harness.load_engine(args, device="cpu", progress=False)
    model_dir = Path(args.model) if args.model else ensure_default_model(progress=False)
    arms: dict[str, Any] = {}
    llama_settings = None
    if "local" in wanted:
        arms["local"] = run_arm("local", engine, problems, shots, args, lambda: settled(engine).decode_tokens)
    if "rksc serve" in wanted:
        from rksc_serve.app import create_app

        with app_in_thread(create_app(engine)) as url, RemoteEngine(f"{url}/v1", timeout=600) as remote:
            arms["rksc serve"] = run_arm("rksc serve", remote, problems, shots, args,
                                         lambda: settled(engine).decode_tokens)
    if "transformers serve" in wanted:
        with tempfile.TemporaryDirectory() as scratch:
            try:
                with transformers_serve(sampling_model_dir(model_dir, Path(scratch) / "model"),
                                        threads=args.threads) as url, RemoteEngine(f"{url}/v1", timeout=600) as remote:
                    arms["transformers serve"] = run_arm("transformers serve", remote, problems, shots, args, None)
            except RuntimeError as error:
                arms["transformers serve"] = {"not_run": str(error)[:300]}
    if LLAMA_CPP in wanted:
        arms[LLAMA_CPP], llama_settings = llama_cpp_arm(args, engine, problems, shots)
    table = markdown(arms, args, llama_settings)
    print(table)
    if args.md is not None:
        args.md.write_text(table)
    harness.write_json(args.json_out, {"per_level": args.per_level, "branches": args.branches, "arms": arms,
                                       "llama_server": llama_settings})


if __name__ == "__main__":
    main()
