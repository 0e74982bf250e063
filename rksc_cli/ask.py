"""``rksc ask``: answer a question with self-consistency over ``--branches`` reasoning branches
that share one computed prompt; ``--early-stop`` picks when branches stop early (default ``decided``:
once they cannot change the vote's winner), and the output says what that saved: at most the decode
budget the cancelled branches had left, and that of the branches never launched. ``--server URL``
reasons over a model an OpenAI-compatible server runs (vLLM, SGLang, llama.cpp, Ollama, ``transformers
serve``, ``rksc serve``) through a ``RemoteEngine``, with the same rules.

``rksc_cli`` adds this subcommand with ``add_arguments``/``run`` beside ``rksc bench`` and ``rksc serve``;
``python -m rksc_cli.ask ask ...`` runs it alone. It sits outside ``rksc_engine`` because a command line is
a front-end, like the HTTP server: the engine never depends on one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

from rksc_engine.config import SamplingParams
from rksc_engine.evaluation.workloads import load_gsm8k_jsonl, synthetic_problems
from rksc_engine.reasoning.cgee import CGEEConfig
from rksc_engine.reasoning.early_stop import EARLY_STOP_RULES
from rksc_engine.reasoning.few_shot import few_shot_messages
from rksc_engine.reasoning.self_consistency import ReasoningResult
from rksc_engine.results import EngineStats


def build_engine(args: argparse.Namespace) -> object:
    """The engine ``rksc ask`` reasons on: a ``RemoteEngine`` on ``--server``, else the local model."""
    if args.server is None:
        from rksc_engine.engine import RKSCEngine

        return RKSCEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    local_only = [flag for flag, value, default in (("--model", args.model, None), ("--device", args.device, "auto"),
                                                    ("--dtype", args.dtype, "auto")) if value != default]
    if local_only:
        raise ValueError(f"{', '.join(local_only)} load a local model; with --server the server's model answers "
                         f"(name it with --server-model)")
    from rksc_engine.remote import RemoteEngine

    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise ValueError(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    return RemoteEngine(args.server, model=args.server_model, api_key=api_key)


def run(args: argparse.Namespace) -> int:
    """Run ``rksc ask`` with the parsed ``args``; returns the exit status."""
    t0 = time.perf_counter()
    engine = build_engine(args)
    load_s = time.perf_counter() - t0
    shots = load_gsm8k_jsonl(args.shots_from, limit=args.shots) if args.shots_from else synthetic_problems(args.shots, seed=1)
    messages = few_shot_messages(args.question, shots)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, stop=("<|im_end|>",))
    cgee = CGEEConfig.off() if args.no_cgee else None  # None: the engine's EngineConfig.cgee defaults
    before = engine.stats()
    t0 = time.perf_counter()
    early_stop = None if args.early_stop == "off" else args.early_stop
    result = engine.reason(args.question, n=args.branches, params=params, prompt=messages, cgee=cgee,
                           early_stop=early_stop)
    gen_s = time.perf_counter() - t0
    branches = result.branches
    winner, votes = result.answer, result.votes
    stats = engine.stats()
    served = args.server is not None
    # Over a server every branch is a request that reads the prompt (its prefix cache may reuse it):
    # the split of one prefill forked to every branch does not hold, so the server's totals are shown.
    prompts = ServerPromptTokens.of_call(before, stats) if served else PromptTokens.of_call(result, before, stats)
    saved = budget_left(result, args.branches, params.max_new_tokens)
    if args.json:
        print(json.dumps({
            "answer": winner, "votes": dict(votes),
            "branches": [{"answer": b.answer, "confidence": b.confidence, "voted": b.voted, "text": b.text}
                         for b in branches],
            "verification": result.verification.summary(),
            "early_stop": result.early_stop.as_dict() if result.early_stop is not None else None,
            "early_stop_saved_tokens_at_most": saved, "prompt_tokens": asdict(prompts),
            "cgee_levels": list(result.cgee_levels), "server_limits": list(result.server_limits),
            "stats": stats.as_dict(), "load_s": load_s, "generate_s": gen_s,
        }, indent=2))
        return 0
    print(f"Question: {args.question}")
    print(f"Model: {engine.model_name} | branches: {args.branches}")
    stopped = dict(result.early_stop.stopped_by) if result.early_stop is not None else {}
    for i, b in enumerate(branches):
        first_line = b.text.strip().splitlines()[0] if b.text.strip() else ""
        mark = f"  [stopped: {stopped[i]}]" if i in stopped else ""
        print(f"  branch {i}: answer={b.answer!s:>8}  confidence={b.confidence:.3f}{mark}  {first_line[:70]}")
    print(f"Majority vote: {result.vote_summary.winner}  (confidence-weighted share p={result.vote_summary.p:.2f}, "
          f"lead={result.vote_summary.lead:.2f})")
    print(result.verification.summary())
    print(f"Answer: {winner}  votes={dict(votes)}")
    print(_early_stop_line(args.early_stop, result, args.branches, saved))
    for line in result.server_limits:
        print(f"Server: {line}")
    if isinstance(prompts, ServerPromptTokens):
        print(f"Prompt tokens (the server's usage): {prompts.computed} computed, {prompts.reused} reused from its "
              f"prefix cache, over {prompts.requests} requests (branches and judge)")
    else:
        print(f"Branches' prompt: {prompts.branches_computed} tokens computed once for all {len(result.completions)} "
              f"branches (reused from cache: {prompts.branches_reused}) | verifier's prompts: "
              f"{prompts.verifier_computed} tokens computed (reused from cache: {prompts.verifier_reused})")
    print(f"Decode tokens: {stats.decode_tokens - before.decode_tokens} | cache: {stats.cache_bytes / 2**20:.1f} MiB | "
          f"generate: {gen_s:.1f}s (load {load_s:.1f}s)")
    return 0


@dataclass(frozen=True)
class PromptTokens:
    """The prompt tokens one ``reason`` call computed and reused, the branches' shared prompt apart
    from the verifier's prompts (which re-read the branches' prompt and add each candidate)."""

    branches_computed: int
    branches_reused: int
    verifier_computed: int
    verifier_reused: int

    @classmethod
    def of_call(cls, result: ReasoningResult, before: EngineStats, after: EngineStats) -> PromptTokens:
        """Split the engine's counters over the call (``after`` less ``before``): the branches' prompt
        is what their completions say (one prefill, forked to every branch); the verifier's is the rest."""
        first = result.completions[0]
        branches_reused = first.num_cached_tokens
        branches_computed = first.num_prompt_tokens - branches_reused
        computed = after.prompt_tokens_computed - before.prompt_tokens_computed
        reused = after.prompt_tokens_reused - before.prompt_tokens_reused
        return cls(branches_computed, branches_reused, max(computed - branches_computed, 0),
                   max(reused - branches_reused, 0))


