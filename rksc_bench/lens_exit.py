"""Training-free level-2 exit rules for the verifier, replayed on recorded logit lenses (the logic of
``benchmarks/cgee_lens_exit.py``).

A rule only reads what the verifier's hooks compute online: per layer and candidate, the Yes/No
logits at the scored position (``LensRecord``). ``pick``, ``ranking`` and ``margin`` exit once the
relative signal (share x P(Yes)) has been stable for a window of layers; ``entropy`` is the
library's own rule (``cgee.lens_exit_layer``), for reference. ``report`` chooses each kind's rule on
a seeded calibration half and scores it on the other half; nothing here runs a model.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import torch

from rksc_bench.plots import pyplot, save_figure
from rksc_engine.evaluation.calibration import QuestionOutcome, split_outcomes, wilson_interval
from rksc_engine.reasoning.cgee import CGEEConfig, VoteSummary, lens_entropy, lens_exit_layer, pick_answer

RULE_KINDS = ("pick", "ranking", "margin", "entropy")


@dataclass(frozen=True)
class LensRecord:
    """One verified question: the vote, the lens ``(layers, candidates, 2)`` (Yes, No logits), the
    answer full-depth verification picked, the gold answer, the level and the pass's seconds."""

    summary: VoteSummary
    lens: torch.Tensor
    full_answer: str
    gold: str
    level: int | None
    pass_s: float

    @classmethod
    def from_dict(cls, data: dict) -> LensRecord:
        outcome = QuestionOutcome.from_dict(data)
        return cls(outcome.summary, torch.tensor(data["lens_logits"], dtype=torch.float32), outcome.full_answer,
                   outcome.gold, outcome.level, float(data.get("full_pass_s", 0.0)))

    @property
    def num_layers(self) -> int:
        return int(self.lens.shape[0])

    @cached_property
    def weights(self) -> list[list[float]]:
        """Per layer and candidate, share x P(Yes): the quantity ``pick_answer`` maximises."""
        shares = torch.tensor([s for _, s in self.summary.shares])
        return (shares * self.lens.float().softmax(-1)[..., 0]).tolist()

    @cached_property
    def orders(self) -> list[tuple[int, ...]]:
        """Per layer, the candidates by weight, best first; ties go to the vote winner (index 0) and
        then to the earlier candidate, as ``pick_answer`` breaks them."""
        return [tuple(sorted(range(len(w)), key=lambda i: (-w[i], i != 0, i))) for w in self.weights]

    @cached_property
    def gaps(self) -> list[float]:
        """Per layer, the gap between the top two weights once the weights are normalised to sum to 1."""
        out = []
        for w, order in zip(self.weights, self.orders):
            total = max(sum(w), 1e-12)
            out.append((w[order[0]] - w[order[1]]) / total if len(order) > 1 else 1.0)
        return out

    @cached_property
    def exits(self) -> dict:
        """``exit_layer``'s answers so far, by rule."""
        return {}

    @cached_property
    def entropy(self) -> torch.Tensor:
        """``(layers, candidates)`` label entropy, as the library's exit rule reads it."""
        return lens_entropy(self.lens)

    def pick_at(self, layer: int) -> str | None:
        """What the picking rule returns from the lens scores of ``layer``."""
        return pick_answer(self.summary, self.lens[layer].float().softmax(-1)[:, 0].tolist())


@dataclass(frozen=True)
class ExitRule:
    """One point of a rule's grid. ``window`` and ``epsilon`` mean what the rule's kind says
    (``entropy`` uses ``theta``/``epsilon``/``min_layer`` as ``CGEEConfig`` does; its window is 2)."""

    kind: str
    min_layer: int
    window: int = 2
    epsilon: float = 0.0
    theta: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise ValueError(f"kind must be one of {list(RULE_KINDS)}, got {self.kind!r}")
        if self.min_layer < 0 or self.window < 2:
            raise ValueError(f"min_layer must be >= 0 and window >= 2, got {self.min_layer}, {self.window}")

    def label(self) -> str:
        if self.kind == "entropy":
            return f"entropy theta={self.theta} eps={self.epsilon} from layer {self.min_layer}"
        extra = f" eps={self.epsilon}" if self.kind == "margin" else ""
        return f"{self.kind} stable {self.window} layers{extra} from layer {self.min_layer}"


