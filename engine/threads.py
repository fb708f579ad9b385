"""Where a thread runs and what the OS calls it (Linux; elsewhere a no-op or an error).

A worker's engine thread computes for tens of milliseconds at a time. Pinned to a core of
its own, it never shares that core with the event loop and the gRPC threads that carry
its tokens out: those may run on the process's other cores (``pdserve up --pin
--control-cpus`` gives a worker process its core plus the control cores no worker computes
on, and the engine thread its core alone; ``services.up.worker_placement``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

_PR_SET_NAME = 15
_NAME_MAX = 15  # bytes, without the NUL


def core_set(cpus: Iterable[int]) -> frozenset[int]:
    """``cpus`` as a frozen set; ``ValueError`` unless it is a non-empty set of core numbers
    (ints >= 0)."""
    wanted = frozenset(cpus)
    if not wanted or not all(type(c) is int and c >= 0 for c in wanted):
        raise ValueError(f"cpus must be a non-empty set of core numbers, got {cpus!r}")
    return wanted


def check_cpus(cpus: Iterable[int]) -> frozenset[int]:
    """``core_set(cpus)``, and every core one the calling thread may run on now."""
    wanted = core_set(cpus)
    allowed = os.sched_getaffinity(0)
    if not wanted <= allowed:
        raise ValueError(f"cores {sorted(wanted)} are not within {sorted(allowed)}")
    return wanted


def pin_current_thread(cpus: Iterable[int]) -> None:
    """Run the calling thread (and threads it starts later) only on ``cpus``, which may lie
    outside its current cores; ``OSError`` when the system refuses them."""
    os.sched_setaffinity(0, cpus)  # pid 0: the calling thread on Linux


def pinned_call(cpus: Iterable[int] | None, fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread that runs only on ``cpus`` (None: ``fn()`` here), so every
    thread ``fn`` starts (a native library's included) inherits those cores."""
    if cpus is None:
        return fn()
    wanted = core_set(cpus)
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            pin_current_thread(wanted)
            result.append(fn())
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=run, name="pinned-call", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def name_current_thread(name: str) -> bool:
    """Set the calling thread's OS name (``top -H``, ``/proc/<pid>/task/<tid>/comm``),
    cut to 15 bytes. False where the platform has no ``prctl``."""
    path = ctypes.util.find_library("c")
    if path is None or not hasattr(os, "sched_setaffinity"):
        return False
    libc = ctypes.CDLL(path, use_errno=True)
    raw = name.encode("utf-8", "replace")[:_NAME_MAX]
    return libc.prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0
