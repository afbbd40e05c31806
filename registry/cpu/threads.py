"""How many threads a CPU kernel runs on: the choices the tuner searches, and the default config's choice by the
work of a call (one thread below the size at which a second one pays, measured per kernel)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numba
import torch


def max_threads() -> int:
    return int(numba.config.NUMBA_NUM_THREADS)


def input_elements(key) -> int:
    """The work of a call as the elements of its first input (the measure ``SERIAL_BELOW`` counts in)."""
    return math.prod(key.inputs[0].shape)


def threads_for(work: int, serial_below: int) -> int:
    """One thread below ``serial_below`` (the work at which a second thread starts to pay, measured per kernel by
    ``benchmarks/test_threads.py``), else every thread."""
    return 1 if work < serial_below else max_threads()


def fit_threads(serial_below: int, work: Callable = input_elements, serial: dict | None = None) -> Callable:
    """An impl's ``fit``: the default config's ``threads`` for the call's work (``work(key)``, in elements), and
    ``serial``'s params with one thread (where the default's other params need several)."""
    def fit(key) -> dict[str, int]:
        threads = threads_for(work(key), serial_below)
        return {"threads": threads, **(serial or {} if threads == 1 else {})}

    return fit


def thread_choices() -> tuple[int, ...]:
    """1, 2, 4, ... up to this machine's core count."""
    out, n = [], 1
    while n < max_threads():
        out.append(n)
        n *= 2
    out.append(max_threads())
    return tuple(sorted(set(out)))


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's own kernels (its BLAS and oneDNN products) on ``threads`` threads within, the caller's count put
    back after (compiled code guards on it: a count left changed would recompile the model's graphs)."""
    before = torch.get_num_threads()
    want = max(1, min(threads, max_threads()))
    if want != before:
        torch.set_num_threads(want)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