def exit_layer(record: LensRecord, rule: ExitRule) -> int:
    """The 0-based layer where ``rule`` stops the pass; ``num_layers - 1`` means it ran to the end.

    Layers ``min_layer`` to ``num_layers - 2`` are checked; a window must lie wholly inside them."""
    # The calibration half is scored again inside the all-decisions frontier: replay each pair once.
    cached = record.exits.get(rule)
    if cached is None:
        cached = record.exits[rule] = _exit_layer(record, rule)
    return cached


def _exit_layer(record: LensRecord, rule: ExitRule) -> int:
    last = record.num_layers - 1
    if rule.kind == "entropy":
        config = CGEEConfig(exit_enabled=True, theta=rule.theta, epsilon=rule.epsilon, min_layer=rule.min_layer)
        return lens_exit_layer(record.entropy, config)
    orders, gaps = record.orders, record.gaps
    for layer in range(rule.min_layer + rule.window - 1, last):
        window = range(layer - rule.window + 1, layer + 1)
        if rule.kind == "ranking":
            settled = len({orders[i] for i in window}) == 1
        else:
            settled = len({orders[i][0] for i in window}) == 1
            if settled and rule.kind == "margin":
                settled = max(gaps[i] for i in window) - min(gaps[i] for i in window) < rule.epsilon
        if settled:
            return layer
    return last


@dataclass(frozen=True)
class RuleResult:
    """What one rule did on a set of records."""

    rule: str
    decisions: int
    errors: int
    error_wilson: tuple[float, float]
    correct: int
    full_correct: int
    mean_exit_layer: float
    layers_saved_fraction: float
    seconds_saved: float
    pass_seconds: float

    @property
    def error_rate(self) -> float:
        return self.errors / self.decisions if self.decisions else 0.0


def evaluate(records: Sequence[LensRecord], rule: ExitRule, check_cost: float = 0.0) -> RuleResult:
    """Replay ``rule`` on ``records``: decision errors against full depth, accuracy, work saved.

    A pass that exits at layer ``e`` runs ``e + 1`` of ``L`` layers and ``e - min_layer + 1`` checks
    of ``check_cost`` layers each, so it saves ``(L - 1 - e - check_cost * checks) / L`` of the pass."""
    errors = correct = full_correct = 0
    exits, saved, seconds = [], [], 0.0
    for record in records:
        layer = exit_layer(record, rule)
        last = record.num_layers - 1
        answer = record.full_answer if layer == last else record.pick_at(layer)
        errors += answer != record.full_answer
        correct += answer == record.gold
        full_correct += record.full_answer == record.gold
        checks = max(0, min(layer, last - 1) - rule.min_layer + 1)
        fraction = (last - layer - check_cost * checks) / record.num_layers
        exits.append(layer)
        saved.append(fraction)
        seconds += fraction * record.pass_s
    n = len(records)
    return RuleResult(rule.label(), n, errors, wilson_interval(errors, n), correct, full_correct,
                      sum(exits) / max(1, n), sum(saved) / max(1, n), seconds, sum(r.pass_s for r in records))


def rule_grid(num_layers: int) -> dict[str, list[ExitRule]]:
    """Each kind's grid, from the earliest sensible layer to the last checkable one."""
    starts = list(range(0, num_layers - 2, 2))
    windows = (2, 3, 4, 6, 8)
    return {
        "pick": [ExitRule("pick", m, w) for m, w in itertools.product(starts, windows)],
        "ranking": [ExitRule("ranking", m, w) for m, w in itertools.product(starts, windows)],
        "margin": [ExitRule("margin", m, w, epsilon=e)
                   for m, w, e in itertools.product(starts, windows, (0.005, 0.01, 0.02, 0.05))],
        "entropy": [ExitRule("entropy", m, epsilon=e, theta=t)
                    for m, e, t in itertools.product(starts, (0.01, 0.05), (0.1, 0.2, 0.4, 0.6))],
    }


