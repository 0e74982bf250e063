"""The difficulty ladder of ``benchmarks/cgee.py --workload ladder``: where CGEE's level-1 skip can act.

Questions come from the generated ladder (``ladder_problems``: 1- to 4-step arithmetic word problems
after one-step worked examples worded unlike them) or from ``--data`` rows leveled by their
solution's steps. Each batch of questions has its branches submitted together, then each vote is
verified at full depth on its own and timed; a record per question keeps what
``calibration.calibrate_split`` needs. ``ladder_report`` picks thresholds on a seeded half and
tabulates them per level on the other half, beside the library default on every question.
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

from rksc_bench import harness
from rksc_bench.plots import pyplot, save_figure
from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.evaluation.calibration import (
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
from rksc_engine.reasoning.cgee import CGEEConfig
from rksc_engine.reasoning.few_shot import CHOICE_SYSTEM_PROMPT, SYSTEM_PROMPT, Problem, few_shot_messages
from rksc_engine.reasoning.self_consistency import finish_reasoning, plan_reasoning
from rksc_engine.reasoning.verifier import JUDGE_SYSTEM_PROMPT, LLMJudgeVerifier

CHOICE_JUDGE_PROMPT = "You check answers to multiple-choice questions. Reply with Yes or No only."


def load_questions(args: argparse.Namespace) -> tuple[str, list, list]:
    """``(format, shots, questions)``."""
    if args.data:
        kind, rows = load_problems_jsonl(args.data, limit=args.shots + args.questions)
        return kind, rows[: args.shots], rows[args.shots:]
    if args.synthetic == "choice":
        return "choice", synthetic_choice_problems(args.shots, seed=1), synthetic_choice_problems(args.questions, seed=1234)
    return "gsm8k", synthetic_problems(args.shots, seed=1), synthetic_problems(args.questions, seed=1234)



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
    engine = harness.load_engine(args)
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
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(10, 4.4))
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
    save_figure(fig, path)


