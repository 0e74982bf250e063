"""Benchmark: early stop of self-consistency (``rksc_engine.reasoning.early_stop``) against running every branch.

Three steps, each its own subcommand, and ``tree`` for tree search:

``record``
    Runs every question's ``--branches`` branches to their ends (``early_stop=None``) and saves each
    branch's tokens, log-probs and finish. Question ``i``'s branch ``b`` is seeded ``1000 * (i + 1) + b``,
    so the first 8 branches of a 16-branch record are exactly an 8-branch run: one record serves
    ``n = 8`` and ``n = 16``. Batches of ``--batch`` questions are decoded together; the file is
    appended batch by batch, and ``--resume`` continues it.

``replay``
    Feeds the recorded branches, step by step, to an ``EarlyStopMonitor`` exactly as the scheduler
    would (same events in the same order, stops applied before the next forward, waves forked with
    the next indices, whose tokens are the recorded ones since branch ``i`` is seeded ``seed + i``).
    This is exact for the monitor's decisions and the decoded tokens, so every rule and setting is
    measured on every question without generating again. Per rule and ``n`` it reports decode tokens
    and request steps (the slowest branch's length: a request's latency) against full ``n``, the
    changed-answer rate, accuracy against gold both ways and right answers lost (Wilson 95%
    intervals), by ladder level. Approximate rules are chosen on a seeded calibration half and
    reported on the other half.

``live``
    The whole pipeline (generation and CGEE verification with the engine's own judge), timed side by
    side on the same seeds: ``early_stop=None`` (token-exact prefix caching, today's default
    pipeline), ``decided`` and the chosen approximate rule, question by question in rotated order.

``tree``
    ``engine.tree_search`` with its children stopped early (``--rules``, default ``length`` and
    ``confidence``) against every child run to its step's end, side by side on the same seeds:
    wall time, decode tokens, children stopped, right answers and chosen answers changed.

    ./dev python benchmarks/early_stop.py record --workload ladder --per-level 8 --out benchmarks/results/es_ladder.jsonl
    ./dev python benchmarks/early_stop.py record --workload gsm8k --data ../shared/data/gsm8k_train.jsonl --questions 100 \
        --out benchmarks/results/es_gsm8k.jsonl
    ./dev python benchmarks/early_stop.py replay benchmarks/results/es_ladder.jsonl benchmarks/results/es_gsm8k.jsonl \
        --md docs/bench/early_stop_replay.md --plot docs/bench/early_stop.png
    ./dev python benchmarks/early_stop.py live --workload ladder --per-level 3 --rules "length q0.5 x2,length q0.25 x1.25"
    ./dev python benchmarks/early_stop.py tree --workload ladder --per-level 3
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rksc_bench import harness
from rksc_bench.early_stop_replay import BranchTexts, Replayed, replay_question
from rksc_bench.plots import pyplot, save_figure
from rksc_engine import SamplingParams
from rksc_engine.evaluation.calibration import wilson_interval
from rksc_engine.evaluation.workloads import (
    LADDER_LEVELS,
    ladder_problems,
    ladder_shots,
    load_gsm8k_jsonl,
    solution_steps,
    synthetic_problems,
)
from rksc_engine.reasoning.answers import extract_gsm8k_answer
from rksc_engine.reasoning.early_stop import (
    AdaptiveConfig,
    AnsweredConfig,
    ConfidenceConfig,
    EarlyStopConfig,
    LengthConfig,
)
from rksc_engine.reasoning.few_shot import Problem, few_shot_messages

PARAMS = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=160, stop=("<|im_end|>",))
# A batched decode step on this CPU costs about STEP_S plus ROW_S per live row (the default model,
# measured with benchmarks/throughput.py); used only to turn replayed steps into modelled seconds.
STEP_S, ROW_S = 0.100, 0.002


# -- questions ----------------------------------------------------------------------------------------
def load_workload(args: argparse.Namespace) -> tuple[list[Problem], list[Problem]]:
    """``(shots, questions)`` of ``--workload``: the generated ladder, or GSM8K (``--data`` JSONL,
    else the seeded synthetic GSM8K-style generator, so the benchmark runs offline)."""
    if args.workload == "ladder":
        levels = tuple(int(x) for x in args.levels.split(","))
        return ladder_shots(args.shots, seed=1), ladder_problems(args.per_level, levels, seed=args.seed)
    if args.data:
        rows = load_gsm8k_jsonl(args.data, limit=args.shots + args.questions)
        return rows[:args.shots], rows[args.shots:]
    rows = synthetic_problems(args.shots + args.questions, seed=args.seed)
    return rows[:args.shots], rows[args.shots:]


def question_seed(index: int) -> int:
    return 1000 * (index + 1)


def open_records(path: Path, mode: str):
    """A records file, gzip-compressed when its name ends in ``.gz``."""
    return gzip.open(path, mode + "t") if path.suffix == ".gz" else path.open(mode)


def read_records(path: Path) -> list[dict]:
    with open_records(path, "r") as f:
        return [json.loads(line) for line in f if line.strip()]


# -- record -------------------------------------------------------------------------------------------
def record(args: argparse.Namespace) -> None:
    engine = harness.load_engine(args)
    shots, questions = load_workload(args)
    params = replace(PARAMS, max_new_tokens=args.max_new_tokens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if args.resume and out.exists():
        done = {r["index"] for r in read_records(out)}
    elif out.exists():
        out.unlink()
    for other in args.skip_recorded:  # the same questions recorded elsewhere (another device) stay one sample
        done |= {r["index"] for r in read_records(Path(other)) if r["workload"] == args.workload}
    todo = [(i, q) for i, q in enumerate(questions) if i not in done]
    print(f"{engine.model_name} on {engine.device}: {len(todo)} questions to record ({len(done)} already)")
    started = time.perf_counter()
    for first in tqdm(range(0, len(todo), args.batch), desc="batches"):
        batch = todo[first:first + args.batch]
        with engine.exclusive():  # every request queued before the first step admits them together
            handles = [engine.submit(few_shot_messages(q.question, shots), args.branches,
                                     replace(params, seed=question_seed(i))) for i, q in batch]
        with open_records(out, "a") as f:
            for (i, q), handle in zip(batch, handles):
                f.write(json.dumps({
                    "index": i, "workload": args.workload, "level": solution_steps(q), "gold": q.answer,
                    "max_new_tokens": params.max_new_tokens, "stop": list(params.stop), "model": engine.model_name,
                    "device": str(engine.device),
                    "branches": [{"tokens": list(c.token_ids), "logprobs": [round(x, 6) for x in c.logprobs],
                                  "finish": c.finish_reason, "text": c.text} for c in handle.result()],
                }) + "\n")
        if args.time_budget_min and time.perf_counter() - started > args.time_budget_min * 60:
            print(f"time budget reached after {first + len(batch)} questions; --resume continues")
            break


# -- replay (the exact replay itself: rksc_bench.early_stop_replay) ------------------------------------
def candidate_rules() -> dict[str, EarlyStopConfig | None]:
    """The rules and settings replayed: the exact one, and grids of the approximate ones."""
    rules: dict[str, EarlyStopConfig | None] = {"off": None, "decided": EarlyStopConfig()}
    rules["answered"] = EarlyStopConfig(answered=AnsweredConfig())
    for window, percentile in itertools.product((16, 32), (5.0, 10.0, 25.0)):
        confidence = ConfidenceConfig(window_tokens=window, warmup_branches=4, percentile=percentile)
        rules[f"confidence w{window} p{percentile:g}"] = EarlyStopConfig(confidence=confidence)
        rules[f"answered+confidence w{window} p{percentile:g}"] = EarlyStopConfig(answered=AnsweredConfig(),
                                                                                   confidence=confidence)
    for fraction, factor in itertools.product((0.25, 0.5), (1.25, 1.5, 2.0, 3.0)):
        length = LengthConfig(finished_fraction=fraction, factor=factor)
        rules[f"length q{fraction:g} x{factor:g}"] = EarlyStopConfig(length=length)
        rules[f"answered+length q{fraction:g} x{factor:g}"] = EarlyStopConfig(answered=AnsweredConfig(), length=length)
        rules[f"length+confidence q{fraction:g} x{factor:g}"] = EarlyStopConfig(
            length=length, confidence=ConfidenceConfig(window_tokens=32, warmup_branches=4, percentile=10.0))
    for wave, threshold, method in itertools.product((2, 4), (0.8, 0.9, 0.95), ("beta", "dirichlet", "esc")):
        if method == "esc" and threshold != 0.95:
            continue  # ESC's window rule has no threshold
        adaptive = AdaptiveConfig(wave_size=wave, threshold=threshold, method=method)
        label = f"adaptive {method} w{wave}" + ("" if method == "esc" else f" c{threshold:g}")
        rules[label] = EarlyStopConfig(adaptive=adaptive)
        rules["answered+" + label] = EarlyStopConfig(answered=AnsweredConfig(), adaptive=adaptive)
    return rules


def replay_all(records: list[dict], rules: dict[str, EarlyStopConfig | None], ns: Sequence[int],
               tokenizer) -> dict[tuple[str, int], list[Replayed]]:
    """Every rule at every ``n`` on every record (questions outer, so each branch text is decoded once)."""
    results: dict[tuple[str, int], list[Replayed]] = defaultdict(list)
    for rec in tqdm(records, desc="replaying"):
        texts = BranchTexts(tokenizer, rec["branches"], rec.get("stop", ()))
        for n in ns:
            for label, config in rules.items():
                results[(label, n)].append(replay_question(rec, n, config, texts, extract_gsm8k_answer))
    return results


def summarise(records: list[dict], runs: list[Replayed], full: list[Replayed], keep: Sequence[int]) -> dict:
    """One rule's figures over the records at indices ``keep``, against full ``n`` on the same ones."""
    k = len(keep)
    changed = sum(runs[i].winner != full[i].winner for i in keep)
    right_full = [i for i in keep if full[i].winner == records[i]["gold"]]
    lost = sum(runs[i].winner != records[i]["gold"] for i in right_full)
    right = sum(runs[i].winner == records[i]["gold"] for i in keep)
    tokens, tokens_full = sum(runs[i].decode_tokens for i in keep), sum(full[i].decode_tokens for i in keep)
    steps, steps_full = sum(runs[i].steps for i in keep), sum(full[i].steps for i in keep)
    model = sum(STEP_S * runs[i].steps + ROW_S * runs[i].row_steps for i in keep)
    model_full = sum(STEP_S * full[i].steps + ROW_S * full[i].row_steps for i in keep)
    return {
        "questions": k,
        "token_ratio": tokens_full / max(tokens, 1),
        "step_ratio": steps_full / max(steps, 1),
        "modelled_speedup": model_full / max(model, 1e-9),
        "changed": changed, "changed_ci": wilson_interval(changed, k),
        "right": right, "right_full": len(right_full), "accuracy_ci": wilson_interval(right, k),
        "accuracy_full_ci": wilson_interval(len(right_full), k),
        "lost": lost, "lost_ci": wilson_interval(lost, len(right_full)),
        "gained": right - (len(right_full) - lost),
        "launched": sum(runs[i].launched for i in keep) / max(k, 1),
        "cancelled": sum(runs[i].cancelled for i in keep) / max(k, 1),
    }