def choose(records: Sequence[LensRecord], rules: Sequence[ExitRule], target_error: float,
           check_cost: float) -> tuple[ExitRule | None, RuleResult | None]:
    """The rule saving the most layers whose error's Wilson upper bound is <= ``target_error``; ties go
    to the later ``min_layer`` (the more cautious rule). ``(None, None)`` when none qualifies."""
    best = None
    for rule in rules:
        result = evaluate(records, rule, check_cost)
        if result.error_wilson[1] > target_error or result.layers_saved_fraction <= 0:
            continue
        key = (result.layers_saved_fraction, rule.min_layer)
        if best is None or key > best[0]:
            best = (key, rule, result)
    return (best[1], best[2]) if best else (None, None)


def frontier(records: Sequence[LensRecord], rules: Sequence[ExitRule], error_caps: Sequence[float],
             check_cost: float) -> dict[float, RuleResult | None]:
    """Per observed-error cap, the rule saving the most layers on ``records`` (optimistic: chosen there)."""
    results = [evaluate(records, rule, check_cost) for rule in rules]
    best: dict[float, RuleResult | None] = {}
    for cap in error_caps:
        fits = [r for r in results if r.error_rate <= cap and r.layers_saved_fraction > 0]
        best[cap] = max(fits, key=lambda r: r.layers_saved_fraction) if fits else None
    return best


def agreement_by_layer(records: Sequence[LensRecord]) -> dict[str, list[float]]:
    """Per layer, the share of records whose lens pick equals full verification's pick, and the
    vote winner."""
    num_layers = records[0].num_layers
    with_full, with_vote = [0] * num_layers, [0] * num_layers
    for record in records:
        for layer in range(num_layers):
            pick = record.pick_at(layer)
            with_full[layer] += pick == record.full_answer
            with_vote[layer] += pick == record.summary.winner
    n = len(records)
    return {"full": [c / n for c in with_full], "vote": [c / n for c in with_vote]}


def load_records(path: Path) -> tuple[dict, list[LensRecord]]:
    """The run's meta and every record that went to the verifier with at least two candidates (one
    candidate leaves nothing to decide) and carries a lens."""
    saved = json.loads(path.read_text())
    records = [LensRecord.from_dict(r) for r in saved["records"]
               if r.get("lens_logits") and len(r["shares"]) >= 2 and r.get("full_answer") is not None]
    if not records:
        raise SystemExit(f"{path} has no records with a recorded lens (run benchmarks/cgee.py --record-lens)")
    return saved["meta"], records


def _fmt(result: RuleResult | None) -> str:
    if result is None:
        return "| none qualifies | | | | | |"
    low, high = result.error_wilson
    return (f"| {result.rule} | {result.errors}/{result.decisions} = {result.error_rate:.1%} [{low:.1%}, {high:.1%}] "
            f"| {result.correct / result.decisions:.1%} vs {result.full_correct / result.decisions:.1%} "
            f"| {result.mean_exit_layer + 1:.1f} | {result.layers_saved_fraction:.1%} "
            f"| {result.seconds_saved:.1f}s of {result.pass_seconds:.1f}s |")


COLUMNS = ("rule | decision error vs full depth [Wilson 95%] | accuracy: exit vs full depth | mean exit layer (1-based) "
           "| verifier layers saved | scoring-pass time saved |")
HEADER = f"| {COLUMNS}\n|---|---:|---:|---:|---:|---:|"
CAP_HEADER = f"| error cap | {COLUMNS}\n|---:|---|---:|---:|---:|---:|---:|"


