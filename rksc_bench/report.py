"""What one ``rksc bench`` run measured: what each arm ran (``ArmSetup``), a record per arm and
question (``ArmRecord``), the run's report over them (``BenchReport``), and the report as markdown."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from rksc_bench.config import BenchConfig


@dataclass(frozen=True)
class ArmSetup:
    """What one engine arm ran, read from the engine it was built with, so that a table row names
    the mechanisms behind its figure rather than what the arm was meant to isolate.

    Attributes:
        shared_prefill: One prefill per prompt, forked to its branches.
        prefix_cache: The token-exact radix cache across calls.
        asks: ASKS tried to reuse KV across reworded prompts.
        cgee: CGEE decided whether and how deeply to verify.
        early_stop: The early-stop rule the branches ran under; None when off.
    """

    shared_prefill: bool
    prefix_cache: bool
    asks: bool
    cgee: bool
    early_stop: str | None = None

    def label(self, asks_reused_tokens: int) -> str:
        """The mechanisms that ran, joined by ``+``; ASKS with the prompt tokens it actually served
        reused KV (``asks_reused_tokens``), since on prompts it has nothing to realign it runs but
        reuses nothing and the figure is the token-exact sharing's."""
        parts = []
        if self.shared_prefill or self.prefix_cache:
            parts.append("token-exact KV sharing")
        if self.asks:
            parts.append(f"ASKS (reused {asks_reused_tokens:,} prompt tokens)")
        if self.cgee:
            parts.append("CGEE")
        if self.early_stop:
            parts.append(f"early stop ({self.early_stop})")
        return " + ".join(parts) or "nothing (every prompt computed, every candidate verified)"


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
    asks_reused_tokens: int = 0  # prompt tokens ASKS served reused (re-rotated) KV for this question

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
    setups: dict[str, ArmSetup] = field(default_factory=dict)  # engine arm -> what it ran

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
                "asks_reused_tokens": sum(r.asks_reused_tokens for r in records),
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

    def ablation_label(self, arm: str) -> str:
        """What ``arm`` ran, as its ablation row says it (the arm's name when its setup is unknown)."""
        setup = self.setups.get(arm)
        if setup is None:
            return arm
        return setup.label(sum(r.asks_reused_tokens for r in self.arm_records(arm)))

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
            "setups": {arm: dataclasses.asdict(setup) | {"label": self.ablation_label(arm)}
                       for arm, setup in self.setups.items()},
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
    # Each row is labelled by what its arm ran, not by what the arm was meant to isolate: the asks
    # arm also shares token-exact KV, and the rksc arm runs the shipped defaults (ASKS off).
    ablation = [arm for arm in ("no_reuse", "cgee_only", "token_exact", "asks", "rksc") if arm in summary]
    if len(ablation) > 1 and "no_reuse" in summary:
        lines += ["", "| ablation: what ran | arm | speedup vs no reuse |", "|---|---|---:|"]
        lines += [f"| {report.ablation_label(arm)} | {arm} | {ratio(summary[arm]['speedup_vs_no_reuse'])} |"
                  for arm in ablation]
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
