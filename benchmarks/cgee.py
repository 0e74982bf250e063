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
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.evaluation.calibration import (
    CalibrationRecord,
    OutcomeSummary,
    QuestionOutcome,
    calibrate,
    calibrate_split,
    summarise_outcomes,
    wilson_interval,
)
from rksc_engine.evaluation.workloads import (
    ladder_problems,
    ladder_shots,
    load_problems_jsonl,
    solution_steps,
    synthetic_choice_problems,
    synthetic_problems,
)
from rksc_engine.reasoning.cgee import CGEEConfig, lens_entropy, lens_exit_layer, pick_answer, should_skip
from rksc_engine.reasoning.few_shot import CHOICE_SYSTEM_PROMPT, SYSTEM_PROMPT, Problem, few_shot_messages
from rksc_engine.reasoning.self_consistency import (
    EXTRACTORS,
    BranchAnswer,
    finish_reasoning,
    plan_reasoning,
    verify_and_pick,
)
from rksc_engine.reasoning.verifier import JUDGE_SYSTEM_PROMPT, LLMJudgeVerifier

ARMS = {
    "full": CGEEConfig.off(),
    "skip": CGEEConfig(skip_enabled=True, exit_enabled=False),
    "skip+exit": CGEEConfig(skip_enabled=True, exit_enabled=True),
    "exit": CGEEConfig(skip_enabled=False, exit_enabled=True),
}
CHOICE_JUDGE_PROMPT = "You check answers to multiple-choice questions. Reply with Yes or No only."


def load_questions(args: argparse.Namespace) -> tuple[str, list, list]:
    """``(format, shots, questions)``."""
    if args.data:
        kind, rows = load_problems_jsonl(args.data, limit=args.shots + args.questions)
        return kind, rows[: args.shots], rows[args.shots:]
    if args.synthetic == "choice":
        return "choice", synthetic_choice_problems(args.shots, seed=1), synthetic_choice_problems(args.questions, seed=1234)
    return "gsm8k", synthetic_problems(args.shots, seed=1), synthetic_problems(args.questions, seed=1234)


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
    engine = RKSCEngine.from_pretrained(args.model)
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


# -- the difficulty ladder --------------------------------------------------------------------------
def problem_level(problem: Problem, kind: str) -> int:
    """A question's difficulty level: the steps of its worked solution (``solution_steps``; a
    ``LadderProblem``'s ``level``), or 0 for multiple choice, whose solutions do not count steps."""
    return 0 if kind == "choice" else solution_steps(problem)


def ladder_questions(args: argparse.Namespace) -> tuple[str, list[Problem], list[Problem]]:
    """``(format, shots, questions)``: the generated ladder, or ``--data`` rows (levels by ``problem_level``)."""
    if args.data:
        return load_questions(args)
    levels = tuple(int(x) for x in args.levels.split(",") if x.strip())
    return "gsm8k", ladder_shots(args.shots, seed=1), ladder_problems(args.per_level, levels, seed=args.seed)