def split(records: list[dict], seed: int) -> tuple[list[int], list[int]]:
    """A seeded half of the questions to calibrate on and the other half to report on, stratified by
    workload and level so both halves hold every level."""
    # One question recorded on two devices is two samples of the same question: both land on one side.
    strata: dict[tuple, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, rec in enumerate(records):
        strata[(rec["workload"], rec["level"])][rec["index"]].append(i)
    rng = random.Random(seed)
    calibrate, held_out = [], []
    for key in sorted(strata):
        questions = sorted(strata[key])
        rng.shuffle(questions)
        half = len(questions) // 2
        calibrate += [i for q in questions[:half] for i in strata[key][q]]
        held_out += [i for q in questions[half:] for i in strata[key][q]]
    return sorted(calibrate), sorted(held_out)


def choose(records, results, rules, n: int, keep: Sequence[int], max_lost: float) -> str | None:
    """The approximate rule saving the most modelled time on ``keep`` with no accuracy lost against
    full ``n`` and right answers lost at most ``max_lost`` (observed share)."""
    full = results[("off", n)]
    best, best_speed = None, 1.0
    for label in rules:
        if label in ("off", "decided"):
            continue
        s = summarise(records, results[(label, n)], full, keep)
        if s["right"] < s["right_full"] or s["lost"] > max_lost * max(s["right_full"], 1):
            continue
        if s["modelled_speedup"] > best_speed:
            best, best_speed = label, s["modelled_speedup"]
    return best


def replay_report(args: argparse.Namespace) -> dict:
    records = [r for path in args.records for r in read_records(Path(path))]
    ns = [int(x) for x in args.ns.split(",")]
    records = [r for r in records if len(r["branches"]) >= max(ns)]
    from transformers import AutoTokenizer

    from rksc_engine.runtime.loading import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(args.model or ensure_default_model())
    rules = candidate_rules()
    results = replay_all(records, rules, ns, tokenizer)
    calibrate, held_out = split(records, args.seed)
    everyone = list(range(len(records)))
    distinct = len({(r["workload"], r["index"]) for r in records})
    report: dict = {"questions": len(records), "distinct_questions": distinct, "ns": ns, "split": [len(calibrate), len(held_out)], "by_n": {}}
    for n in ns:
        full = results[("off", n)]
        chosen = choose(records, results, rules, n, calibrate, args.max_lost)
        rows = {label: summarise(records, results[(label, n)], full, everyone) for label in rules}
        levels = sorted({(r["workload"], r["level"]) for r in records})
        by_level = {}
        for label in ["decided", "answered"] + ([chosen] if chosen else []):
            by_level[label] = {f"{w} L{lv}": summarise(records, results[(label, n)], full,
                                                       [i for i, r in enumerate(records) if (r["workload"], r["level"]) == (w, lv)])
                               for w, lv in levels}
        report["by_n"][n] = {
            "all": rows, "chosen": chosen, "by_level": by_level,
            "chosen_held_out": summarise(records, results[(chosen, n)], full, held_out) if chosen else None,
            "decided_held_out": summarise(records, results[("decided", n)], full, held_out),
        }
    return report


def fmt_ci(ci: tuple[float, float]) -> str:
    return f"[{ci[0]:.1%}, {ci[1]:.1%}]"


def markdown(report: dict) -> str:
    lines = [f"{report['questions']} recordings of {report.get('distinct_questions', report['questions'])} distinct questions "
             "(a question recorded on two devices is two independent samples, kept on one side of the split); "
             f"calibration/held-out split {report['split'][0]}/{report['split'][1]} recordings.", ""]
    head = ("| rule | tokens (x fewer) | request steps (x fewer) | modelled time (x faster) | changed answers | "
            "accuracy (full n) | right answers lost | branches launched / cancelled |")
    sep = "|" + "---|" * 8
    for n, block in report["by_n"].items():
        lines += [f"### n = {n}", "", head, sep]
        for label, s in block["all"].items():
            lines.append(_row(label, s))
        lines += ["", f"Chosen approximate rule on the calibration half: **{block['chosen']}**.", ""]
        held = [("decided", block["decided_held_out"])] + ([(block["chosen"], block["chosen_held_out"])] if block["chosen"] else [])
        lines += ["Held-out half:", "", head, sep] + [_row(label, s) for label, s in held] + [""]
        lines += ["By level (all questions):", "", "| rule | level | " + head.split("| rule |")[1], "|" + "---|" * 9]
        for label, levels in block["by_level"].items():
            for level, s in levels.items():
                lines.append(_row(label, s).replace(f"| {label} |", f"| {label} | {level} |", 1))
        lines.append("")
    return "\n".join(lines)


def _row(label: str, s: dict) -> str:
    return (f"| {label} | {s['token_ratio']:.2f} | {s['step_ratio']:.2f} | {s['modelled_speedup']:.2f} | "
            f"{s['changed']}/{s['questions']} {fmt_ci(s['changed_ci'])} | "
            f"{s['right']}/{s['questions']} ({s['right_full']}) | {s['lost']}/{s['right_full']} {fmt_ci(s['lost_ci'])} | "
            f"{s['launched']:.1f} / {s['cancelled']:.1f} |")


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(report["by_n"]), figsize=(6 * len(report["by_n"]), 4.5), squeeze=False)
    families = sorted({label.split(" ")[0] for block in report["by_n"].values() for label in block["all"]})
    colours = {family: plt.cm.tab20(i % 20) for i, family in enumerate(families)}
    for ax, (n, block) in zip(axes[0], report["by_n"].items()):
        for label, s in block["all"].items():
            family = label.split(" ")[0]
            ax.scatter(s["modelled_speedup"], s["lost"] / max(s["right_full"], 1), s=22, color=colours[family],
                       marker="*" if family in ("off", "decided") else "o",
                       label=family if family not in ax.get_legend_handles_labels()[1] else None)
        ax.axvline(1.66, ls="--", c="grey")
        ax.set_xlabel("modelled generation speed-up over full n")
        ax.set_ylabel("share of full n's right answers lost")
        ax.set_title(f"n = {n}")
        ax.legend(fontsize=7)
    save_figure(fig, path, dpi=110)


