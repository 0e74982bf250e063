"""Sizes in bytes written for people: one format for every message and summary the engine prints
(out-of-memory refusals, ``print(engine.stats())``), so the same size always reads the same."""

from __future__ import annotations


def format_bytes(num_bytes: int | float) -> str:
    """``num_bytes`` in the largest binary unit it fills, with three significant digits or more:
    ``512 B``, ``45.0 KiB``, ``1.25 MiB``, ``183 GiB``, ``1,830 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            value = num_bytes / scale
            decimals = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
            return f"{value:,.{decimals}f} {unit}"
    return f"{int(num_bytes):,} B"
