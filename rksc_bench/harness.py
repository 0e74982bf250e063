"""The harness every script in ``benchmarks/`` runs on: its shared flags, the bench lock, model
loading, side-by-side timing, and a JSON results file that says where, when and on what it ran.

A script builds its parser with ``bench_parser``: ``--model``, ``--json-out`` (default
``benchmarks/results/<script>.json``) and ``--no-lock`` come with it, and ``--repeats``, ``--seed``,
``--max-new-tokens``, ``--threads``, ``--device`` and ``--dtype`` are one ``BenchParser`` method
each, so that every shared flag is spelled, typed and explained once (``add_count`` adds a flag of
the script's own that must be >= 1). Once the flags are parsed it
calls ``start_run``; it loads the model with ``load_engine``, times arms with ``side_by_side`` (or
``timed``) and writes its results with ``write_json``, which adds the run's ``environment``: CPU
model and cores, torch and transformers versions, threads, GPU, git commit, UTC date, command line.
A whole new script, ``benchmarks/step_overhead.py`` say:

    \"\"\"Benchmark: one short greedy request, timed.\"\"\"
    from rksc_bench import harness
    from rksc_engine import SamplingParams

    def main(argv: list[str] | None = None) -> None:
        parser = harness.bench_parser(__file__, __doc__)  # --model, --json-out, --no-lock
        parser.add_repeats(3)
        args = parser.parse_args(argv)
        harness.start_run(args)  # --threads where the parser has it; waits for and holds the bench lock
        engine = harness.load_engine(args)
        harness.warm_up(engine)
        arms = {"generate": lambda: engine.generate("Hi", SamplingParams(max_new_tokens=8))}
        times = harness.side_by_side(arms, args.repeats, before=lambda arm: engine.clear_cache())
        harness.write_json(args.json_out, {"median_s": times["generate"].median_s})

    if __name__ == "__main__":
        main()

The bench lock: timings on a shared machine mean something only when no other benchmark runs beside
them, and the convention is one lock file, ``/tmp/rksc-bench.lock``. ``start_run`` waits for it and
holds it until the process exits (``--no-lock`` runs beside whatever holds it). Under ``flock
/tmp/rksc-bench.lock ./dev python benchmarks/...``, as the commands in ``docs/bench`` are written,
the process inherits the descriptor that holds the lock, and that counts as holding it.

Code that several scripts or the tests need lives beside this module in ``rksc_bench``, never in a
script that another one imports: ``prompts`` (essay chats, few-shot prompts to a length),
``branch_runs``, ``reworded_prompts``, ``cgee_ladder``, ``lens_exit``, ``early_stop_replay``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from rksc_engine import RKSCEngine, SamplingParams

BENCH_LOCK = Path("/tmp/rksc-bench.lock")
ENVIRONMENT_KEY = "environment"
# The last line of every benchmark's --help: where its shared flags come from (and a mark that its
# parser was built here).
EPILOG = "Shared flags, the bench lock and the JSON results file: rksc_bench.harness."
JSON_OUT_CHOICES = ("results", "optional", "none")
CHECKOUT = Path(__file__).resolve().parents[1]
T = TypeVar("T")
# Lock file (real path) -> the descriptor that holds it; kept open, so held, until the process exits.
_held_locks: dict[str, int] = {}
# Those of them this process inherited (from ``flock FILE command``): not ours to close.
_inherited: set[int] = set()


# -- flags ----------------------------------------------------------------------------------------
def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_int_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integers, each >= 1 (``"1,4,8"``)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    """An argparse ``type``: comma-separated numbers; ``""`` is the empty list (an arm left out)."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, got {text!r}") from None


class BenchParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` with one method per flag the benchmarks share."""

    def add_model(self, help: str = "local Hugging Face model directory") -> None:
        self.add_argument("--model", default=None, help=f"{help} (default: the embedded SmolLM2-135M-Instruct)")

    def add_json_out(self, default: Path | None, help: str | None = None) -> None:
        if help is None:
            help = f"write the results here as JSON (default {default})" if default else "write the results here as JSON"
        self.add_argument("--json-out", type=Path, default=default, help=help)

    def add_no_lock(self) -> None:
        self.add_argument("--no-lock", action="store_true",
                          help=f"neither wait for nor hold {BENCH_LOCK}, so the run may share the machine with "
                               "another benchmark (its timings then mean little)")

    def add_count(self, flag: str, default: int, help: str | None = None) -> None:
        """An integer flag that must be >= 1 (rows, requests, branches, ...)."""
        self.add_argument(flag, type=positive_int, default=default,
                          help=f"{help} (default {default})" if help else f"default {default}")

    def add_repeats(self, default: int, help: str = "timed runs per arm; the median is reported") -> None:
        self.add_count("--repeats", default, help)

    def add_seed(self, default: int = 0, help: str = "seed of the workload") -> None:
        self.add_argument("--seed", type=int, default=default, help=f"{help} (default {default})")

    def add_max_new_tokens(self, default: int, help: str = "tokens generated per request, at most") -> None:
        self.add_count("--max-new-tokens", default, help)

    def add_threads(self) -> None:
        self.add_argument("--threads", type=positive_int, default=None,
                          help="torch CPU threads (default: torch's choice); 1 suits a busy machine")

    def add_device(self) -> None:
        self.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu, cuda, ... (default auto)")

    def add_dtype(self) -> None:
        self.add_argument("--dtype", default="auto",
                          help="auto, fast, or a dtype name such as float32 or bfloat16 (default auto: float32 on CPU)")


def results_path(script: str | Path, name: str | None = None) -> Path:
    """``results/<name>`` beside ``script`` (``name`` defaults to the script's own, as ``.json``)."""
    script = Path(script).resolve()
    return script.parent / "results" / (name or f"{script.stem}.json")


def bench_parser(script: str | Path, doc: str | None, *, model: bool = True, lock: bool = True,
                 json_out: str = "results") -> BenchParser:
    """A benchmark's parser, its docstring as the help text.

    Args:
        script: The script's ``__file__``; names its default results file.
        doc: The script's ``__doc__``, shown by ``--help`` as written.
        model: Add ``--model``.
        lock: Add ``--no-lock``, and have ``start_run`` hold the bench lock: the script reports
            timings, or loads the machine enough to spoil another benchmark's.
        json_out: ``"results"``: ``--json-out`` defaults to ``benchmarks/results/<script>.json``;
            ``"optional"``: results are written only where ``--json-out`` says; ``"none"``: no flag.
    """
    if json_out not in JSON_OUT_CHOICES:
        raise ValueError(f"json_out must be one of {list(JSON_OUT_CHOICES)}, got {json_out!r}")
    parser = BenchParser(description=doc, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    if model:
        parser.add_model()
    if json_out != "none":
        parser.add_json_out(results_path(script) if json_out == "results" else None)
    if lock:
        parser.add_no_lock()
    return parser


# -- the run --------------------------------------------------------------------------------------
def start_run(args: argparse.Namespace) -> None:
    """What every run does once its flags are parsed, before it loads or measures anything: apply
    ``--threads`` (where the parser has it) and, unless the parser has no ``--no-lock`` or it was
    given, wait for and hold the bench lock."""
    if getattr(args, "threads", None) is not None:
        torch.set_num_threads(args.threads)
    if hasattr(args, "no_lock") and not args.no_lock:
        hold_bench_lock()


def hold_bench_lock(path: Path = BENCH_LOCK, *, wait: bool = True) -> bool:
    """Take ``path``'s exclusive ``flock`` and hold it until the process exits; returns whether it is
    held. A descriptor inherited from ``flock FILE command`` that holds it already counts; without
    ``wait`` a lock held elsewhere returns False at once. Where the platform has no ``flock`` or the
    file cannot be opened, it says so on stderr and returns False."""
    key = os.path.realpath(path)
    if key in _held_locks:
        return True
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        print(f"no flock on this platform: {path} not taken", file=sys.stderr)
        return False
    inherited = _inherited_lock(key, fcntl)
    if inherited is not None:
        _held_locks[key] = inherited
        _inherited.add(inherited)
        return True
    try:
        fd = os.open(key, os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError as error:
        print(f"cannot open {path} ({error}): running without the bench lock", file=sys.stderr)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if not wait:
            os.close(fd)
            return False
        print(f"waiting for {path}: another benchmark holds it (--no-lock would run beside it)",
              file=sys.stderr, flush=True)
        fcntl.flock(fd, fcntl.LOCK_EX)
    _held_locks[key] = fd
    return True


def _inherited_lock(key: str, fcntl: Any) -> int | None:
    """An open descriptor of this process on ``key`` that holds (or can take at once) its lock.

    ``flock FILE command`` keeps the lock on a descriptor that the command inherits; a second
    ``open`` and ``flock`` of the same file would wait for it forever, so look for that one first."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no /proc: no way to see inherited descriptors
        return None
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") != key:
                continue
            fcntl.flock(int(name), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue
        return int(name)
    return None


def release_bench_lock(path: Path = BENCH_LOCK) -> None:
    """Let the lock go before the process exits (a run whose timed part is over); a descriptor
    inherited from ``flock FILE command`` stays the command's, and its lock with it."""
    fd = _held_locks.pop(os.path.realpath(path), None)
    if fd is not None and fd not in _inherited:
        os.close(fd)


def bench_lock_held(path: Path = BENCH_LOCK) -> bool:
    """Whether this process holds the bench lock (``hold_bench_lock`` took or found it)."""
    return os.path.realpath(path) in _held_locks


def load_engine(args: argparse.Namespace, **overrides: Any) -> RKSCEngine:
    """``RKSCEngine.from_pretrained`` on ``--model`` (and ``--device`` / ``--dtype`` where the parser
    has them); ``overrides`` are passed on as they are (``progress=False``, ``config=...``)."""
    options = {name: getattr(args, name) for name in ("device", "dtype") if getattr(args, name, None) is not None}
    return RKSCEngine.from_pretrained(getattr(args, "model", None), **{**options, **overrides})


def warm_up(*engines: RKSCEngine) -> None:
    """One short untimed request on each engine, so one-off setup lands outside the timings."""
    for engine in engines:
        engine.generate("warm up", SamplingParams(max_new_tokens=4))


# -- timing ---------------------------------------------------------------------------------------
def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Run ``fn``; ``(wall seconds, its result)``."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


@dataclass
class Timings(Generic[T]):
    """One arm's runs: wall seconds and result of each, in order."""

    runs_s: list[float] = field(default_factory=list)
    results: list[T] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.runs_s)

    @property
    def result(self) -> T:
        """The last run's result."""
        return self.results[-1]


def side_by_side(arms: Mapping[str, Callable[[], T]], repeats: int, *,
                 before: Callable[[str], object] | None = None) -> dict[str, Timings[T]]:
    """Every arm once per repeat, in the given order each time, so that drift of the machine hits all
    arms alike; ``before(arm)`` runs untimed before each run (clearing a cache, say)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    timings: dict[str, Timings[T]] = {name: Timings() for name in arms}
    for _ in range(repeats):
        for name, fn in arms.items():
            if before is not None:
                before(name)
            seconds, result = timed(fn)
            timings[name].runs_s.append(seconds)
            timings[name].results.append(result)
    return timings


# -- results ----------------------------------------------------------------------------------------
def environment(repo: Path | None = None) -> dict[str, Any]:
    """Where, when and on what a run happened: CPU model and cores, software versions, torch's
    threads, the GPU if any, the git commit of ``repo`` (default: this checkout; ``None`` outside
    git) and whether its tree had uncommitted changes, the UTC date, the command line, the load
    average and whether the run held the bench lock."""
    import transformers

    cpu_model, physical_cores = _cpu_info()
    repo = CHECKOUT if repo is None else Path(repo)
    commit = _git(repo, "rev-parse", "HEAD")
    changes = _git(repo, "status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_uncommitted_changes": None if changes is None else bool(changes),
        "command": shlex.join(sys.argv),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_physical_cores": physical_cores,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "bench_lock_held": bench_lock_held(),
    }


def _cpu_info() -> tuple[str, int | None]:
    """The CPU's model name and its physical cores (``None`` where ``/proc/cpuinfo`` does not say)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), None
    model, cores = None, set()
    for block in text.split("\n\n"):
        fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in block.splitlines())}
        model = model or fields.get("model name") or fields.get("Hardware")
        if "physical id" in fields and "core id" in fields:
            cores.add((fields["physical id"], fields["core id"]))
    return model or platform.processor() or platform.machine(), len(cores) or None


def _git(repo: Path, *args: str) -> str | None:
    """``git -C repo args``' output, or ``None`` when git is missing or fails (not a checkout)."""
    try:
        run = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return run.stdout.strip() if run.returncode == 0 else None


def to_json(value: Any) -> Any:
    """``json.dumps``' ``default``: dataclasses as dicts, sets as sorted lists, tensors and arrays
    as lists, anything else (a path, a ``torch.device``) as its ``str``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def write_json(path: Path | str, payload: Mapping[str, Any], *, repo: Path | None = None) -> Path:
    """Write ``payload`` and the run's ``environment`` (under ``"environment"``) to ``path`` as
    indented JSON, creating its folder; returns the path."""
    if ENVIRONMENT_KEY in payload:
        raise ValueError(f"payload must not have an {ENVIRONMENT_KEY!r} key: write_json adds it")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**payload, ENVIRONMENT_KEY: environment(repo)}
    path.write_text(json.dumps(record, indent=2, default=to_json) + "\n", encoding="utf-8")
    return path
