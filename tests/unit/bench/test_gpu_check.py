"""The GPU check runs end to end (on a CPU, on a tiny model): the day a GPU is lent, its few
minutes are not spent on a script that does not start."""

from __future__ import annotations

import pytest

from rksc_bench.gpu_check import CheckOptions, run_check


@pytest.mark.slow
def test_the_gpu_check_runs_every_part_on_a_tiny_model():
    results = run_check(CheckOptions(device="cpu", quick=True, rows=(2,)))
    assert all("error" not in results[part] for part in ("exact", "step", "branches", "drafting")), results
    assert all(v["verdict"] == "PASS" for k, v in results["exact"].items() if k.startswith("float32/"))
    assert {c["layout"] for c in results["step"]["cells"]} == {"siblings", "independent"}
    assert set(results["branches"]["rksc_s"]) == {"shared_prefix", "static_rows", "compiled"}
    for job in ("sampled", "greedy"):  # float32 on a CPU: drafting changes no token, in either layout
        cells = results["drafting"][job]["cells"]
        assert set(cells) == {f"{layout} k{k}" for layout in ("shared_prefix", "static_rows") for k in (0, 2, 4)}
        assert all(cell["identical"] for cell in cells.values()), results["drafting"]
