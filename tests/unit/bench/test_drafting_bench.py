"""``benchmarks/drafting.py`` runs on a tiny family and reports every arm with the same tokens."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def load_script():
    spec = importlib.util.spec_from_file_location("drafting_bench", ROOT / "benchmarks" / "drafting.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_drafting_benchmark_reports_each_arm_with_identical_tokens(tmp_path):
    out = tmp_path / "drafting.json"
    load_script().main(["--no-default-model", "--families", "llama3", "--ks", "2,3", "--sources", "prompt,both",
                        "--layouts", "shared_prefix,static_rows",
                        "--branches", "2", "--max-new-tokens", "12", "--repeats", "1", "--no-lock",
                        "--json-out", str(out)])
    saved = json.loads(out.read_text())
    (workload,) = saved["workloads"]
    assert workload["workload"] == "tiny llama3"
    shared = ["off", "k2-prompt", "k2-both", "k3-prompt", "k3-both"]
    assert [c["arm"] for c in workload["cells"]] == shared + [f"{arm} static" for arm in shared]
    assert all(c["identical"] for c in workload["cells"]), "an arm's tokens differed from the arm without drafting"
    off = workload["cells"][0]
    assert off["drafted_tokens"] == 0 and off["speedup"] == 1.0
    static_off = workload["cells"][len(shared)]
    assert static_off["drafted_tokens"] == 0 and static_off["speedup_in_layout"] == 1.0
    assert all(c["draft_steps_saved"] == 0 for c in workload["cells"] if c["drafted_tokens"] == 0), \
        "forwards counted as saved where nothing was drafted"
    assert all(c["decode_tokens"] == off["decode_tokens"] for c in workload["cells"])
    assert "environment" in saved
