"""A thread done with model work lets its OpenMP workers go, so the scheduler's are the only ones.

With two threads' worth of OpenMP workers on the CPUs, ``libgomp`` makes idle workers sleep at once
and every small parallel region of a decode step pays to wake them (``runtime/cpu_threads.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch
from conftest import make_char_tokenizer, make_tiny_model

from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.runtime import cpu_threads, scheduler
from rksc_engine.runtime.cpu_threads import release_openmp_workers

# Run in a fresh interpreter: in the test process, threads of earlier tests come and go.
_COUNT_WORKERS = """
import json, os, threading, torch
from rksc_engine.runtime.cpu_threads import release_openmp_workers

def thread_ids():
    return {int(tid) for tid in os.listdir("/proc/self/task")}

def parallel_region():  # a fused attention call always splits its heads over the OpenMP team
    query = torch.randn(1, 8, 4, 64)
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, query, query, 0.0, False, scale=0.125)

seen = {}
def work():  # a fresh thread: its team is its own, built by its first region
    before = thread_ids()
    parallel_region()
    workers = thread_ids() - before
    seen["released"] = release_openmp_workers()
    seen["workers"], seen["left"] = len(workers), len(workers & thread_ids())
    parallel_region()
    seen["rebuilt"] = len(thread_ids() - before - {threading.get_native_id()})

thread = threading.Thread(target=work)
thread.start()
thread.join()
print(json.dumps(seen))
"""


@pytest.mark.skipif(not cpu_threads.gnu_openmp_loaded() or torch.get_num_threads() < 2,
                    reason="needs PyTorch on GNU OpenMP with more than one intra-op thread")
def test_release_ends_the_calling_threads_openmp_workers_and_the_next_region_brings_them_back():
    done = subprocess.run([sys.executable, "-c", _COUNT_WORKERS], capture_output=True, text=True, timeout=300,
                          check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["workers"] >= 1, "the parallel region started no worker thread"
    assert seen["released"] is True
    assert seen["left"] == 0
    assert seen["rebuilt"] >= 1, "the next parallel region found no workers"


def test_release_is_a_harmless_no_op_when_the_thread_has_no_workers():
    results = []
    thread = threading.Thread(target=lambda: results.append((release_openmp_workers(), release_openmp_workers())))
    thread.start()
    thread.join()
    assert results[0][0] == results[0][1]


def test_only_threads_done_with_the_model_let_their_workers_go(monkeypatch):
    calls: list[str] = []
    scheduler_idle = threading.Event()

    def record() -> bool:
        name = threading.current_thread().name
        calls.append(name)
        if name == "rksc-scheduler":
            scheduler_idle.set()
        return True

    monkeypatch.setattr(scheduler, "release_openmp_workers", record)
    monkeypatch.setattr("rksc_engine.engine.release_openmp_workers", record)
    me = threading.current_thread().name

    engine = RKSCEngine(make_tiny_model(), make_char_tokenizer())
    assert calls == [me], "the thread that built the engine keeps the workers the loading used"

    calls.clear()
    handle = engine.submit("abc", 2, SamplingParams(max_new_tokens=12))
    handle.result()
    assert scheduler_idle.wait(60), "the scheduler never let its workers go on running out of work"
    # The loop keeps its workers from step to step: it lets them go once, when the work is done.
    assert calls.count("rksc-scheduler") == 1
    assert engine.scheduler.num_steps >= 10  # the first token comes with the prefill

    calls.clear()
    with engine.exclusive():
        engine.generate("abc", SamplingParams(max_new_tokens=4))  # driven by this thread
        assert me not in calls, "inner calls must not release while the block still holds the engine"
    assert calls.count(me) == 1
