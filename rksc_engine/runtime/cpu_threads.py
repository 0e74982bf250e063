"""Letting go of a thread's OpenMP workers once it is done with model work.

PyTorch's CPU kernels (its own ``parallel_for`` and MKL's GEMMs) run on GNU OpenMP (``libgomp``) on
Linux. ``libgomp`` gives every thread that opens a parallel region a team of worker threads of its
own, and keeps the team after the region ends. While the process holds more such threads than it
has CPUs, ``libgomp`` stops letting idle workers spin: they sleep almost at once, and every later
parallel region must wake them through the kernel. A decode step opens about a thousand small
parallel regions (each attention call and each linear layer), so that wake-up, tens of
microseconds each on a virtual machine, can cost as much as the step's arithmetic.

The engine's forwards run on the scheduler's thread, but the model is loaded on the caller's
thread, and ``exclusive()`` blocks and verifier passes run on their callers' threads too. Each of
those threads would keep a team, and two teams are already more threads than CPUs. So a thread that
is done with model work lets its team go (the next region it opens builds one again, which costs
one thread start), and the scheduler lets its own go when it runs out of work.

Other OpenMP runtimes (LLVM's ``libomp``, Intel's ``libiomp5``) pause every team of the process,
not the caller's alone, so they are left as they are.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

# ``omp_pause_resource_all``'s argument for "release the threads, keep the settings".
OMP_PAUSE_SOFT = 1


@functools.cache
def _gnu_openmp() -> Any:
    """The ``libgomp`` the process has loaded (PyTorch's), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)  # already loaded: this only looks it up
        except OSError:
            continue
        if hasattr(library, "omp_pause_resource_all"):  # libgomp of GCC 9 and later
            library.omp_pause_resource_all.argtypes = [ctypes.c_int]
            library.omp_pause_resource_all.restype = ctypes.c_int
            return library
    return None


def gnu_openmp_loaded() -> bool:
    """Whether the process runs PyTorch's CPU kernels on a ``libgomp`` this module can work with."""
    return _gnu_openmp() is not None


def release_openmp_workers() -> bool:
    """Let the calling thread's OpenMP worker threads go (``libgomp`` only; see the module docstring).

    Safe at any time outside a parallel region, which Python code always is. Other threads' teams
    are untouched. Returns whether a ``libgomp`` was found and accepted the call."""
    library = _gnu_openmp()
    if library is None:
        return False
    try:
        return library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    except Exception:  # noqa: BLE001 - a speed measure: never a reason to fail the caller
        logger.debug("omp_pause_resource_all failed", exc_info=True)
        return False
