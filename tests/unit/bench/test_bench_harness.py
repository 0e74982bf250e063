"""The benchmarks' shared harness (``rksc_bench.harness``): every script in ``benchmarks/`` builds its
parser there and its ``--help`` runs; shared flags are defined once; the bench lock is waited for,
found when inherited from ``flock``, and let go; results files carry the run's environment."""

from __future__ import annotations

import ast
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import make_char_tokenizer, make_tiny_model

from rksc_bench import harness
from rksc_bench.prompts import shots_to_length
from rksc_engine import RKSCEngine
from rksc_engine.evaluation.workloads import synthetic_problems
from rksc_engine.reasoning.few_shot import few_shot_messages

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))
SHARED_FLAGS = ("--model", "--json-out", "--no-lock", "--repeats", "--seed", "--max-new-tokens", "--threads",
                "--device", "--dtype")
# Each script's --help, in one interpreter (torch is imported once); the subcommands of early_stop too.
HELP_DRIVER = textwrap.dedent("""
    import contextlib, io, json, runpy, sys
    results = []
    for argv in json.loads(sys.argv[1]):
        out, code = io.StringIO(), None
        sys.argv = argv
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            try:
                runpy.run_path(argv[0], run_name="__main__")
            except SystemExit as stop:
                code = stop.code
        results.append({"argv": argv, "code": code, "help": out.getvalue()})
    print(json.dumps(results))
""")


def test_there_are_benchmark_scripts_to_check():
    assert len(SCRIPTS) >= 24, [p.name for p in SCRIPTS]