# -- live ---------------------------------------------------------------------------------------------
def live(args: argparse.Namespace) -> dict:
    """The whole pipeline, side by side on the same seeds, arms rotated per question."""
    engine = harness.load_engine(args)
    shots, questions = load_workload(args)
    params = replace(PARAMS, max_new_tokens=args.max_new_tokens)
    rules = candidate_rules()
    arms = {"off": None, "decided": "decided"}
    for label in filter(None, (args.rules or "").split(",")):
        if label not in rules:
            raise SystemExit(f"--rules: unknown rule {label!r}; the replay table lists them")
        arms[label] = rules[label]
    totals = {arm: {"generate_s": 0.0, "verify_s": 0.0, "right": 0, "tokens": 0, "verified": 0} for arm in arms}
    changed = {arm: 0 for arm in arms}
    engine.reason(questions[0].question, n=2, params=replace(params, max_new_tokens=8), few_shot=shots)  # warm-up
    for i, q in enumerate(tqdm(questions, desc="questions")):
        order = list(arms)[i % len(arms):] + list(arms)[:i % len(arms)]
        answers = {}
        for arm in order:
            result = engine.reason(q.question, n=args.branches, params=replace(params, seed=question_seed(i)),
                                   few_shot=shots, early_stop=arms[arm])
            totals[arm]["generate_s"] += result.generate_s
            totals[arm]["verify_s"] += result.verification.verify_s
            totals[arm]["verified"] += bool(result.verification.scores)
            totals[arm]["right"] += result.answer == q.answer
            totals[arm]["tokens"] += sum(len(c.token_ids) for c in result.completions)
            answers[arm] = result.answer
        for arm in arms:
            changed[arm] += answers[arm] != answers["off"]
    base = totals["off"]["generate_s"] + totals["off"]["verify_s"]
    out = {"questions": len(questions), "branches": args.branches, "device": str(engine.device),
           "threads": torch.get_num_threads(), "arms": {}}
    for arm, t in totals.items():
        pipeline = t["generate_s"] + t["verify_s"]
        out["arms"][arm] = {**t, "pipeline_s": pipeline, "speedup": base / pipeline, "changed": changed[arm],
                            "accuracy": t["right"] / len(questions)}
    for arm, row in out["arms"].items():
        print(f"{arm:>40}: pipeline {row['pipeline_s']:.1f}s ({row['speedup']:.2f}x), generate {row['generate_s']:.1f}s, "
              f"verify {row['verify_s']:.1f}s, tokens {row['tokens']}, right {row['right']}/{len(questions)}, "
              f"changed {row['changed']}")
    return out