def run_ladder_batch(engine: RKSCEngine, judge: LLMJudgeVerifier, batch: Sequence[tuple[int, Problem]],
                     shots: list[Problem], kind: str, params: SamplingParams, branches: int) -> list[dict]:
    """One raw record per question of ``batch`` (``(index, problem)`` pairs).

    Every question's branches are queued at once, so the scheduler decodes them as one batch (up to
    ``scheduler.max_batch_rows``); then each vote is verified at full depth, one question at a time
    with nothing else running, so each verification's measured seconds (``verify_s``) are its own. Question ``i``'s branches are
    seeded ``1000 * (i + 1) + b``, so a rerun draws the same branches. A record holds the
    ``QuestionOutcome`` fields (``shares``, ``full_answer``, ``gold``, ``verify_s``, ``level``) plus
    ``generate_s`` (the batch's generation wall time over its questions) and the branches.
    """
    system = CHOICE_SYSTEM_PROMPT if kind == "choice" else SYSTEM_PROMPT
    plans = [plan_reasoning(engine, problem.question, n=branches, params=replace(params, seed=1000 * (i + 1)),
                            prompt=few_shot_messages(problem.question, shots, system), answer_extractor=kind,
                            verifier=judge, cgee=CGEEConfig.off())
             for i, problem in batch]
    start = time.perf_counter()
    with engine.exclusive():  # no step starts until every request is queued, so the first admits them together
        handles = [engine.submit(plan.messages, plan.n, plan.params) for plan in plans]
    completions = [handle.result() for handle in handles]
    generate_s = (time.perf_counter() - start) / len(batch)
    records = []
    for (i, problem), plan, branch_completions in zip(batch, plans, completions):
        result = finish_reasoning(plan, branch_completions, generate_s)
        report = result.verification
        outcome = QuestionOutcome(result.vote_summary, result.answer, problem.answer, report.verify_s,
                                  problem_level(problem, kind))
        record = outcome.to_dict()
        record.update(index=i, question=problem.question, generate_s=generate_s, p=report.p, lead=report.lead,
                      branches=[{"answer": b.answer, "confidence": b.confidence, "text": b.text} for b in result.branches])
        if report.scores:
            trace = judge.last_traces[0]
            record.update(full_pass_s=trace.pass_s, full_prefill_s=trace.prefill_s,
                          scores=[s.score for s in report.scores])
            if trace.lens_logits is not None:
                record["lens_logits"] = trace.lens_logits.tolist()
        records.append(record)
    return records


def run_ladder(args: argparse.Namespace, out: Path) -> tuple[dict, list[dict]]:
    """Generate and verify the ladder batch by batch, saving the records after each batch."""
    engine = RKSCEngine.from_pretrained(args.model)
    kind, shots, questions = ladder_questions(args)
    judge = LLMJudgeVerifier(engine, system_prompt=CHOICE_JUDGE_PROMPT if kind == "choice" else JUDGE_SYSTEM_PROMPT,
                             record_lens=args.record_lens)
    params = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=args.max_new_tokens, stop=("<|im_end|>",))
    meta = {"workload": "ladder", "model": engine.model_name, "format": kind,
            "source": args.data or f"ladder levels {args.levels}, {args.per_level} per level, seed {args.seed}",
            "branches": args.branches, "shots": args.shots, "max_new_tokens": args.max_new_tokens,
            "batch": args.batch, "torch_threads": torch.get_num_threads(), "device": str(engine.device)}
    out.parent.mkdir(parents=True, exist_ok=True)
    raw, started, earlier_s = [], time.perf_counter(), 0.0
    indexed = list(enumerate(questions))
    if args.resume and out.exists():
        # Questions and seeds are fixed by index (and asking for more questions only appends), so a
        # run can be continued across sessions: keep the saved records, run only the missing indices.
        saved = json.loads(out.read_text())
        settings = ("workload", "model", "format", "source", "branches", "shots", "max_new_tokens")
        changed = [k for k in settings if saved["meta"].get(k) != meta.get(k)]
        if changed:
            raise SystemExit(f"--resume: {out} was recorded with other settings ({', '.join(changed)})")
        raw, earlier_s = saved["records"], saved["meta"].get("wall_s", 0.0)
        done = {r["index"] for r in raw}
        indexed = [(i, q) for i, q in indexed if i not in done]
        print(f"resuming: {len(raw)} questions recorded, {len(indexed)} to go")
    for first in tqdm(range(0, len(indexed), args.batch), desc="batches"):
        if args.time_budget_min is not None and time.perf_counter() - started > args.time_budget_min * 60:
            print(f"time budget of {args.time_budget_min} min reached after {len(raw)} questions")
            break
        raw += run_ladder_batch(engine, judge, indexed[first: first + args.batch], shots, kind, params, args.branches)
        meta["wall_s"] = earlier_s + time.perf_counter() - started
        out.write_text(json.dumps({"meta": meta, "records": raw}))  # an interrupted run keeps its records
    meta["wall_s"] = earlier_s + time.perf_counter() - started
    out.write_text(json.dumps({"meta": meta, "records": raw}))
    print(f"wrote {len(raw)} raw records to {out}")
    return meta, raw


