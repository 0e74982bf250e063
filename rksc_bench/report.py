"""What one ``rksc bench`` run measured: a record per arm and question (``ArmRecord``), the run's
report over them (``BenchReport``), and the report as markdown."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from rksc_bench.config import BenchConfig


@dataclass
class ArmRecord:
    """What one arm did for one question."""

    arm: str
    question_index: int
    wall_s: float
    prompt_tokens_computed: int
    answer: str | None
    gold: str
    difficulty: int
    verified: bool
    skipped: bool
    exit_layers: list[int] = field(default_factory=list)
    num_layers: int | None = None
    level: int | None = None  # the question's ladder level; None outside the ladder workload

    @property
    def correct(self) -> bool:
        return self.answer is not None and _same_answer(self.answer, self.gold)

    @property
    def early_exited(self) -> bool:
        return bool(self.exit_layers) and self.num_layers is not None and min(self.exit_layers) < self.num_layers - 1


@dataclass
class BenchReport:
    config: BenchConfig
    records: list[ArmRecord]
    unavailable: dict[str, str]  # arm -> why it did not run
    machine: dict[str, Any]
    tree_cache_bytes: list[int] = field(default_factory=list)  # after each expansion of the tree search
    tree_budget_bytes: int = 0

    def arm_records(self, arm: str) -> list[ArmRecord]:
        return [r for r in self.records if r.arm == arm]

    def arms_run(self) -> list[str]:
        return [a for a in self.config.arms if self.arm_records(a)]

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per arm: totals, ratios to ``no_reuse`` and ``token_exact``, accuracy and agreement."""
        walls = {a: sum(r.wall_s for r in self.arm_records(a)) for a in self.arms_run()}
        reference = {r.question_index: r.answer for r in self.arm_records("token_exact")}
        out = {}
        for arm in self.arms_run():
            records = self.arm_records(arm)
            verified = [r for r in records if r.verified]
            out[arm] = {
                "wall_s": walls[arm],
                "speedup_vs_no_reuse": walls["no_reuse"] / walls[arm] if "no_reuse" in walls else None,
                "speedup_vs_token_exact": walls["token_exact"] / walls[arm] if "token_exact" in walls else None,
                "prompt_tokens_computed": sum(r.prompt_tokens_computed for r in records),
                "verifier_skipped": sum(r.skipped for r in records),
                "verifier_early_exited": sum(r.early_exited for r in verified),
                "questions": len(records),
                "accuracy": sum(r.correct for r in records) / len(records),
                "agreement_with_token_exact": (
                    sum(reference.get(r.question_index) == r.answer for r in records) / len(records)
                    if reference else None
                ),
            }
        return out

    def skip_rate_by_difficulty(self, arm: str = "rksc") -> dict[int, tuple[int, int]]:
        """Difficulty (solution steps) -> (verifier calls skipped, questions)."""
        table: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        for r in self.arm_records(arm):
            table[r.difficulty][0] += r.skipped
            table[r.difficulty][1] += 1
        return {k: (v[0], v[1]) for k, v in sorted(table.items())}

    def by_level(self, arm: str) -> dict[int, tuple[int, int, int]]:
        """Ladder level -> (answered correctly, verifier calls skipped, questions) for ``arm``;
        empty outside the ladder workload."""
        table: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
        for r in self.arm_records(arm):
            if r.level is not None:
                row = table[r.level]
                row[0], row[1], row[2] = row[0] + r.correct, row[1] + r.skipped, row[2] + 1
        return {k: (v[0], v[1], v[2]) for k, v in sorted(table.items())}

    def to_json(self) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config),
            "machine": self.machine,
            "unavailable": self.unavailable,
            "summary": self.summary(),
            "skip_rate_by_difficulty": {str(k): v for k, v in self.skip_rate_by_difficulty().items()},
            "tree_search": {"cache_bytes_after_each_expansion": self.tree_cache_bytes, "budget_bytes": self.tree_budget_bytes},
            "records": [dataclasses.asdict(r) | {"correct": r.correct, "early_exited": r.early_exited} for r in self.records],
        }