# -- every script ---------------------------------------------------------------------------------
def test_every_benchmark_builds_its_parser_from_the_harness_and_its_help_runs():
    calls = [[str(path), "--help"] for path in SCRIPTS]
    calls += [[str(ROOT / "benchmarks" / "early_stop.py"), command, "--help"] for command in ("record", "replay")]
    run = subprocess.run([sys.executable, "-c", HELP_DRIVER, json.dumps(calls)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) == len(calls)
    failed = [(r["argv"][0], r["code"]) for r in results if r["code"] != 0 or not r["help"].startswith("usage:")]
    assert not failed, f"--help did not run cleanly: {failed}"
    for result in results[:len(SCRIPTS)]:
        name = Path(result["argv"][0]).name
        assert harness.EPILOG in result["help"], f"{name}: its parser is not the harness's bench_parser"
        if "--no-lock" in result["help"]:
            source = (ROOT / "benchmarks" / name).read_text()
            assert "harness.start_run(" in source, f"{name} offers --no-lock but never takes the bench lock"
    record, replay = results[len(SCRIPTS):]
    assert "--no-lock" in record["help"] and "--model" in record["help"]
    assert "--json-out" in replay["help"] and "records" in replay["help"]


def shared_flag_definitions(tree: ast.AST) -> list[str]:
    """Shared flags a script defines itself (``add_argument("--model", ...)``)."""
    return [node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
            and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in SHARED_FLAGS]


def imported_modules(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def builds_its_own_parser(tree: ast.AST) -> bool:
    return any(isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "ArgumentParser"
               for node in ast.walk(tree))


def test_no_benchmark_defines_a_shared_flag_or_a_parser_itself_or_imports_another_script():
    siblings = {path.stem for path in SCRIPTS}
    for path in SCRIPTS:
        tree = ast.parse(path.read_text(), filename=str(path))
        assert not shared_flag_definitions(tree), f"{path.name} defines shared flags itself: use harness.BenchParser"
        assert not builds_its_own_parser(tree), f"{path.name} builds an ArgumentParser: use harness.bench_parser"
        assert not imported_modules(tree) & siblings, f"{path.name} imports another script: move that code to rksc_bench"
        assert "rksc_bench" in imported_modules(tree), f"{path.name} does not use the harness"


def test_the_shared_flag_check_catches_a_script_that_defines_one():
    tree = ast.parse('import argparse\np = argparse.ArgumentParser()\np.add_argument("--model", default=None)')
    assert shared_flag_definitions(tree) == ["--model"] and builds_its_own_parser(tree)
    assert not builds_its_own_parser(ast.parse("parser = harness.bench_parser(__file__, __doc__)"))


# -- flags ------------------------------------------------------------------------------------------
def test_the_parser_has_the_shared_flags_with_their_defaults(tmp_path):
    script = tmp_path / "step_overhead.py"
    parser = harness.bench_parser(script, "Benchmark: a test.")
    parser.add_repeats(3)
    parser.add_seed(7)
    parser.add_max_new_tokens(16)
    parser.add_threads()
    args = parser.parse_args([])
    assert (args.model, args.no_lock, args.repeats, args.seed, args.max_new_tokens, args.threads) == (
        None, False, 3, 7, 16, None)
    assert args.json_out == tmp_path / "results" / "step_overhead.json"
    args = parser.parse_args(["--model", "m", "--json-out", "x.json", "--no-lock", "--repeats", "5", "--threads", "1"])
    assert (args.model, args.json_out, args.no_lock, args.repeats, args.threads) == ("m", Path("x.json"), True, 5, 1)
    assert harness.bench_parser(script, None, json_out="optional").parse_args([]).json_out is None
    bare = harness.bench_parser(script, None, model=False, lock=False, json_out="none").parse_args([])
    assert vars(bare) == {}, "model=False, lock=False and json_out='none' add no flag"


@pytest.mark.parametrize("argv, flag", [(["--repeats", "0"], "--repeats"), (["--max-new-tokens", "x"], "--max-new-tokens"),
                                        (["--threads", "-1"], "--threads"), (["--rows", "4,0"], "--rows"),
                                        (["--fractions", "0.1,a"], "--fractions")])
def test_bad_flag_values_stop_the_parser_with_a_message_naming_the_flag(argv, flag, tmp_path, capsys):
    parser = harness.bench_parser(tmp_path / "s.py", None)
    parser.add_repeats(2)
    parser.add_max_new_tokens(8)
    parser.add_threads()
    parser.add_argument("--rows", type=harness.positive_int_list, default="1,2")
    parser.add_argument("--fractions", type=harness.float_list, default="0.5")
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(argv)
    assert stop.value.code == 2 and flag in capsys.readouterr().err


def test_list_flags_parse_as_lists_and_an_empty_float_list_leaves_an_arm_out(tmp_path):
    parser = harness.bench_parser(tmp_path / "s.py", None)
    parser.add_argument("--rows", type=harness.positive_int_list, default="1,4,8")
    parser.add_argument("--nearest", type=harness.float_list, default="0.3")
    assert (parser.parse_args([]).rows, parser.parse_args([]).nearest) == ([1, 4, 8], [0.3])
    assert parser.parse_args(["--nearest", ""]).nearest == []


def test_a_bad_json_out_mode_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="json_out"):
        harness.bench_parser(tmp_path / "s.py", None, json_out="always")


# -- the run --------------------------------------------------------------------------------------
def test_start_run_applies_threads_and_takes_no_lock_with_no_lock(tmp_path):
    parser = harness.bench_parser(tmp_path / "s.py", None)
    parser.add_threads()
    before = torch.get_num_threads()
    try:
        harness.start_run(parser.parse_args(["--threads", "1", "--no-lock"]))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert not harness.bench_lock_held()


def lock_is_free(path: Path) -> bool:
    return subprocess.run(["flock", "-n", str(path), "true"], timeout=30).returncode == 0


needs_flock = pytest.mark.skipif(shutil.which("flock") is None or not Path("/proc/self/fd").exists(),
                                 reason="needs util-linux flock and /proc")


@needs_flock
def test_the_lock_is_taken_when_free_refused_without_waiting_when_held_and_let_go(tmp_path):
    lock = tmp_path / "bench.lock"
    assert harness.hold_bench_lock(lock, wait=False) and harness.bench_lock_held(lock)
    assert harness.hold_bench_lock(lock, wait=False), "a second call finds it held already"
    assert not lock_is_free(lock), "another process must see the lock taken"
    harness.release_bench_lock(lock)
    assert lock_is_free(lock) and not harness.bench_lock_held(lock)

    # flock's command inherits the locked descriptor, so both go: a session of their own, ended whole.
    holder = subprocess.Popen(["flock", str(lock), "sleep", "120"], start_new_session=True)
    try:
        for _ in range(600):
            if not lock_is_free(lock):
                break
        assert not harness.hold_bench_lock(lock, wait=False), "the lock is another process's"
        assert not harness.bench_lock_held(lock)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    for _ in range(600):  # the killed sleep may outlive flock by a moment, its descriptor with it
        if lock_is_free(lock):
            break
    assert harness.hold_bench_lock(lock, wait=False), "free again once its holder exited"
    harness.release_bench_lock(lock)


@needs_flock
def test_a_descriptor_that_already_holds_the_lock_counts_as_holding_it(tmp_path):
    """What a script run as ``flock LOCK ./dev python ...`` sees: a descriptor holding the lock. A
    second ``open`` and ``flock`` would wait forever; the harness must find that descriptor instead."""
    import fcntl

    lock = tmp_path / "bench.lock"
    fd = os.open(lock, os.O_RDONLY | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert harness.hold_bench_lock(lock, wait=False), "the held descriptor was not found"
        harness.release_bench_lock(lock)
        assert not lock_is_free(lock), "letting go must not close a descriptor the process inherited"
    finally:
        os.close(fd)


@needs_flock
def test_flock_hands_the_locked_descriptor_to_its_command(tmp_path):
    """The premise of the test above: ``flock FILE command`` passes its locked descriptor on."""
    lock = tmp_path / "bench.lock"
    probe = ("import fcntl, os, sys\n"
             "fds = [int(n) for n in os.listdir('/proc/self/fd')]\n"
             "mine = [fd for fd in fds if os.path.exists(f'/proc/self/fd/{fd}') and "
             "os.readlink(f'/proc/self/fd/{fd}') == sys.argv[1]]\n"
             "fcntl.flock(mine[0], fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
             "print(len(mine))")
    run = subprocess.run(["flock", str(lock), sys.executable, "-c", probe, os.path.realpath(lock)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "1", run.stderr[-1000:]


# -- timing ---------------------------------------------------------------------------------------
def test_side_by_side_runs_every_arm_once_a_repeat_in_order_after_its_before():
    log: list[str] = []
    arms = {"a": lambda: log.append("a") or len(log), "b": lambda: log.append("b") or len(log)}
    timings = harness.side_by_side(arms, 3, before=lambda name: log.append(f"before {name}"))
    assert log == ["before a", "a", "before b", "b"] * 3
    assert [len(timings[name].runs_s) for name in arms] == [3, 3]
    assert timings["a"].results == [2, 6, 10] and timings["b"].result == 12, "results in run order, last kept"
    assert min(timings["a"].runs_s) <= timings["a"].median_s <= max(timings["a"].runs_s)
    with pytest.raises(ValueError, match="repeats"):
        harness.side_by_side(arms, 0)


def test_timed_returns_the_result_and_a_duration():
    seconds, result = harness.timed(lambda: "done")
    assert result == "done" and seconds >= 0


# -- results ----------------------------------------------------------------------------------------
def git_head() -> str | None:
    run = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    return run.stdout.strip() if run.returncode == 0 else None


def test_the_environment_says_where_when_and_on_what_a_run_happened(tmp_path):
    import transformers

    env = harness.environment()
    assert env["torch"] == torch.__version__ and env["transformers"] == transformers.__version__
    assert env["cpu_count"] == os.cpu_count() and 1 <= env["cpus_usable"] <= os.cpu_count()
    assert isinstance(env["cpu_model"], str) and env["cpu_model"]
    assert env["cpu_physical_cores"] is None or 1 <= env["cpu_physical_cores"] <= os.cpu_count()
    assert env["torch_threads"] == torch.get_num_threads()
    assert env["command"] == shlex.join(sys.argv)
    date = datetime.datetime.fromisoformat(env["date_utc"])
    assert date.utcoffset() == datetime.timedelta(0), "the date is in UTC"
    assert env["git_commit"] == git_head() and isinstance(env["git_uncommitted_changes"], bool)
    assert env["bench_lock_held"] is harness.bench_lock_held()
    outside = harness.environment(repo=tmp_path)
    assert outside["git_commit"] is None and outside["git_uncommitted_changes"] is None


@dataclasses.dataclass
class Row:
    arm: str
    tok_s: float


def test_write_json_keeps_the_payload_adds_the_environment_and_serialises_what_benchmarks_hold(tmp_path):
    path = tmp_path / "results" / "nested" / "out.json"
    payload = {"arms": [Row("rksc", 12.5)], "args": {"json_out": tmp_path / "x.json", "levels": {3, 1}},
               "tokens": torch.tensor([1, 2]), "ratio": 1.5}
    assert harness.write_json(path, payload) == path
    saved = json.loads(path.read_text())
    assert saved["arms"] == [{"arm": "rksc", "tok_s": 12.5}] and saved["ratio"] == 1.5
    assert saved["args"] == {"json_out": str(tmp_path / "x.json"), "levels": [1, 3]} and saved["tokens"] == [1, 2]
    assert list(saved)[:-1] == list(payload) and list(saved)[-1] == harness.ENVIRONMENT_KEY
    assert saved["environment"]["git_commit"] == git_head() and saved["environment"]["torch"] == torch.__version__
    with pytest.raises(ValueError, match="environment"):
        harness.write_json(path, {"environment": {}})


# -- the shared prompts -----------------------------------------------------------------------------
def test_shots_are_added_from_the_start_wrapping_around_until_the_prompt_is_long_enough(capsys):
    engine = RKSCEngine(make_tiny_model(max_positions=4096), make_char_tokenizer())
    pool = synthetic_problems(5, seed=0)
    one_shot = len(engine.encode(few_shot_messages("?", pool[4:5])))
    assert shots_to_length(engine, "?", pool, one_shot, start=4) == [pool[4]]
    assert shots_to_length(engine, "?", pool, one_shot + 1, start=4) == [pool[4], pool[0]], "consecutive, wrapping"
    assert shots_to_length(engine, "?", pool, 10**6, start=4) == pool[4:] + pool[:4], "each shot at most once"
    assert "warning" in capsys.readouterr().err
    with pytest.raises(ValueError, match="pool"):
        shots_to_length(engine, "?", [], 10)


# -- the docstring's example ------------------------------------------------------------------------
def test_the_module_docstrings_example_script_runs_and_writes_its_results(tmp_path):
    lines = harness.__doc__.splitlines()
    first = next(i for i, line in enumerate(lines) if line.strip().startswith('"""Benchmark'))
    last = next(i for i in range(first, len(lines)) if lines[i].strip() == "main()")
    source = textwrap.dedent("\n".join(lines[first:last + 1]))
    model_dir = tmp_path / "tiny"
    make_tiny_model(max_positions=1024).save_pretrained(model_dir)
    make_char_tokenizer().save_pretrained(model_dir)
    namespace = {"__name__": "step_overhead", "__file__": str(tmp_path / "step_overhead.py")}
    exec(compile(source, "step_overhead.py", "exec"), namespace)
    namespace["main"](["--model", str(model_dir), "--no-lock", "--repeats", "2"])
    saved = json.loads((tmp_path / "results" / "step_overhead.json").read_text())
    assert saved["median_s"] > 0 and saved["environment"]["bench_lock_held"] is False