def _row(label: str, summary: OutcomeSummary, generate_s: float) -> dict:
    """One table row: the summary's counts and rates, and the end-to-end ratio against always verifying."""
    full_s = generate_s + summary.verify_s
    return {"group": label, **asdict(summary), "skip_rate": summary.skip_rate,
            "decision_error_rate": summary.decision_error_rate, "decision_error_wilson": summary.decision_error_wilson,
            "vote_accuracy": summary.vote_accuracy, "full_accuracy": summary.full_accuracy,
            "cgee_accuracy": summary.cgee_accuracy, "cgee_accuracy_wilson": summary.cgee_accuracy_wilson,
            "verify_saved_fraction": summary.verify_saved_fraction, "generate_s": generate_s,
            "end_to_end_ratio": (full_s - summary.verify_s_saved) / full_s if full_s > 0 else 1.0}


def _level_rows(raw: list[dict], config: CGEEConfig, untimed: frozenset[int] = frozenset()) -> list[dict]:
    """Per level, then all levels together, what ``config`` does on ``raw``. Records whose index is
    in ``untimed`` count in every decision and accuracy figure but not in the seconds."""
    def row(label: str, group: list[dict]) -> dict:
        summary = summarise_outcomes([QuestionOutcome.from_dict(r) for r in group], config)
        timed = [r for r in group if r["index"] not in untimed]
        seconds = summarise_outcomes([QuestionOutcome.from_dict(r) for r in timed], config) if timed else None
        summary = replace(summary, verify_s=seconds.verify_s if seconds else 0.0,
                          verify_s_saved=seconds.verify_s_saved if seconds else 0.0)
        return _row(label, summary, sum(r["generate_s"] for r in timed))

    rows = [row(str(level), [r for r in raw if r["level"] == level]) for level in sorted({r["level"] for r in raw})]
    rows.append(row("all", raw))
    return rows


def parse_index_ranges(text: str | None) -> frozenset[int]:
    """``"480-799,900"`` -> those indices; ``None`` or ``""`` -> none."""
    indices: set[int] = set()
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"untimed must be comma-separated indices or ranges like 480-799, got {part!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"untimed range {part!r} must be 0 <= first <= last")
        indices.update(range(first, last + 1))
    return frozenset(indices)


CONFIDENCE_BINS = (0.0, 0.3, 0.45, 0.6, 0.8, 1.01)


def confidence_bins(raw: list[dict], edges: Sequence[float] = CONFIDENCE_BINS) -> list[dict]:
    """How the vote's confidence ``p`` tracks right answers: per bin of ``p`` (``edges[i] <= p <
    edges[i + 1]``) over questions with an answer, the count, the levels present and the accuracy of
    the vote and of always verifying. A level-1 rule can only help where high ``p`` means right."""
    rows = []
    answered = [r for r in raw if r["shares"]]
    for low, high in zip(edges, edges[1:]):
        group = [r for r in answered if low <= r["p"] < high]
        n = len(group)
        vote = sum(str(r["shares"][0][0]) == str(r["gold"]) for r in group)
        full = sum(str(r["full_answer"]) == str(r["gold"]) for r in group)
        levels = {level: sum(r["level"] == level for r in group) for level in sorted({r["level"] for r in answered})}
        rows.append({"low": low, "high": min(high, 1.0), "questions": n, "by_level": levels,
                     "vote_correct": vote, "full_correct": full, "vote_accuracy_wilson": wilson_interval(vote, n)})
    return rows