def _same_answer(a: str, b: str) -> bool:
    def norm(x: str) -> str:
        x = x.strip().replace(",", "").rstrip(".")
        return x[:-2] if x.endswith(".0") else x
    return norm(a).lower() == norm(b).lower()


def render_markdown(report: BenchReport) -> str:
    """The per-arm table, the ablation and the skip rate by difficulty (on the ladder, accuracy and
    skip rate by level), as markdown."""
    summary = report.summary()
    cfg = report.config

    def ratio(x: float | None) -> str:
        return "" if x is None else f"{x:.2f}x"

    workload = f"`{cfg.workload}`"
    if cfg.workload == "ladder":
        workload += f" (the difficulty ladder, levels {', '.join(map(str, cfg.levels))})"
    lines = [
        f"workload {workload}, {cfg.questions} questions x {cfg.branches} branches, {cfg.shots}-shot, "
        f"ensemble {cfg.ensemble}, up to {cfg.max_new_tokens} new tokens; {report.machine['cpus']} CPUs, "
        f"{report.machine['dtype']}",
        "",
        "| arm | wall s | vs no reuse | vs token-exact | prompt tokens computed | verifier skipped | early-exited | accuracy | agrees with token-exact |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, s in summary.items():
        agree = "" if s["agreement_with_token_exact"] is None else f"{s['agreement_with_token_exact']:.0%}"
        lines.append(
            f"| {arm} | {s['wall_s']:.1f} | {ratio(s['speedup_vs_no_reuse'])} | {ratio(s['speedup_vs_token_exact'])} | "
            f"{s['prompt_tokens_computed']:,} | {s['verifier_skipped']}/{s['questions']} | "
            f"{s['verifier_early_exited']}/{s['questions']} | {s['accuracy']:.0%} | {agree} |"
        )
    for arm, why in report.unavailable.items():
        lines.append(f"| {arm} | not run: {why} | | | | | | | |")
    ablation = [(label, arm) for label, arm in (("neither", "no_reuse"), ("KV sharing (ASKS) alone", "asks"),
                                                ("CGEE alone", "cgee_only"), ("both", "rksc")) if arm in summary]
    if len(ablation) > 1 and "no_reuse" in summary:
        lines += ["", "| ablation | arm | speedup vs no reuse |", "|---|---|---:|"]
        lines += [f"| {label} | {arm} | {ratio(summary[arm]['speedup_vs_no_reuse'])} |" for label, arm in ablation]
    by_difficulty = report.skip_rate_by_difficulty()
    levels = {arm: report.by_level(arm) for arm in summary}
    if any(levels.values()):
        # A ladder level is its solution steps, so this table replaces the one by difficulty.
        arms = list(levels)
        skip = "rksc" in levels
        lines += ["", "| ladder level | questions | " + " | ".join(f"accuracy ({a})" for a in arms)
                  + (" | CGEE skipped (rksc arm) |" if skip else " |"),
                  "|---:|---:|" + "---:|" * (len(arms) + skip)]
        for level in sorted({lv for table in levels.values() for lv in table}):
            cells = [(levels[a].get(level) or (0, 0, 0)) for a in arms]
            n = max(c[2] for c in cells)
            row = [str(level), str(n)] + [f"{c[0] / c[2]:.0%}" if c[2] else "" for c in cells]
            if skip:
                s = levels["rksc"].get(level) or (0, 0, 0)
                row.append(f"{s[1]}/{s[2]}")
            lines.append("| " + " | ".join(row) + " |")
    elif by_difficulty:
        lines += ["", "| solution steps | CGEE skipped (rksc arm) |", "|---:|---:|"]
        lines += [f"| {d} | {s}/{n} |" for d, (s, n) in by_difficulty.items()]
    return "\n".join(lines)