def report(meta: dict, records: list[LensRecord], *, seed: int, target_error: float, check_cost: float) -> dict:
    outcomes = [QuestionOutcome(r.summary, r.full_answer, r.gold, 0.0, r.level) for r in records]
    calibration, held_out = split_outcomes(outcomes, seed)
    cal, held = [records[i] for i in calibration], [records[i] for i in held_out]
    grid = rule_grid(records[0].num_layers)
    chosen = {}
    for kind, rules in grid.items():
        rule, on_cal = choose(cal, rules, target_error, check_cost)
        levels = sorted({r.level for r in held}, key=lambda x: (x is None, x or 0))
        chosen[kind] = {"rule": asdict(rule) if rule else None, "calibration": on_cal,
                        "held_out": evaluate(held, rule, check_cost) if rule else None,
                        "held_out_by_level": {level: evaluate([r for r in held if r.level == level], rule, check_cost)
                                              for level in levels} if rule else {}}
    caps = (0.01, 0.05, 0.10)
    all_rules = [rule for rules in grid.values() for rule in rules]
    return {"meta": meta, "decisions": len(records), "seed": seed, "target_error": target_error,
            "check_cost_layers": check_cost, "chosen": chosen,
            "frontier": {cap: frontier(records, all_rules, caps, check_cost)[cap] for cap in caps},
            "agreement": agreement_by_layer(records),
            "vote_overturned": sum(r.full_answer != r.summary.winner for r in records)}


def render(result: dict) -> str:
    meta, n = result["meta"], result["decisions"]
    lines = [f"Records: {meta.get('source', '?')}, model {meta.get('model', '?')}; {n} verifier decisions with at "
             f"least two candidates. Full-depth verification overturned the vote on {result['vote_overturned']} "
             f"({result['vote_overturned'] / n:.1%}).", "",
             f"Chosen on the calibration half (split seed {result['seed']}; Wilson 95% upper bound of the decision "
             f"error <= {result['target_error']:.0%}; check cost {result['check_cost_layers']} layers), held-out half:",
             "", HEADER]
    for kind, entry in result["chosen"].items():
        lines.append(_fmt(entry["held_out"]) if entry["rule"] else f"| {kind}: none qualifies on the calibration half | | | | | |")
    by_level = [(kind, level, res) for kind, entry in result["chosen"].items()
                for level, res in entry["held_out_by_level"].items()]
    if by_level:
        lines += ["", "The same rules on the held-out half, by level:", "",
                  f"| level | {COLUMNS}", "|---:|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {level} " + _fmt(res) for _, level, res in by_level]
    lines += ["", "Best rule of any kind on all decisions at an observed error cap (optimistic: chosen on the same "
              "decisions it is scored on):", "", CAP_HEADER]
    for cap, best in result["frontier"].items():
        lines.append(f"| {cap:.0%} " + _fmt(best))
    agree = result["agreement"]
    lines += ["", "Lens pick = full verification's pick, by layer (1-based): "
              + ", ".join(f"{i + 1}: {v:.0%}" for i, v in enumerate(agree["full"]) if i % 4 == 0 or i == len(agree["full"]) - 1),
              "Lens pick = vote winner, by layer: "
              + ", ".join(f"{i + 1}: {v:.0%}" for i, v in enumerate(agree["vote"]) if i % 4 == 0 or i == len(agree["vote"]) - 1)]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """The share of decisions whose lens pick equals full depth's pick, and the vote winner, by layer."""
    agree = result["agreement"]
    layers = list(range(1, len(agree["full"]) + 1))
    fig, ax = pyplot().subplots(figsize=(7, 3.5))
    ax.plot(layers, agree["full"], marker="o", label="lens pick = full-depth pick")
    ax.plot(layers, agree["vote"], marker=".", linestyle="--", label="lens pick = vote winner")
    ax.set_xlabel("verifier layer (1-based)")
    ax.set_ylabel("share of decisions")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Where the verifier's decision is made ({result['decisions']} decisions)")
    ax.legend(loc="lower left")
    save_figure(fig, path)


def report_json(result: dict) -> dict:
    """``report``'s result as JSON can hold it: rule results as dicts, levels and caps as strings."""
    def as_dict(value: RuleResult | None) -> dict | None:
        return value and asdict(value)

    chosen = {kind: {"rule": entry["rule"], "calibration": as_dict(entry["calibration"]),
                     "held_out": as_dict(entry["held_out"]),
                     "held_out_by_level": {str(level): asdict(r) for level, r in entry["held_out_by_level"].items()}}
              for kind, entry in result["chosen"].items()}
    return {**result, "chosen": chosen, "frontier": {str(cap): as_dict(r) for cap, r in result["frontier"].items()}}