def ladder_report(raw: list[dict], *, seed: int = 0, rule: str = "wilson", candidate: CGEEConfig | None = None,
                  target_error: float = 0.01, untimed: frozenset[int] = frozenset()) -> dict:
    """Per-level tables (library default on every question; thresholds chosen on one half, by
    ``calibrate_split``'s accuracy rule and by ``calibrate``'s decision-error rule at
    ``target_error``, on the other half; ``candidate`` on every question) and the split's result.
    Questions in ``untimed`` (indices whose batches ran beside other work) count in the decisions
    and accuracies but not in any seconds."""
    outcomes = [QuestionOutcome.from_dict(r) for r in raw]
    split = calibrate_split(outcomes, seed=seed, rule=rule)
    held = [raw[i] for i in split.held_out_indices]
    # The accuracy rule cannot tell thresholds apart when the judge never changes a right answer into a
    # wrong one or back; agreeing with always verifying is the stricter rule that still holds for a
    # judge that does, so both choices are reported.
    verified = [(outcomes[i].summary, outcomes[i].full_answer) for i in split.calibration_indices
                if outcomes[i].summary.winner is not None]
    agreement = calibrate(verified, target_error).config if verified else CGEEConfig(skip_enabled=False)
    held_outcomes = [outcomes[i] for i in split.held_out_indices]
    tables = {"library default CGEEConfig(), all questions": _level_rows(raw, CGEEConfig(), untimed),
              "chosen on the calibration half by accuracy, held-out half": _level_rows(held, split.config, untimed),
              f"chosen on the calibration half by decision error <= {target_error:.0%} (Wilson 95% upper bound), "
              f"held-out half (tau={agreement.tau_conf} margin={agreement.margin} skip={agreement.skip_enabled})":
                  _level_rows(held, agreement, untimed)}
    if candidate is not None:
        tables[f"candidate tau={candidate.tau_conf} margin={candidate.margin}, all questions"] = _level_rows(raw, candidate, untimed)
    timed = [r for r in raw if r["index"] not in untimed]
    generate_s, verify_s = sum(r["generate_s"] for r in timed), sum(r.get("verify_s", 0.0) for r in timed)
    return {"rule": rule, "seed": seed, "tables": tables,
            "chosen": {"tau_conf": split.config.tau_conf, "margin": split.config.margin,
                       "skip_enabled": split.config.skip_enabled},
            "chosen_by_decision_error": {"tau_conf": agreement.tau_conf, "margin": agreement.margin,
                                         "skip_enabled": agreement.skip_enabled, "target_error": target_error,
                                         "keeps_accuracy_held_out":
                                             summarise_outcomes(held_outcomes, agreement).keeps_accuracy(rule)},
            "calibration_half": _row("calibration half", split.calibration, 0.0),
            "keeps_accuracy_held_out": split.keeps_accuracy_held_out,
            "verifier_decisions": sum(bool(r["shares"]) for r in raw), "timed_questions": len(timed),
            "generate_s": generate_s, "verify_s": verify_s,
            "verify_share": verify_s / (generate_s + verify_s) if generate_s + verify_s > 0 else 0.0,
            "confidence_bins": confidence_bins(raw)}