@dataclass(frozen=True)
class ServerPromptTokens:
    """The prompt tokens one ``reason`` call over a server read, from the ``usage`` of its requests
    (every branch and every judge prompt is a request of its own)."""

    requests: int
    computed: int
    reused: int

    @classmethod
    def of_call(cls, before: EngineStats, after: EngineStats) -> ServerPromptTokens:
        return cls(after.requests - before.requests, after.prompt_tokens_computed - before.prompt_tokens_computed,
                   after.prompt_tokens_reused - before.prompt_tokens_reused)


def budget_left(result: ReasoningResult, n: int, max_new_tokens: int) -> int:
    """The decode tokens early stop can have saved, at most: what each cancelled branch had left of
    ``max_new_tokens``, plus the whole budget of each of the ``n`` branches never launched. An upper
    bound, not a count: a cancelled branch might have ended sooner on its own."""
    cancelled = sum(max_new_tokens - c.num_generated_tokens for c in result.completions
                    if c.finish_reason == "cancelled")
    return cancelled + (n - len(result.completions)) * max_new_tokens


def _early_stop_line(rule: str, result: ReasoningResult, n: int, saved: int) -> str:
    """What early stopping did, in one line: branches launched and cancelled, tokens the branches
    decoded, the most it can have saved, and the rule that ended the request early, if one did."""
    report = result.early_stop
    if report is None:
        decoded = sum(c.num_generated_tokens for c in result.completions)
        return f"Early stop: off (every branch ran to its end; {decoded} tokens decoded)"
    ended = f"; request stopped by {report.stopped_request_by}" if report.stopped_request_by else ""
    unlaunched = n - report.branches_launched
    whose = "the cancelled branches" + (f" and the {unlaunched} never launched" if unlaunched else "")
    return (f"Early stop ({rule}): {report.branches_launched} branches launched, {report.branches_cancelled} "
            f"cancelled, {report.decode_tokens} tokens decoded, at most {saved} tokens saved "
            f"(the budget {whose} had left){ended}")


ASK_HELP = "answer a question by self-consistency over N branches"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``rksc ask``'s arguments to ``parser`` and make ``run`` its handler (``args.func``)."""
    parser.add_argument("question")
    parser.add_argument("--branches", "-n", type=int, default=8, help="sibling reasoning branches (default 8)")
    parser.add_argument("--model", default=None, help="local Hugging Face model directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--server", default=None, metavar="URL",
                        help="reason over the model an OpenAI-compatible server runs, e.g. http://127.0.0.1:8000/v1 "
                             "(vLLM, SGLang, llama.cpp, Ollama, transformers serve, rksc serve)")
    parser.add_argument("--server-model", default=None, metavar="NAME",
                        help="the model to ask the server for (default: the first one it lists)")
    parser.add_argument("--api-key-env", default=None, metavar="VAR",
                        help="environment variable holding the server's API key (sent as a bearer token)")
    parser.add_argument("--shots", type=int, default=8, help="worked examples in the prompt (default 8)")
    parser.add_argument("--shots-from", default=None, help="GSM8K-format JSONL to take the examples from (default: built-in synthetic set)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-cgee", action="store_true", help="always run the verifier at full depth")
    parser.add_argument("--early-stop", choices=[*EARLY_STOP_RULES, "off"], default="decided",
                        help="when branches stop early: decided (default; exact, once they cannot change the "
                             "vote's winner), the approximate rules (decided plus that rule), or off")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    """The engine's own command line: ``ask`` only (``rksc_cli`` builds the full ``rksc`` command)."""
    parser = argparse.ArgumentParser(prog="python -m rksc_cli.ask", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_arguments(sub.add_parser("ask", help=ASK_HELP))
    return parser


def dispatch(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand (its ``args.func``); returns the exit status.

    A ``ValueError``/``TypeError`` (a bad argument the subcommand found) is printed as
    ``rksc: error: ...`` with status 2, like argparse's own usage errors, instead of a traceback.
    """
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as exc:
        print(f"rksc: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return dispatch(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
