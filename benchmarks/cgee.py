"""Benchmark: CGEE's skip and layer exit against always-full verification, on the default model.

For every question the branches are generated once (seeded, so every arm sees the same branches),
then the verification decision is made under each timed arm, in an order rotated per question:

* ``full``: every candidate verified at full depth (the reference decision);
* ``skip``: CGEE level 1 only, with the default thresholds;
* ``skip+exit``: level 1 and the level-2 layer exit;
* ``exit``: level 2 only.

Per arm it prints the skip rate, the mean exit layer (1-based, of 30), verification time and its
ratio to ``full``, the end-to-end time ratio (generation + verification) and the CGEE error rate:
decisions that differ from ``full`` divided by verifier calls of ``full`` (questions with at least
one candidate answer), with its Wilson 95% interval.

Every question also gets one untimed full-depth pass that records the logit lens of the Yes/No rows
at every layer. Those raw per-question records are written to ``--records-out`` and ``calibrate``
runs on them: it picks level-1 and level-2 thresholds for ``--target-error`` (Wilson 95% upper
bound), and a two-fold check calibrates on half the questions and counts errors on the other half.
``--from-records`` re-runs that calibration from a saved file without generating anything.

    ./dev python benchmarks/cgee.py                                   # built-in synthetic GSM8K-style questions
    ./dev python benchmarks/cgee.py --synthetic choice                # built-in multiple-choice questions
    ./dev python benchmarks/cgee.py --data gsm8k.jsonl --questions 50 # GSM8K or multiple-choice JSONL
    ./dev python benchmarks/cgee.py --from-records benchmarks/results/cgee_records.json

With ``--data``, the first ``--shots`` rows are the worked examples and the questions follow them.

``--workload ladder`` asks where CGEE can act: the difficulty ladder (``ladder_problems``: 1- to
4-step arithmetic word problems, ``--per-level`` of each, with one-step worked examples worded
unlike them), or ``--data`` rows leveled by their solution's steps. Each batch of ``--batch``
questions has its branches submitted together (the scheduler decodes them as one batch); then each
vote is verified at full depth on its own and timed. Per question the record keeps the vote
(``p``, ``lead``, shares), always-verify's answer and seconds, and the gold answer, which is all
``calibration.calibrate_split`` needs: it picks ``tau_conf``/``margin`` on a seeded half (no accuracy
lost against always verifying by ``--rule``, the most verifier time saved) and the tables report
them per level on the other half, beside the library default on every question.

    ./dev python benchmarks/cgee.py --workload ladder --per-level 8                 # a quick look
    ./dev python benchmarks/cgee.py --workload ladder --per-level 420 --batch 32    # >= 1,600 decisions
    ./dev python benchmarks/cgee.py --workload ladder --per-level 420 --batch 32 --resume   # continue a run
    ./dev python benchmarks/cgee.py --from-records benchmarks/results/cgee_ladder_records.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rksc_bench import harness
from rksc_bench.cgee_ladder import (
    CHOICE_JUDGE_PROMPT,
    ladder_report,
    load_questions,
    parse_index_ranges,
    plot_ladder,
    print_ladder,
    run_ladder,
)
from rksc_engine import SamplingParams
from rksc_engine.evaluation.calibration import CalibrationRecord, calibrate, wilson_interval
from rksc_engine.evaluation.workloads import ladder_problems
from rksc_engine.reasoning.cgee import CGEEConfig, lens_entropy, lens_exit_layer, pick_answer, should_skip
from rksc_engine.reasoning.few_shot import CHOICE_SYSTEM_PROMPT, SYSTEM_PROMPT, few_shot_messages
from rksc_engine.reasoning.self_consistency import EXTRACTORS, BranchAnswer, verify_and_pick
from rksc_engine.reasoning.verifier import JUDGE_SYSTEM_PROMPT, LLMJudgeVerifier

ARMS = {
    "full": CGEEConfig.off(),
    "skip": CGEEConfig(skip_enabled=True, exit_enabled=False),
    "skip+exit": CGEEConfig(skip_enabled=True, exit_enabled=True),
    "exit": CGEEConfig(skip_enabled=False, exit_enabled=True),
}


def run_question(qi, problem, shots, kind, engine, judge, recorder, params, args) -> dict:
    """Generate once, decide under every timed arm, record the lens; one raw record."""
    extract = EXTRACTORS[kind]
    system = CHOICE_SYSTEM_PROMPT if kind == "choice" else SYSTEM_PROMPT
    start = time.perf_counter()
    completions = engine.generate_branches(few_shot_messages(problem.question, shots, system), args.branches,
                                           SamplingParams(**{**params.__dict__, "seed": 1000 + qi}))
    generate_s = time.perf_counter() - start
    branches = [BranchAnswer(c.text, extract(c.text), c.confidence) for c in completions]
    names = [a for a in ARMS if a in args.arms] if qi % args.timed_every == 0 else ["full"]
    # Interleaved per question, in an order rotated each question, so drift and the cache warmth
    # the first arm leaves behind (the question's prefix prefill) do not always favour one arm.
    turn = (qi // args.timed_every) % len(names)  # counts timed questions, so the order really rotates
    rotated = names[turn:] + names[:turn]
    arms, trace = {}, None
    for arm in rotated:
        start = time.perf_counter()
        # The full arm is the recorder: its pass also keeps the lens of every layer (30 products of
        # 2 x 576 per candidate, milliseconds against a pass of seconds), which calibration replays.
        answer, report, summary = verify_and_pick(problem.question, branches, recorder if arm == "full" else judge,
                                                  ARMS[arm])
        arms[arm] = {"answer": answer, "skipped": report.skipped, "verify_s": time.perf_counter() - start,
                     "check_s": report.check_s, "exit_layer": report.exit_layers[0] if report.exit_layers else None,
                     "time_saved_s": report.time_saved_s, "num_candidates": len(summary.shares)}
        if arm == "full" and summary.shares:
            trace = recorder.last_traces[0]
    record = CalibrationRecord(summary, arms["full"]["answer"], None if trace is None else trace.lens_logits).to_dict()
    record.update(index=qi, question=problem.question, gold=problem.answer, generate_s=generate_s, arms=arms,
                  branches=[{"answer": b.answer, "confidence": b.confidence, "text": b.text} for b in branches])
    if trace is not None:
        record.update(full_pass_s=trace.pass_s, full_prefill_s=trace.prefill_s)
    return record


def run_arms(args: argparse.Namespace, out: Path) -> tuple[dict, list[dict]]:
    """Generate each question's branches once and decide under every timed arm, saving as it goes."""
    engine = harness.load_engine(args)
    kind, shots, questions = load_questions(args)
    judge_prompt = CHOICE_JUDGE_PROMPT if kind == "choice" else JUDGE_SYSTEM_PROMPT
    judge = LLMJudgeVerifier(engine, system_prompt=judge_prompt)
    recorder = LLMJudgeVerifier(engine, system_prompt=judge_prompt, record_lens=True)
    params = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=args.max_new_tokens, stop=("<|im_end|>",))
    meta = {"workload": "arms", "model": engine.model_name, "format": kind, "source": args.data or f"synthetic {kind}",
            "branches": args.branches, "shots": args.shots, "max_new_tokens": args.max_new_tokens,
            "torch_threads": torch.get_num_threads(), "arms": sorted(args.arms), "timed_every": args.timed_every,
            "arm_configs": {name: config.__dict__ for name, config in ARMS.items()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    raw, started = [], time.perf_counter()
    for qi, problem in enumerate(tqdm(questions, desc="questions")):
        if args.time_budget_min is not None and time.perf_counter() - started > args.time_budget_min * 60:
            print(f"time budget of {args.time_budget_min} min reached after {qi} questions")
            break
        raw.append(run_question(qi, problem, shots, kind, engine, judge, recorder, params, args))
        if qi % 5 == 4:  # saved as it goes, so an interrupted run still leaves its records
            out.write_text(json.dumps({"meta": meta, "records": raw}))
    meta["wall_s"] = time.perf_counter() - started
    out.write_text(json.dumps({"meta": meta, "records": raw}))
    print(f"wrote {len(raw)} raw records to {out}")
    return meta, raw


def replay(record: CalibrationRecord, config: CGEEConfig) -> tuple[str | None, bool, int | None]:
    """``(answer, skipped, exit_layer)`` that ``config`` would give on a recorded question."""
    summary = record.summary
    if summary.winner is None:
        return None, False, None
    if should_skip(summary, config)[0]:
        return summary.winner, True, None
    num_layers = record.lens_logits.shape[0]
    layer = lens_exit_layer(lens_entropy(record.lens_logits), config)
    if layer == num_layers - 1:
        return record.full_answer, False, layer
    return pick_answer(summary, record.lens_logits[layer].softmax(-1)[:, 0].tolist()), False, layer


def timing_model(raw: list[dict], arm_configs: dict[str, CGEEConfig] | None = None) -> dict:
    """Mean measured costs: generation per question, full verification, seconds per layer and per
    check. ``arm_configs`` are the configs the timed arms ran with (the run's ``meta``)."""
    arm_configs = arm_configs or ARMS
    full = [r["arms"]["full"] for r in raw if r["arms"].get("full", {}).get("num_candidates")]
    num_layers = len(raw[0]["lens_logits"]) if raw and raw[0].get("lens_logits") else 30
    checks = [(a["check_s"], min(a["exit_layer"], num_layers - 2) - arm_configs[name].min_layer + 1)
              for r in raw for name, a in r["arms"].items()
              if arm_configs[name].exit_enabled and a["exit_layer"] is not None and a["check_s"] > 0]
    per_check_s = sum(c for c, _ in checks) / max(1, sum(k for _, k in checks)) if checks else 0.0
    full_verify_s = sum(a["verify_s"] for a in full) / max(1, len(full))
    full_pass_s = [r["full_pass_s"] for r in raw if "full_pass_s" in r]
    per_layer_s = sum(full_pass_s) / max(1, len(full_pass_s)) / num_layers
    return {"generate_s": sum(r["generate_s"] for r in raw) / len(raw), "full_verify_s": full_verify_s,
            "per_layer_s": per_layer_s, "per_check_s": per_check_s, "num_layers": num_layers}


def estimate_e2e(raw: list[dict], config: CGEEConfig, cost: dict) -> float:
    """End-to-end time of ``config`` over always-full verification, from the measured per-question
    generation and full-verification times and the measured per-layer and per-check costs."""
    cgee_s = full_s = 0.0
    for r in raw:
        full_verify = r["arms"].get("full", {}).get("verify_s", cost["full_verify_s"])
        full_s += r["generate_s"] + full_verify
        if not r["shares"]:
            cgee_s += r["generate_s"] + full_verify
            continue
        _, skipped, layer = replay(CalibrationRecord.from_dict(r), config)
        verify = 0.0
        if not skipped:
            layers_saved = cost["num_layers"] - 1 - layer
            checks = max(0, min(layer, cost["num_layers"] - 2) - config.min_layer + 1) if config.exit_enabled else 0
            verify = full_verify - layers_saved * cost["per_layer_s"] + checks * cost["per_check_s"]
        cgee_s += r["generate_s"] + verify
    return cgee_s / full_s


def describe(raw: list[dict], config: CGEEConfig, cost: dict) -> dict:
    records = [CalibrationRecord.from_dict(r) for r in raw if r["shares"]]
    outcomes = [replay(rec, config) for rec in records]
    errors = sum(answer != rec.full_answer for rec, (answer, _, _) in zip(records, outcomes))
    exits = [layer for _, skipped, layer in outcomes if not skipped and layer is not None]
    gold = {r["index"]: r["gold"] for r in raw}
    correct = sum(answer == gold[r["index"]] for r, (answer, _, _) in zip([r for r in raw if r["shares"]], outcomes))
    n = len(records)
    return {"calls": n, "skip_rate": sum(s for _, s, _ in outcomes) / max(1, n),
            "mean_exit_layer_1based": sum(exits) / len(exits) + 1 if exits else None,
            "errors": errors, "error_rate": errors / max(1, n), "wilson": wilson_interval(errors, n),
            "accuracy": correct / max(1, len(raw)), "end_to_end_ratio_est": estimate_e2e(raw, config, cost)}


def calibration_report(raw: list[dict], target_error: float, arm_configs: dict[str, CGEEConfig]) -> dict:
    cost = timing_model(raw, arm_configs)
    check_cost = cost["per_check_s"] / cost["per_layer_s"] if cost["per_layer_s"] else 0.0
    records = [CalibrationRecord.from_dict(r) for r in raw]
    chosen = calibrate(records, target_error, check_cost=check_cost)
    level1 = calibrate([(r.summary, r.full_answer) for r in records], target_error)
    # Two-fold held-out check: thresholds picked on one half, errors counted on the other.
    held_errors = held_calls = 0
    for fold in (0, 1):
        train = [r for r in raw if r["index"] % 2 == fold]
        test = [r for r in raw if r["index"] % 2 != fold and r["shares"]]
        if not [r for r in train if r["shares"]] or not test:
            continue
        picked = calibrate([CalibrationRecord.from_dict(r) for r in train], target_error, check_cost=check_cost).config
        d = describe(test, picked, cost)
        held_errors, held_calls = held_errors + d["errors"], held_calls + d["calls"]
    calls = [r for r in records if r.summary.winner is not None]
    overturned = sum(r.full_answer != r.summary.winner for r in calls)
    return {"cost": cost, "check_cost_layers": check_cost, "target_error": target_error,
            "full_overturns_vote": {"count": overturned, "calls": len(calls),
                                    "wilson": wilson_interval(overturned, len(calls))},
            "chosen": chosen.config.__dict__, "chosen_on_all": describe(raw, chosen.config, cost),
            "level1_only": level1.config.__dict__, "level1_only_on_all": describe(raw, level1.config, cost),
            "current_default_on_all": describe(raw, CGEEConfig(), cost),
            "held_out": {"errors": held_errors, "calls": held_calls, "wilson": wilson_interval(held_errors, held_calls)}}


def print_arms(raw: list[dict], meta: dict) -> list[dict]:
    """The timed arms, each over the questions it ran on (all of them, or every ``--timed-every``-th)."""
    rows = []
    for arm in [a for a in ARMS if any(a in r["arms"] for r in raw)]:
        timed = [r for r in raw if arm in r["arms"]]
        calls = [r for r in timed if r["shares"]]
        n = len(calls)
        generate_s = sum(r["generate_s"] for r in timed)
        full_verify = sum(r["arms"]["full"]["verify_s"] for r in timed)
        results = [r["arms"][arm] for r in timed]
        verify_s = sum(a["verify_s"] for a in results)
        differ = sum(r["arms"][arm]["answer"] != r["arms"]["full"]["answer"] for r in calls)
        exits = [a["exit_layer"] for a in results if a["exit_layer"] is not None]
        saved = [a["time_saved_s"] for a in results if a["time_saved_s"] is not None]
        low, high = wilson_interval(differ, n)
        rows.append({"arm": arm, "skip_rate": sum(a["skipped"] for a in results) / max(1, n),
                     "mean_exit_layer": sum(exits) / len(exits) + 1 if exits else None,
                     "verify_s": verify_s, "verify_ratio": verify_s / full_verify,
                     "end_to_end_ratio": (generate_s + verify_s) / (generate_s + full_verify),
                     "check_ms": sum(a["check_s"] for a in results) * 1000,
                     "time_saved_est_s": sum(saved), "measured_saving_s": full_verify - verify_s,
                     "errors": differ, "calls": n, "error_rate": differ / max(1, n),
                     "wilson_low": low, "wilson_high": high,
                     "questions": len(timed),
                     "accuracy": sum(r["arms"][arm]["answer"] == r["gold"] for r in timed) / len(timed)})
    print(f"\n{len(raw)} questions ({sum(bool(r['shares']) for r in raw)} with a candidate) x {meta['branches']} "
          f"branches, {meta['shots']}-shot, {meta['format']} from {meta['source']}, model {meta['model']}; "
          f"generation {sum(r['generate_s'] for r in raw):.1f}s in all\n")
    print("| arm (questions timed) | skip rate | mean exit layer (1-based, of 30) | verify vs full | end-to-end vs full | exit-check ms "
          "| est. saved s (per-call sum) | measured saved s | differs from full | error [Wilson 95%] | accuracy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        exit_layer = f"{r['mean_exit_layer']:.1f}" if r["mean_exit_layer"] else "-"
        print(f"| {r['arm']} ({r['questions']}) | {r['skip_rate']:.0%} | {exit_layer} | {r['verify_ratio']:.2f}x | "
              f"{r['end_to_end_ratio']:.3f}x | {r['check_ms']:.0f} | {r['time_saved_est_s']:.2f} | "
              f"{r['measured_saving_s']:.2f} | {r['errors']}/{r['calls']} | {r['error_rate']:.1%} "
              f"[{r['wilson_low']:.1%}, {r['wilson_high']:.1%}] | {r['accuracy']:.1%} |")
    return rows


def print_calibration(report: dict) -> None:
    print(f"\nCalibration at target decision error {report['target_error']:.0%} (Wilson 95% upper bound); "
          f"exit check = {report['check_cost_layers']:.2f} decoder layers of the pass")
    print("| thresholds | skip rate | mean exit layer (1-based) | differs from full | error [Wilson 95%] "
          "| est. end-to-end vs full | accuracy |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, config_key, key in (("chosen (both levels)", "chosen", "chosen_on_all"),
                                   ("chosen (level 1 only)", "level1_only", "level1_only_on_all"),
                                   ("library default, CGEEConfig()", None, "current_default_on_all")):
        d = report[key]
        c = report[config_key] if config_key else CGEEConfig().__dict__
        name = (f"{label}: skip={c['skip_enabled']} tau={c['tau_conf']} margin={c['margin']} exit={c['exit_enabled']}"
                + (f" theta={c['theta']} eps={c['epsilon']} min_layer={c['min_layer']}" if c["exit_enabled"] else ""))
        exit_layer = f"{d['mean_exit_layer_1based']:.1f}" if d["mean_exit_layer_1based"] else "-"
        print(f"| {name} | {d['skip_rate']:.1%} | {exit_layer} | {d['errors']}/{d['calls']} | {d['error_rate']:.1%} "
              f"[{d['wilson'][0]:.1%}, {d['wilson'][1]:.1%}] | {d['end_to_end_ratio_est']:.3f}x | {d['accuracy']:.1%} |")
    o = report["full_overturns_vote"]
    print(f"Full verification picked an answer other than the vote winner in {o['count']}/{o['calls']} calls "
          f"[Wilson 95% {o['wilson'][0]:.1%}, {o['wilson'][1]:.1%}]; a skip errs only on those.")
    c = report["cost"]
    print(f"Measured means per question: generation {c['generate_s']:.1f}s, full verification {c['full_verify_s']:.2f}s, "
          f"{c['per_layer_s'] * 1000:.1f} ms per verifier layer, {c['per_check_s'] * 1000:.2f} ms per exit check")
    h = report["held_out"]
    print(f"Two-fold held-out check of the chosen procedure: {h['errors']}/{h['calls']} decisions differ from full "
          f"[Wilson 95% {h['wilson'][0]:.1%}, {h['wilson'][1]:.1%}]")


def main(argv: list[str] | None = None) -> None:
    parser = harness.bench_parser(__file__, __doc__, json_out="none")
    parser.add_argument("--workload", choices=("arms", "ladder"), default="arms",
                        help="arms: time the CGEE arms on --data / --synthetic questions (default); ladder: the "
                             "difficulty ladder, always-verify recorded per question, thresholds chosen on half")
    parser.add_argument("--data", default=None, help="GSM8K or multiple-choice JSONL (default: synthetic)")
    parser.add_argument("--synthetic", choices=("gsm8k", "choice"), default="gsm8k")
    parser.add_count("--questions", 12)
    parser.add_argument("--time-budget-min", type=float, default=None, help="stop starting questions after this")
    parser.add_count("--branches", 8)
    parser.add_argument("--shots", type=int, default=4)
    parser.add_max_new_tokens(96, "token budget per branch")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"timed arms, from {list(ARMS)} ('full' always runs)")
    parser.add_argument("--timed-every", type=int, default=1,
                        help="run the arms other than 'full' on every k-th question only (default 1: all)")
    parser.add_argument("--target-error", type=float, default=None,
                        help="largest decision error (Wilson 95%% upper bound) a calibration may choose; default 0.05, ladder 0.01")
    parser.add_count("--per-level", 8, "ladder: questions per level")
    parser.add_argument("--levels", default="1,2,3,4", help="ladder: comma-separated levels (steps), from 1 to 4")
    parser.add_count("--batch", 16, "ladder: questions whose branches are submitted together")
    parser.add_seed(0, "ladder: seed of the generated questions and of the split")
    parser.add_argument("--rule", choices=("wilson", "observed"), default="wilson",
                        help="ladder: accuracy rule the thresholds are held to (see calibration.OutcomeSummary.keeps_accuracy)")
    parser.add_argument("--candidate", default=None, help="ladder: also tabulate 'TAU,MARGIN' on every question")
    parser.add_argument("--record-lens", action="store_true",
                        help="ladder: also record the logit lens of every verifier pass (for level-2 analysis)")
    parser.add_argument("--records-out", default=None,
                        help="default benchmarks/results/cgee_records.json (ladder: cgee_ladder_records.json)")
    parser.add_json_out(None, "default benchmarks/results/cgee.json (ladder: cgee_ladder.json)")
    parser.add_argument("--from-records", default=None, help="calibrate from saved records; generate nothing")
    parser.add_argument("--untimed", default=None,
                        help="ladder: question indices (e.g. 480-799) whose batches ran beside other work; they "
                             "count in decisions and accuracy, not in seconds")
    parser.add_argument("--plot", default=None, help="ladder: write the confidence and skip-rate plot to this PNG")
    parser.add_argument("--resume", action="store_true",
                        help="ladder: keep the records already in --records-out and run only the missing questions")
    parser.add_threads()
    args = parser.parse_args(argv)
    args.arms = {"full", *[a.strip() for a in args.arms.split(",") if a.strip()]}
    unknown = args.arms - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {list(ARMS)}")
    candidate = None
    if args.candidate:
        try:
            tau, margin = (float(x) for x in args.candidate.split(","))
            candidate = CGEEConfig(skip_enabled=True, tau_conf=tau, margin=margin)
        except ValueError as exc:
            parser.error(f"--candidate must be 'TAU,MARGIN' with both in [0, 1]: {exc}")
    try:
        untimed = parse_index_ranges(args.untimed)
    except ValueError as exc:
        parser.error(f"--untimed: {exc}")
    if args.workload == "ladder" and not args.data:
        try:
            ladder_problems(1, tuple(int(x) for x in args.levels.split(",") if x.strip()))
        except (TypeError, ValueError) as exc:
            parser.error(f"--levels: {exc}")
    prefix = "cgee_ladder" if args.workload == "ladder" else "cgee"
    args.records_out = args.records_out or f"benchmarks/results/{prefix}_records.json"
    args.json_out = args.json_out or Path(f"benchmarks/results/{prefix}.json")

    if args.from_records:
        saved = json.loads(Path(args.from_records).read_text())
        meta, raw = saved["meta"], saved["records"]
        workload = meta.get("workload", "arms")
    else:
        harness.start_run(args)
        workload = args.workload
        meta, raw = (run_ladder if workload == "ladder" else run_arms)(args, Path(args.records_out))

    if workload == "ladder":
        report = ladder_report(raw, seed=args.seed, rule=args.rule, candidate=candidate,
                               target_error=args.target_error if args.target_error is not None else 0.01,
                               untimed=untimed)
        print_ladder(report, meta)
        write_json(args.json_out, {"meta": meta, "ladder": report})
        if args.plot:
            plot_ladder(report, Path(args.plot))
        return
    rows = print_arms(raw, meta)
    # Older record files lack the arm configs; they ran with the defaults of the time (see the note).
    arm_configs = {name: CGEEConfig(**c) for name, c in meta.get("arm_configs", {}).items()} or ARMS
    report = calibration_report(raw, args.target_error if args.target_error is not None else 0.05, arm_configs)
    print_calibration(report)
    write_json(args.json_out, {"meta": meta, "arms": rows, "calibration": report})


def write_json(out: Path, data: dict) -> None:
    harness.write_json(out, data)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
