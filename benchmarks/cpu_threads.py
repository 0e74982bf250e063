"""Benchmark: what a second thread's OpenMP workers cost the thread that runs the model (CPU).

``libgomp`` keeps a team of worker threads for every thread that has opened a parallel region. With
more such threads than CPUs, idle workers sleep at once, and every small parallel region has to wake
them (``rksc_engine/runtime/cpu_threads.py``). Two measurements, side by side in one run:

* ``kernel``: one small fused attention call (a decode step's shape for one request), timed on a
  thread of its own while another thread holds no team, holds one, and has let its team go;
* ``engine``: decode steps of ``--rows`` independent chat requests, driven by this thread inside
  ``exclusive()`` right after the scheduler's thread served a request, with the engine letting idle
  threads' workers go (as it does) and with that turned off (as it did before).

    flock /tmp/rksc-bench.lock ./dev python benchmarks/cpu_threads.py
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from rksc_bench import harness
from rksc_bench.prompts import submit_independent
from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.runtime import cpu_threads, scheduler

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_count("--rows", 16, "independent requests in the engine arm")
    parser.add_max_new_tokens(64, "tokens per request")
    parser.add_count("--calls", 2000, "attention calls per kernel measurement")
    parser.add_repeats(2, "runs per engine setting, alternated")
    return parser.parse_args(argv)


def small_attention_us(calls: int) -> float:
    """Microseconds a call of a (1, 3, 3, 64) query over 40 keys takes, timed on this thread."""
    query, keys = torch.randn(1, 3, 3, 64), torch.randn(1, 3, 40, 64)
    for _ in range(50):
        FLASH(query, keys, keys, 0.0, False, scale=0.125)
    start = time.perf_counter()
    for _ in range(calls):
        FLASH(query, keys, keys, 0.0, False, scale=0.125)
    return (time.perf_counter() - start) / calls * 1e6


def on_new_thread(fn, *args):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    thread.join()
    return out[0]


def kernel(calls: int) -> dict[str, float]:
    """The call's cost on a fresh thread, against what another live thread holds."""
    result = {"other thread holds no team": on_new_thread(small_attention_us, calls)}
    go, ready = threading.Event(), threading.Event()

    def other() -> None:  # opens a parallel region (gets a team), then idles, alive
        small_attention_us(10)
        ready.set()
        go.wait()
        cpu_threads.release_openmp_workers()
        ready.set()
        go.wait()

    holder = threading.Thread(target=other)
    holder.start()
    ready.wait()
    result["other thread holds a team"] = on_new_thread(small_attention_us, calls)
    ready.clear()
    go.set()
    ready.wait()
    go.clear()
    result["other thread let its team go"] = on_new_thread(small_attention_us, calls)
    go.set()
    holder.join()
    return result


def engine_steps(engine: RKSCEngine, args: argparse.Namespace) -> dict[str, float]:
    """Decode ``rows`` independent requests driven by this thread, right after the loop served one."""
    harness.warm_up(engine)  # the scheduler's thread now has a team
    engine.clear_cache()
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    with engine.exclusive():
        start = time.perf_counter()
        handles = submit_independent(engine, args.rows, params)
        step_s = []
        while not all(h.done() for h in handles):
            tick = time.perf_counter()
            engine.scheduler.step()
            step_s.append(time.perf_counter() - tick)
        wall = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for h in handles for c in h.result())
    return {"tok_s": tokens / wall, "median_step_ms": statistics.median(step_s[1:]) * 1e3}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    harness.start_run(args)
    if not cpu_threads.gnu_openmp_loaded():
        print("this PyTorch does not run on GNU OpenMP: nothing to measure")
        return
    report: dict = {"kernel_us": kernel(args.calls)}
    print("| small attention call, on a fresh thread | us a call |\n|---|---:|")
    for name, value in report["kernel_us"].items():
        print(f"| {name} | {value:.1f} |")

    engine = harness.load_engine(args)
    settings = {"idle threads let their workers go": cpu_threads.release_openmp_workers,
                "turned off": lambda: False}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
    for _ in range(args.repeats):
        for name, release in settings.items():
            scheduler.release_openmp_workers = release  # the loop and the lock's release read it
            runs[name].append(engine_steps(engine, args))
            release()  # this thread drove the steps: start the next setting from the same state
    scheduler.release_openmp_workers = cpu_threads.release_openmp_workers
    print(f"\n| {args.rows} independent requests, steps driven in exclusive() | tok/s | median ms a step |\n"
          "|---|---:|---:|")
    report["engine"] = {}
    for name, results in runs.items():
        tok_s = statistics.median(r["tok_s"] for r in results)
        step_ms = statistics.median(r["median_step_ms"] for r in results)
        report["engine"][name] = {"tok_s": tok_s, "median_step_ms": step_ms, "runs": results}
        print(f"| {name} | {tok_s:.1f} | {step_ms:.1f} |")
    harness.write_json(args.json_out, report)


if __name__ == "__main__":
    main()
