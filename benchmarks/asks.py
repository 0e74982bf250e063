"""Benchmark: ASKS KV reuse across differently worded prompts, against token-exact caching and full recompute.

Two workloads on the default model (or ``--model``):

* ``prompt-ensemble SC``: for each of ``--questions`` questions, ``--wordings`` (>= 6) differently
  worded system instructions before the same ~1,300-token few-shot context and the question. Each
  question draws its own shots (as retrieval-chosen shots would), so token-exact caching can reuse
  only the chat header before the wording.
* ``agent template``: ``--agent-calls`` calls whose header (date, user name, request id) changes
  before an identical tool list and history, then the call's own request.

Arms, run request by request, interleaved, each on its own engine and prefix cache sharing one model:

* ``exact``: token-exact radix caching (ASKS off). By the anchor invariant (tested) its output is
  token-identical to full recompute, so it is the fidelity reference.
* ``tau=x``: ASKS at that threshold, no selective recompute.
* ``recompute=f``: ASKS at ``tau=0`` (reuse whenever a realignment exists), recomputing the first
  fraction ``f`` of the reused remainder exactly.
* ``tau=x (derived)``: thresholds not run as arms (``--derived-taus``, to keep the run short on a
  2-core machine): a request reuses exactly when the ``tau=0`` arm measured ``sigma >= x``, with that
  arm's measured outcome, else the exact arm's. Fidelity and reuse are measured values; the prefill
  ratio is an estimate (exact prefill plus the ``tau=0`` arm's whole ASKS prefill for a fallback).
  Unlike a real run, a fallback does not add its prompt to the candidates of later requests.

Per arm the table gives: requests that reused; the share of prompt tokens whose KV came from a cache;
extra prompt tokens reused over token-exact caching, as a share of all prompt tokens (``(reused_asks -
reused_exact) / prompt_tokens``; the paper reports +28.6%); prefill wall-time ratio
to ``exact`` (sum over the workload; below 1 is faster); and fidelity against full recompute: mean
next-token KL(exact || arm) at the end of the prompt, greedy agreement over the first 32 tokens (mean
share of positions equal, and share of requests with all 32 equal), and final-answer agreement (SC:
the ``#### x``/last-number answer of a greedy decode of ``--max-new-tokens``; agent: the first
generated line). A request that falls back is computed exactly, so it is counted as agreeing; its
decode is not repeated. Approximate decodes are shared between arms that built the very same KV.

Timings come from a shared machine: compare ratios within one run, not absolute seconds.

Run it (results also go to ``benchmarks/results/asks.json``):

    flock /tmp/rksc-bench.lock ./dev python benchmarks/asks.py
    flock /tmp/rksc-bench.lock ./dev python benchmarks/asks.py --data /work/shared/data/gsm8k_train.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from rksc_bench import harness
from rksc_bench.prompts import shots_to_length
from rksc_bench.reworded_prompts import AGENT_WORKLOAD, GREEDY_WINDOW, WORDINGS, answer_of, answer_settled
from rksc_engine import ASKSConfig, EngineConfig, RKSCEngine
from rksc_engine.evaluation.calibration import wilson_interval
from rksc_engine.evaluation.workloads import load_gsm8k_jsonl, synthetic_problems
from rksc_engine.reasoning.few_shot import few_shot_messages

TOOLS = [
    ("search_flights", "Find flights between two airports on a date.", ["origin", "destination", "date"]),
    ("book_flight", "Book a flight by its id for the current user.", ["flight_id", "seat_class"]),
    ("get_weather", "Weather forecast for a city on a date.", ["city", "date"]),
    ("convert_currency", "Convert an amount between two currencies.", ["amount", "from", "to"]),
    ("find_hotels", "Hotels in a city with check-in and check-out dates.", ["city", "check_in", "check_out"]),
    ("book_hotel", "Book a hotel room by its id.", ["hotel_id", "room_type"]),
    ("send_email", "Send an email to an address with a subject and body.", ["to", "subject", "body"]),
    ("calendar_add", "Add an event to the user's calendar.", ["title", "start", "end"]),
    ("translate", "Translate text into a target language.", ["text", "target_language"]),
    ("calculator", "Evaluate an arithmetic expression.", ["expression"]),
]
HISTORY = [
    ("user", "I need to be in Lisbon for a conference from May 12 to May 15."),
    ("assistant", '{"name": "search_flights", "arguments": {"origin": "BER", "destination": "LIS", "date": "2026-05-11"}}'),
    ("tool", '[{"flight_id": "TP541", "depart": "07:10", "price_eur": 189}, {"flight_id": "FR1234", "depart": "12:40", "price_eur": 74}]'),
    ("assistant", "There are two flights on May 11: TP541 at 07:10 for 189 EUR and FR1234 at 12:40 for 74 EUR."),
    ("user", "Book the cheaper one, economy."),
    ("assistant", '{"name": "book_flight", "arguments": {"flight_id": "FR1234", "seat_class": "economy"}}'),
    ("tool", '{"status": "confirmed", "booking_ref": "QX7P2L"}'),
    ("assistant", "Your flight FR1234 on May 11 is booked, reference QX7P2L."),
    ("user", "Now find a hotel near the conference centre for those nights."),
    ("assistant", '{"name": "find_hotels", "arguments": {"city": "Lisbon", "check_in": "2026-05-11", "check_out": "2026-05-15"}}'),
    ("tool", '[{"hotel_id": "H-88", "name": "Parque Suites", "price_eur": 132}, {"hotel_id": "H-17", "name": "Rio Lodge", "price_eur": 98}]'),
    ("assistant", "Two options: Parque Suites at 132 EUR a night, or Rio Lodge at 98 EUR a night."),
]
HEADERS = [
    ("2026-03-02", "Alice Chen", "7f3a-19c2"), ("2026-03-05", "Bruno Díaz", "0b44-e1a9"),
    ("2026-03-09", "Chiara Rossi", "c8d2-5f10"), ("2026-03-14", "Dmitri Volkov", "91ee-2a7b"),
    ("2026-03-21", "Emeka Obi", "4c19-88d0"), ("2026-04-01", "Fatima Zahra", "e0f7-3b65"),
    ("2026-04-06", "Gustav Berg", "5a2c-d4e8"), ("2026-04-11", "Hana Sato", "b7c1-09f2"),
]
AGENT_REQUESTS = [
    "Book the cheaper hotel, a double room.",
    "What will the weather be in Lisbon on May 12?",
    "How much is 98 EUR in US dollars?",
    "Put the conference in my calendar from May 12 to May 15.",
    "Email my manager at lee@example.com that the trip is booked.",
    "Translate 'where is the conference centre' into Portuguese.",
    "What is 4 nights at 98 EUR plus the 74 EUR flight?",
    "Book the more expensive hotel instead, a single room.",
]


@dataclass
class Request:
    workload: str
    label: str
    ids: list[int]


@dataclass
class Outcome:
    tokens: list[int]
    answer: str | None


def agent_system(header: tuple[str, str, str]) -> str:
    date, name, request_id = header
    tools = "\n".join(
        json.dumps({"name": n, "description": d, "parameters": {p: {"type": "string"} for p in params}})
        for n, d, params in TOOLS
    )
    return (f"Date: {date}. User: {name}. Request id: {request_id}.\n"
            "You are a travel assistant. Call a tool by answering with one JSON object "
            '{"name": ..., "arguments": {...}}, or answer the user directly. Tools:\n' + tools)


def build_requests(engine: RKSCEngine, args: argparse.Namespace) -> list[Request]:
    if args.data:
        pool = load_gsm8k_jsonl(args.data, limit=400)
    else:
        pool = synthetic_problems(400, seed=args.seed)
    questions = synthetic_problems(args.questions, seed=args.seed + 1000) if not args.data else pool[-args.questions:]
    requests = []
    for q, problem in enumerate(questions):
        shots = shots_to_length(engine, "?", pool, args.context_tokens, start=q * 37)
        for w in range(args.wordings):
            messages = few_shot_messages(problem.question, shots, system_prompt=WORDINGS[w])
            requests.append(Request("prompt-ensemble SC", f"q{q}/w{w}", engine.encode(messages)))
    for c in range(args.agent_calls):
        messages = [{"role": "system", "content": agent_system(HEADERS[c % len(HEADERS)])}]
        messages += [{"role": r, "content": t} for r, t in HISTORY]
        messages.append({"role": "user", "content": AGENT_REQUESTS[c % len(AGENT_REQUESTS)]})
        requests.append(Request(AGENT_WORKLOAD, f"call{c}", engine.encode(messages)))
    return requests


@torch.inference_mode()
def greedy_from(engine: RKSCEngine, prefilled, workload: str, max_new_tokens: int) -> list[int]:
    """Greedy decode from a prefilled batch-1 cache (the same loop for every arm).

    Stops at EOS, at ``max_new_tokens``, or once at least ``GREEDY_WINDOW`` tokens are out and the
    final answer is settled (SC: a finished ``#### x`` line; agent: the first line is complete)."""
    cache, logits, tokens = prefilled.cache, prefilled.last_logits, []
    for _ in range(max_new_tokens):
        token = int(logits.argmax(-1))
        tokens.append(token)
        if token in engine.eos_token_ids or answer_settled(engine, workload, tokens):
            break
        logits = engine.forward(torch.tensor([[token]], device=engine.device), cache).logits[:, -1, :]
    return tokens


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    ref = torch.log_softmax(ref_logits.double(), -1)
    got = torch.log_softmax(logits.double(), -1)
    return float((ref.exp() * (ref - got)).sum())


def run(args: argparse.Namespace) -> dict:
    base = harness.load_engine(args, progress=True)
    model, tokenizer = base.model, base.tokenizer
    common = dict(decode_attention="dynamic_cache")
    arms: dict[str, RKSCEngine] = {"exact": RKSCEngine(model, tokenizer, EngineConfig(**common))}
    for tau in sorted(set(args.taus) | {0.0}, reverse=True):  # tau=0 feeds the derived rows
        arms[f"tau={tau:g}"] = RKSCEngine(model, tokenizer, EngineConfig(
            asks=ASKSConfig(enabled=True, tau=tau, alpha=args.alpha), **common))
    for fraction in args.recompute:
        arms[f"tau=0 recompute={fraction:g}"] = RKSCEngine(model, tokenizer, EngineConfig(
            asks=ASKSConfig(enabled=True, tau=0.0, alpha=args.alpha, recompute_fraction=fraction), **common))
    requests = build_requests(base, args)
    approx_outcomes: dict[tuple, Outcome] = {}
    records = []  # one per (request, arm)
    for index, request in enumerate(tqdm(requests, desc="requests")):
        if index and request.workload != requests[index - 1].workload:
            for engine in arms.values():
                engine.clear_cache()
        reference = None
        for name, engine in arms.items():
            with engine.exclusive():
                start = time.perf_counter()
                prefilled = engine.prefill(request.ids)
                elapsed = time.perf_counter() - start
            decision = prefilled.asks
            record = dict(request=request.label, workload=request.workload, arm=name, prefill_s=elapsed,
                          prompt_tokens=len(request.ids), cached_tokens=prefilled.num_cached_tokens,
                          sigma=None if decision is None else decision.sigma,
                          reused=bool(decision and decision.reused))
            if name == "exact":
                tokens = greedy_from(engine, prefilled, request.workload, args.max_new_tokens)
                reference = (prefilled.last_logits.clone(), Outcome(tokens, answer_of(base, request.workload, tokens)))
                outcome = reference[1]
            elif record["reused"]:
                key = (index, decision.prefix_tokens, decision.request_span_tokens, decision.cached_span_tokens,
                       decision.remainder_tokens, decision.reused_tokens, round(decision.sigma, 9))
                if key not in approx_outcomes:
                    tokens = greedy_from(engine, prefilled, request.workload, args.max_new_tokens)
                    approx_outcomes[key] = Outcome(tokens, answer_of(base, request.workload, tokens))
                outcome = approx_outcomes[key]
            else:
                outcome = reference[1]  # computed exactly: the reference, by the anchor invariant
            ref_logits, ref_outcome = reference
            window = min(GREEDY_WINDOW, len(ref_outcome.tokens))
            same = sum(a == b for a, b in zip(outcome.tokens[:window], ref_outcome.tokens[:window]))
            record.update(kl=kl(ref_logits, prefilled.last_logits), greedy_share=same / window,
                          greedy_all=same == window, answer=outcome.answer, reference_answer=ref_outcome.answer,
                          answer_agree=outcome.answer == ref_outcome.answer)
            records.append(record)
    return dict(records=records, arms=list(arms), derived_taus=args.derived_taus)


def derived_records(records: list[dict], tau: float) -> list[dict]:
    """Rows for a tau that was not run: a request reuses exactly when the ``tau=0`` arm measured
    ``sigma >= tau`` for it, taking that arm's outcome, else the exact arm's (the prefill time then
    is the exact arm's plus the ``tau=0`` arm's span check, estimated as its whole ASKS prefill)."""
    by_key = {(r["request"], r["arm"]): r for r in records}
    out = []
    for r in records:
        if r["arm"] != "exact":
            continue
        forced = by_key[(r["request"], "tau=0")]
        if forced["reused"] and max(forced["sigma"], 0.0) >= tau:
            out.append(dict(forced, arm=f"tau={tau:g} (derived)"))
        else:
            extra_s = forced["prefill_s"] if forced["sigma"] is not None else 0.0
            out.append(dict(r, arm=f"tau={tau:g} (derived)", prefill_s=r["prefill_s"] + extra_s,
                            sigma=forced["sigma"], reused=False))
    return out


def summarise(rows: list[dict], exact_rows: list[dict]) -> dict:
    prompt = sum(r["prompt_tokens"] for r in rows)
    agree = sum(r["answer_agree"] for r in rows)
    sigmas = [r["sigma"] for r in rows if r["sigma"] is not None]
    return dict(
        requests=len(rows), reuses=sum(r["reused"] for r in rows),
        cached_share=sum(r["cached_tokens"] for r in rows) / prompt,
        extra_reused=(sum(r["cached_tokens"] for r in rows) - sum(r["cached_tokens"] for r in exact_rows)) / prompt,
        prefill_ratio=sum(r["prefill_s"] for r in rows) / sum(r["prefill_s"] for r in exact_rows),
        kl=sum(r["kl"] for r in rows) / len(rows),
        greedy_share=sum(r["greedy_share"] for r in rows) / len(rows),
        greedy_all=sum(r["greedy_all"] for r in rows) / len(rows),
        answer_agree=agree / len(rows), answer_agree_low=wilson_interval(agree, len(rows))[0],
        sigma_min=min(sigmas) if sigmas else None, sigma_max=max(sigmas) if sigmas else None,
    )


def table(result: dict) -> tuple[str, list[dict]]:
    records = result["records"]
    for tau in result["derived_taus"]:
        records = records + derived_records(result["records"], tau)
    arms = result["arms"] + [f"tau={t:g} (derived)" for t in result["derived_taus"]]
    header = (f"{'arm':<24} {'reused':>7} {'cached share':>12} {'extra reused':>13} {'prefill':>8} {'KL':>9} "
              f"{'greedy32':>9} {'all32':>6} {'answer agree (95% low)':>23} {'sigma range':>16}")
    lines, summary = [], []
    workloads = sorted({r["workload"] for r in records}, reverse=True)
    for workload in workloads + ["all"]:
        rows_of = {a: [r for r in records if r["arm"] == a and workload in ("all", r["workload"])] for a in arms}
        exact_rows = rows_of["exact"]
        lines += ["", f"{workload}: {len(exact_rows)} requests, "
                  f"{sum(r['prompt_tokens'] for r in exact_rows):,} prompt tokens", header]
        for arm in arms:
            s = summarise(rows_of[arm], exact_rows)
            summary.append(dict(workload=workload, arm=arm, **s))
            sig = "-" if s["sigma_min"] is None else f"{s['sigma_min']:.4f}-{s['sigma_max']:.4f}"
            lines.append(
                f"{arm:<24} {s['reuses']:>3}/{s['requests']:<3} {s['cached_share']:>12.1%} {s['extra_reused']:>+12.1%} "
                f"{s['prefill_ratio']:>7.2f}x {s['kl']:>9.4f} {s['greedy_share']:>9.3f} {s['greedy_all']:>6.2f} "
                f"{s['answer_agree']:>10.3f} ({s['answer_agree_low']:.3f}){'':>5} {sig:>16}")
    return "\n".join(lines), summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_dtype()
    parser.add_argument("--data", default=None, help="GSM8K-format JSONL for shots and questions (default: synthetic)")
    parser.add_count("--questions", 1)
    parser.add_argument("--wordings", type=int, default=6, choices=range(2, len(WORDINGS) + 1))
    parser.add_argument("--agent-calls", type=int, default=4)
    parser.add_argument("--context-tokens", type=int, default=1300, help="few-shot prompt length to reach")
    parser.add_argument("--taus", type=harness.float_list, default=[0.98, 0.0], help="thresholds run as arms (0 always runs)")
    parser.add_argument("--derived-taus", type=harness.float_list, default=[0.995, 0.99, 0.97, 0.95, 0.9],
                        help="thresholds derived from the tau=0 arm's sigmas (outcomes measured, timings estimated)")
    parser.add_argument("--recompute", type=harness.float_list, default=[0.25])
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_max_new_tokens(64)
    parser.add_seed(0, "seed of the synthetic problems")
    parser.add_threads()
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    harness.start_run(args)
    torch.set_grad_enabled(False)
    started = time.perf_counter()
    result = run(args)
    text, summary = table(result)
    print(text)
    print(f"\ntotal wall time {time.perf_counter() - started:.0f} s; timings on a shared machine, compare ratios only")
    harness.write_json(args.json_out, dict(args=vars(args), summary=summary, records=result["records"]))


if __name__ == "__main__":
    main()