# -- tree search ----------------------------------------------------------------------------------
def tree(args: argparse.Namespace) -> dict:
    """``engine.tree_search`` with its children stopped early, side by side with every child run to
    its step's end, on the same seeds, arms rotated per question."""
    engine = harness.load_engine(args)
    shots, questions = load_workload(args)
    params = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=args.max_step_tokens)
    arms: dict[str, str | None] = {"off": None}
    for rule in filter(None, (args.rules or "").split(",")):
        arms[rule] = rule
    totals = {arm: {"wall_s": 0.0, "decode_tokens": 0, "right": 0, "changed": 0, "children_stopped": 0,
                    "nodes": 0} for arm in arms}
    search = {"breadth": args.breadth, "depth": args.depth, "beam": args.beam, "few_shot": shots}
    engine.tree_search(questions[0].question, **{**search, "depth": 1},
                       params=replace(params, max_new_tokens=4, seed=0))  # warm-up
    for i, q in enumerate(tqdm(questions, desc="questions")):
        order = list(arms)[i % len(arms):] + list(arms)[:i % len(arms)]
        answers = {}
        for arm in order:
            engine.clear_cache()
            before = engine.stats().decode_tokens
            result = engine.tree_search(q.question, **search, params=replace(params, seed=question_seed(i)),
                                        early_stop=arms[arm])
            row = totals[arm]
            row["wall_s"] += result.wall_s
            row["decode_tokens"] += engine.stats().decode_tokens - before
            row["right"] += result.answer == q.answer
            row["nodes"] += len(result.nodes)
            row["children_stopped"] += (result.early_stop or {}).get("children_stopped", 0)
            answers[arm] = result.answer
        for arm in arms:
            totals[arm]["changed"] += answers[arm] != answers["off"]
    base = totals["off"]
    out = {"questions": len(questions), **{k: v for k, v in search.items() if k != "few_shot"},
           "max_step_tokens": args.max_step_tokens, "arms": {}}
    for arm, row in totals.items():
        out["arms"][arm] = {**row, "speedup": base["wall_s"] / row["wall_s"],
                            "tokens_fewer": base["decode_tokens"] / max(1, row["decode_tokens"])}
        print(f"{arm:>12}: {row['wall_s']:.1f}s ({out['arms'][arm]['speedup']:.2f}x), decode tokens "
              f"{row['decode_tokens']} ({out['arms'][arm]['tokens_fewer']:.2f}x fewer), children stopped "
              f"{row['children_stopped']} of {row['nodes'] - len(questions)}, right {row['right']}/{len(questions)}, "
              f"answers changed {row['changed']}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = harness.bench_parser(__file__, __doc__, model=False, lock=False, json_out="none")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("record", "live", "tree"):
        p = sub.add_parser(name)
        p.add_model()
        p.add_no_lock()
        p.add_argument("--workload", choices=("ladder", "gsm8k"), default="ladder")
        p.add_argument("--data", default=None, help="gsm8k: a GSM8K JSONL (default: the synthetic generator)")
        p.add_argument("--per-level", type=int, default=8)
        p.add_argument("--levels", default=",".join(str(x) for x in LADDER_LEVELS))
        p.add_argument("--questions", type=int, default=32, help="gsm8k: questions after the shots")
        p.add_argument("--shots", type=int, default=8)
        p.add_seed(0, "seed of the generated questions")
        p.add_max_new_tokens(PARAMS.max_new_tokens, "token budget per branch")
        p.add_argument("--branches", type=int, default=16 if name == "record" else 8)
    rec = sub.choices["record"]
    rec.add_argument("--batch", type=int, default=8)
    rec.add_argument("--out", required=True)
    rec.add_argument("--resume", action="store_true")
    rec.add_argument("--time-budget-min", type=float, default=None)
    rec.add_argument("--skip-recorded", action="append", default=[], metavar="RECORDS",
                     help="skip the questions already recorded in this file (repeatable)")
    lv = sub.choices["live"]
    lv.add_argument("--rules", default=None, help="comma-separated approximate rules' labels from the replay table")
    lv.add_json_out(None)
    tr = sub.choices["tree"]
    tr.add_argument("--rules", default="length,confidence", help="comma-separated early_stop values for tree_search")
    tr.add_argument("--breadth", type=int, default=3)
    tr.add_argument("--depth", type=int, default=4)
    tr.add_argument("--beam", type=int, default=2)
    tr.add_argument("--max-step-tokens", type=int, default=48)
    tr.add_json_out(None)
    rp = sub.add_parser("replay")
    rp.add_argument("records", nargs="+")
    rp.add_model("the model whose tokenizer made the records")
    rp.add_no_lock()
    rp.add_argument("--ns", default="8,16")
    rp.add_seed(0, "seed of the calibration / held-out split")
    rp.add_argument("--max-lost", type=float, default=0.01, help="calibration: most right answers lost (share)")
    rp.add_json_out(None)
    rp.add_argument("--md", default=None)
    rp.add_argument("--plot", default=None)
    rp.add_argument("--from-json", default=None, help="re-render --md/--plot from a saved --json-out; replay nothing")
    args = parser.parse_args(argv)
    if args.command == "record":
        harness.start_run(args)
        record(args)
    elif args.command == "replay":
        if args.from_json:
            report = json.loads(Path(args.from_json).read_text())
            report.pop(harness.ENVIRONMENT_KEY, None)  # the replay's own; this run only renders it
        else:
            harness.start_run(args)
            report = replay_report(args)
        text = markdown(report)
        print(text)
        if args.md:
            Path(args.md).write_text(text + "\n")
        if args.json_out:
            harness.write_json(args.json_out, report)
        if args.plot:
            plot(report, Path(args.plot))
    else:
        harness.start_run(args)
        out = live(args) if args.command == "live" else tree(args)
        if args.json_out:
            harness.write_json(args.json_out, out)


if __name__ == "__main__":
    main()