def print_ladder(report: dict, meta: dict) -> None:
    print(f"\nDifficulty ladder: {meta['source']}; {meta['branches']} branches, {meta['shots']}-shot, model "
          f"{meta['model']}; {report['verifier_decisions']} verifier decisions"
          + (f", run took {meta['wall_s'] / 60:.1f} min" if "wall_s" in meta else ""))
    for title, rows in report["tables"].items():
        print(f"\n{title}\n")
        print("| level | questions | decisions | vote acc | always-verify acc | CGEE acc [Wilson 95%] | skip rate "
              "| decision error vs always-verify [Wilson 95%] | skips lost / gained | verifier time saved "
              "| end-to-end vs always-verify |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            low, high = r["cgee_accuracy_wilson"]
            e_low, e_high = r["decision_error_wilson"]
            print(f"| {r['group']} | {r['num_questions']} | {r['num_decisions']} | {r['vote_accuracy']:.1%} "
                  f"| {r['full_accuracy']:.1%} | {r['cgee_accuracy']:.1%} [{low:.1%}, {high:.1%}] | {r['skip_rate']:.1%} "
                  f"| {r['num_decision_errors']}/{r['num_decisions']} = {r['decision_error_rate']:.1%} "
                  f"[{e_low:.1%}, {e_high:.1%}] | {r['num_lost']} / {r['num_gained']} | {r['verify_s_saved']:.2f}s ({r['verify_saved_fraction']:.0%}) "
                  f"| {r['end_to_end_ratio']:.3f}x |")
    print("\nThe vote's confidence p against right answers (questions with an answer):\n")
    print("| p | questions | by level | vote acc [Wilson 95%] | always-verify acc |")
    print("|---|---:|---|---:|---:|")
    for b in report.get("confidence_bins", []):
        n = b["questions"]
        levels = ", ".join(f"L{k}: {v}" for k, v in b["by_level"].items())
        low, high = b["vote_accuracy_wilson"]
        vote = f"{b['vote_correct'] / n:.1%} [{low:.1%}, {high:.1%}]" if n else "-"
        full = f"{b['full_correct'] / n:.1%}" if n else "-"
        print(f"| [{b['low']:.2f}, {b['high']:.2f}{']' if b['high'] >= 1 else ')'} | {n} | {levels} | {vote} | {full} |")
    c, cal = report["chosen"], report["calibration_half"]
    print(f"\nChosen on the calibration half (rule '{report['rule']}', split seed {report['seed']}): "
          f"skip={c['skip_enabled']} tau_conf={c['tau_conf']} margin={c['margin']}; there it skipped "
          f"{cal['skip_rate']:.1%} at accuracy {cal['cgee_accuracy']:.1%} vs always-verify {cal['full_accuracy']:.1%}. "
          f"On the held-out half it {'kept' if report['keeps_accuracy_held_out'] else 'did NOT keep'} accuracy by that rule.")
    d = report["chosen_by_decision_error"]
    print(f"Chosen on the calibration half for decision error <= {d['target_error']:.0%} (Wilson 95% upper bound): "
          f"skip={d['skip_enabled']} tau_conf={d['tau_conf']} margin={d['margin']}; on the held-out half it "
          f"{'kept' if d['keeps_accuracy_held_out'] else 'did NOT keep'} accuracy by rule '{report['rule']}'.")
    print(f"Verification is {report['verify_share']:.1%} of the always-verify pipeline's time over the "
          f"{report['timed_questions']} timed questions (generation "
          f"{report['generate_s']:.1f}s, verification {report['verify_s']:.1f}s): skipping can save at most that share.")
    everything = report["tables"]["library default CGEEConfig(), all questions"][-1]
    if everything["full_accuracy"] < everything["vote_accuracy"]:
        print(f"The judge is LESS accurate than the vote it checks ({everything['full_accuracy']:.1%} vs "
              f"{everything['vote_accuracy']:.1%}): always verifying costs accuracy here, so every skip that "
              f"returns the vote winner can only help on average, and the no-loss rule lets CGEE skip freely.")


def plot_ladder(report: dict, path: Path) -> None:
    """Two panels: the vote's accuracy by its confidence ``p`` (Wilson 95% bars), and the skip rate
    per level of every table that skips at all."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.4))
    bins = [b for b in report["confidence_bins"] if b["questions"]]
    centres = [(b["low"] + b["high"]) / 2 for b in bins]
    accuracy = [b["vote_correct"] / b["questions"] for b in bins]
    low = [a - b["vote_accuracy_wilson"][0] for a, b in zip(accuracy, bins)]
    high = [b["vote_accuracy_wilson"][1] - a for a, b in zip(accuracy, bins)]
    left.errorbar(centres, accuracy, yerr=[low, high], marker="o", capsize=3)
    for c, a, b in zip(centres, accuracy, bins):
        left.annotate(f"n={b['questions']}", (c, a), textcoords="offset points", xytext=(6, 6), fontsize=8)
    left.set_xlabel("vote confidence p (winner's confidence-weighted share)")
    left.set_ylabel("vote accuracy")
    left.set_ylim(0, 1)
    left.set_title("Confidence tracks right answers")
    tables = [(title, rows) for title, rows in report["tables"].items() if rows[-1]["skip_rate"] > 0]
    levels = [r["group"] for r in next(iter(report["tables"].values()))[:-1]]
    width = 0.8 / max(1, len(tables))
    for k, (title, rows) in enumerate(tables):
        short = title.split(",")[0].split(" (")[0].replace("chosen on the calibration half ", "chosen ")
        right.bar([i + k * width for i in range(len(levels))], [r["skip_rate"] for r in rows[:-1]], width, label=short)
    right.set_xticks([i + 0.4 - width / 2 for i in range(len(levels))], [f"level {x}" for x in levels])
    right.set_ylabel("verifications skipped")
    right.set_ylim(0, 1.05)
    right.set_title("Skip rate by difficulty")
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("arms", "ladder"), default="arms",
                        help="arms: time the CGEE arms on --data / --synthetic questions (default); ladder: the "
                             "difficulty ladder, always-verify recorded per question, thresholds chosen on half")
    parser.add_argument("--model", default=None)
    parser.add_argument("--data", default=None, help="GSM8K or multiple-choice JSONL (default: synthetic)")
    parser.add_argument("--synthetic", choices=("gsm8k", "choice"), default="gsm8k")
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--time-budget-min", type=float, default=None, help="stop starting questions after this")
    parser.add_argument("--branches", type=int, default=8)
    parser.add_argument("--shots", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"timed arms, from {list(ARMS)} ('full' always runs)")
    parser.add_argument("--timed-every", type=int, default=1,
                        help="run the arms other than 'full' on every k-th question only (default 1: all)")
    parser.add_argument("--target-error", type=float, default=None,
                        help="largest decision error (Wilson 95%% upper bound) a calibration may choose; default 0.05, ladder 0.01")
    parser.add_argument("--per-level", type=int, default=8, help="ladder: questions per level")
    parser.add_argument("--levels", default="1,2,3,4", help="ladder: comma-separated levels (steps), from 1 to 4")
    parser.add_argument("--batch", type=int, default=16, help="ladder: questions whose branches are submitted together")
    parser.add_argument("--seed", type=int, default=0, help="ladder: seed of the generated questions and of the split")
    parser.add_argument("--rule", choices=("wilson", "observed"), default="wilson",
                        help="ladder: accuracy rule the thresholds are held to (see calibration.OutcomeSummary.keeps_accuracy)")
    parser.add_argument("--candidate", default=None, help="ladder: also tabulate 'TAU,MARGIN' on every question")
    parser.add_argument("--record-lens", action="store_true",
                        help="ladder: also record the logit lens of every verifier pass (for level-2 analysis)")
    parser.add_argument("--records-out", default=None,
                        help="default benchmarks/results/cgee_records.json (ladder: cgee_ladder_records.json)")
    parser.add_argument("--json-out", default=None, help="default benchmarks/results/cgee.json (ladder: cgee_ladder.json)")
    parser.add_argument("--from-records", default=None, help="calibrate from saved records; generate nothing")
    parser.add_argument("--untimed", default=None,
                        help="ladder: question indices (e.g. 480-799) whose batches ran beside other work; they "
                             "count in decisions and accuracy, not in seconds")
    parser.add_argument("--plot", default=None, help="ladder: write the confidence and skip-rate plot to this PNG")
    parser.add_argument("--resume", action="store_true",
                        help="ladder: keep the records already in --records-out and run only the missing questions")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads; 1 is far faster on a CPU shared with other jobs")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.arms = {"full", *[a.strip() for a in args.arms.split(",") if a.strip()]}
    unknown = args.arms - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {list(ARMS)}")
    for name in ("per_level", "batch", "branches", "questions"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
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
    args.json_out = args.json_out or f"benchmarks/results/{prefix}.json"

    if args.from_records:
        saved = json.loads(Path(args.from_records).read_text())
        meta, raw = saved["meta"], saved["records"]
        workload = meta.get("workload", "arms")
    else:
        workload = args.workload
        meta, raw = (run_ladder if workload == "ladder" else run_arms)(args, Path(args.records_out))

    if workload == "ladder":
        report = ladder_report(raw, seed=args.seed, rule=args.rule, candidate=candidate,
                               target_error=args.target_error if args.target_error is not None else 0.01,
                               untimed=untimed)
        print_ladder(report, meta)
        write_json(Path(args.json_out), {"meta": meta, "ladder": report})
        if args.plot:
            plot_ladder(report, Path(args.plot))
        return
    rows = print_arms(raw, meta)
    # Older record files lack the arm configs; they ran with the defaults of the time (see the note).
    arm_configs = {name: CGEEConfig(**c) for name, c in meta.get("arm_configs", {}).items()} or ARMS
    report = calibration_report(raw, args.target_error if args.target_error is not None else 0.05, arm_configs)
    print_calibration(report)
    write_json(Path(args.json_out), {"meta": meta, "arms": rows, "calibration": report})


def write_json(out: Path, data: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
