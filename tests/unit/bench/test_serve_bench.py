"""``benchmarks/serve.py --quick`` on the tiny model saved to a directory: the in-process and
``rksc serve`` arms run, the server's greedy answers equal the in-process ones, a skipped or unwired
arm says why, and ``--out`` gets the same table. ``transformers serve`` is left out to keep the run
short (it is a second server start); the benchmark itself reports why an arm did not run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from tests.conftest import make_char_tokenizer, make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # runs benchmarks/serve.py in subprocesses
ROOT = Path(__file__).resolve().parents[3]


def test_the_quick_serve_benchmark_runs_on_a_model_directory_and_reports_every_arm(tmp_path):
    model_dir = tmp_path / "tiny"
    make_tiny_model(max_positions=4096).save_pretrained(model_dir)
    make_char_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "serve.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # this checkout, as the test process
    run = subprocess.run([sys.executable, "benchmarks/serve.py", "--quick", "--model", str(model_dir),
                          "--skip-transformers-serve", "--ray-replicas", "2", "--out", str(out), "--no-lock"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in run.stdout.splitlines() if line.startswith("| ") and not line.startswith("| arm")}
    requests, tokens, _, tokens_per_s, _, same = rows["in-process"]
    assert (requests, same) == ("4", "4/4") and int(tokens) > 0 and float(tokens_per_s) > 0
    assert rows["in-process, mixed prefill on"][1] == tokens
    assert rows["in-process, mixed prefill on"][-1] == "4/4", "mixing prefill with decode must not change answers"
    assert rows["rksc serve"][0] == "4" and rows["rksc serve"][1] == tokens, "the server generated other tokens"
    assert rows["rksc serve"][-1] == "4/4", "greedy answers over HTTP must equal the in-process ones"
    assert rows["transformers serve"][0] == "not run: --skip-transformers-serve"
    assert rows["Ray replicas (x2)"][0].startswith("not run: ")
    assert run.stdout.strip() in out.read_text()


def test_poisson_arrivals_report_the_time_to_first_token_of_every_arm(tmp_path):
    model_dir = tmp_path / "tiny"
    make_tiny_model(max_positions=4096).save_pretrained(model_dir)
    make_char_tokenizer().save_pretrained(model_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # this checkout, as the test process
    run = subprocess.run([sys.executable, "benchmarks/serve.py", "--max-tokens", "8", "--model", str(model_dir),
                          "--arrivals", "poisson", "--clients", "3", "--arrival-rate", "20",
                          "--skip-transformers-serve", "--no-lock"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    assert "first token p50 s" in lines[0] and "first token p99 s" in lines[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[1:]}
    for arm in ("in-process", "in-process, mixed prefill on", "rksc serve"):
        requests, tokens, _, _, _, p50, p99, same = rows[arm]
        assert requests == "3" and int(tokens) > 0, arm
        assert 0 <= float(p50) <= float(p99), arm
        assert same == "3/3", f"{arm}: streamed greedy answers must equal the in-process ones"
    assert float(rows["rksc serve"][6]) > 0, "a first token over HTTP takes some time"
    assert "streamed requests arriving as a Poisson process of 20/s" in run.stdout
