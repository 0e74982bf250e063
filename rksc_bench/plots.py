"""PNG plots of a bench report (speedup per arm, CGEE skip rate by difficulty, exit-layer histogram),
and the two steps every benchmark plot shares: pyplot without a display, and saving a figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rksc_bench.report import BenchReport


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend: files only, never a display. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = 120) -> Path:
    """Lay ``fig`` out, write it to ``path`` (creating its folder) and close it; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_report(report: BenchReport, out_dir: Path) -> list[Path]:
    """Write the plots into ``out_dir``; returns their paths. Needs matplotlib."""
    plt = pyplot()

    paths: list[Path] = []
    summary = report.summary()

    fig, ax = plt.subplots(figsize=(7, 3.5))
    arms = list(summary)
    for offset, (key, label) in enumerate((("speedup_vs_no_reuse", "vs no reuse"), ("speedup_vs_token_exact", "vs token-exact"))):
        values = [summary[a][key] or 0.0 for a in arms]
        ax.bar([i + 0.4 * offset for i in range(len(arms))], values, width=0.4, label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([i + 0.2 for i in range(len(arms))], arms, rotation=20)
    ax.set_ylabel("speedup (wall time ratio)")
    ax.set_title(f"{report.config.workload}: {report.config.branches} branches, {report.config.questions} questions")
    ax.legend()
    paths.append(save_figure(fig, out_dir / "speedup.png"))

    by_difficulty = report.skip_rate_by_difficulty()
    if by_difficulty:
        fig, ax = plt.subplots(figsize=(5, 3))
        steps = list(by_difficulty)
        ax.bar([str(s) for s in steps], [s / n for s, n in by_difficulty.values()])
        ax.set_xlabel("reference solution steps")
        ax.set_ylabel("CGEE skip rate")
        ax.set_ylim(0, 1)
        paths.append(save_figure(fig, out_dir / "skip_rate.png"))

    exits = [x for r in report.records if r.arm == "rksc" for x in r.exit_layers]
    num_layers = next((r.num_layers for r in report.records if r.num_layers), None)
    if exits and num_layers:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.hist([x + 1 for x in exits], bins=range(1, num_layers + 2))
        ax.set_xlabel(f"verifier exit layer (of {num_layers})")
        ax.set_ylabel("verifier passes")
        paths.append(save_figure(fig, out_dir / "exit_layers.png"))
    if report.tree_cache_bytes:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.plot(range(1, len(report.tree_cache_bytes) + 1), [b / 2**20 for b in report.tree_cache_bytes], marker="o")
        ax.axhline(report.tree_budget_bytes / 2**20, color="grey", linestyle="--", linewidth=0.8, label="RSBCM budget")
        ax.set_xlabel("tree-search expansion")
        ax.set_ylabel("prefix cache MiB")
        ax.legend()
        paths.append(save_figure(fig, out_dir / "tree_cache_bytes.png"))
    return paths
