"""Trials in a worker process (docs/design.md §6.6): a config that crashes the process, hangs past the trial time
limit or exhausts memory is a failed trial with that reason, and the run goes on.

The worker (a spawned process running ``measure.LocalBench``) is kept warm across trials: the current key's
compiled regions stay built. It is restarted after a crash or a kill. The tuner's own process only talks to
the storage, so it never loses a trial that completed; and the worker dies with it.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from ..registry import Key
from .check import check_one
from .measure import LocalBench, MeasureOptions, machine_lock
from .search import TrialResult


class WorkerFailure(Exception):
    """The worker could not answer: it crashed, timed out or ran out of memory (the message says which)."""


def _die_with_parent() -> None:
    """Linux: the kernel kills the worker when the tuner's process dies, even mid-kernel."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _serve(conn, backend: str, options: MeasureOptions, imports: list[str]) -> None:
    """The worker's main loop: requests in, results (or the error) out. Ctrl-C reaches the whole process group
    but is the tuner's to handle: it stops the worker at once (a worker that died of it first would read as a
    failed trial); the worker also ends when the tuner closes its pipe or dies."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import importlib

    import nki_autotune.kernels  # noqa: F401  (registers every op)

    from ..registry import get_backend

    for name in imports:
        importlib.import_module(name)

    @contextmanager
    def lock():  # the tuner stops the trial's clock while this worker waits for another to finish timing
        conn.send(("lock", "waiting"))
        with machine_lock():
            conn.send(("lock", "held"))
            yield

    bench = LocalBench(get_backend(backend), options, lock=lock, say=lambda message: conn.send(("note", message)))
    requests = {"check": check_one, "ready": lambda: True}  # check's; the rest are LocalBench's
    while True:
        try:
            kind, args = conn.recv()
        except (EOFError, OSError):  # the tuner closed the pipe, or is gone
            return
        try:
            reply = ("ok", (requests.get(kind) or getattr(bench, kind))(*args))
        except Exception as e:
            reply = ("error", f"{type(e).__name__}: {str(e)[:300]}")
        try:
            conn.send(reply)
        except OSError:  # a broken pipe: the tuner is gone
            return


def _rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_memory_limit() -> int | None:
    """80% of the machine's memory (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(int(line.split()[1]) * 1024 * 0.8)
    except (OSError, ValueError):
        return None
    return None


class Worker:
    """One worker process, started on demand and restarted after it dies."""

    def __init__(self, backend: str, options: MeasureOptions, imports: list[str] | None = None,
                 memory_limit: int | None = None, say: Callable[[str], None] = lambda message: None,
                 limits: tuple[str, str] = ("--trial-timeout", "--trial-memory")):
        self.backend, self.options, self.imports = backend, options, list(imports or ())
        self.memory_limit, self.say = memory_limit, say
        self.limits = limits
        """The command's options that set the time and the memory limit, named in the failures."""
        self._proc = self._conn = None
        self.starts = 0

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # fork would copy the tuner's threads and torch state
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.backend, self.options, self.imports), daemon=True,
                                 name="nki-autotune-worker")
        self._proc.start()
        child.close()
        self.starts += 1

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(5)
        self._proc = self._conn = None

    def start(self) -> None:
        """Start the process from this thread unless it runs: its parent-death signal follows the thread that
        started it, so a worker a short-lived thread would start would die with that thread."""
        if not self.alive:
            self._kill()
            self._start()

    def ready(self, timeout: float = 600.0) -> None:
        """Started and past its imports (they are not a request's time: ``call`` counts from its request)."""
        if not self.alive:
            self.call("ready", (), timeout)

    def call(self, kind: str, args: tuple, timeout: float) -> Any:
        self.start()
        self._conn.send((kind, args))
        deadline, waiting = time.monotonic() + timeout, None
        while True:
            try:
                ready = self._conn.poll(0.2)
            except (EOFError, OSError):
                ready = False
            if ready:
                try:
                    status, value = self._conn.recv()
                except (EOFError, OSError):
                    status, value = "died", None
                if status == "note":
                    self.say(value)
                    continue
                if status == "lock":  # time spent waiting for the machine lock is not the trial's
                    if value == "waiting":
                        waiting = time.monotonic()
                    elif waiting is not None:
                        deadline, waiting = deadline + time.monotonic() - waiting, None
                    continue
                if status == "ok":
                    return value
                if status == "error":
                    raise WorkerFailure(value)
            if not self._proc.is_alive():
                code = self._proc.exitcode
                self._kill()
                raise WorkerFailure(_death(code))
            rss = _rss_bytes(self._proc.pid)
            if self.memory_limit is not None and rss is not None and rss > self.memory_limit:
                self._kill()
                raise WorkerFailure(f"exhausted memory: the worker used {rss / 2**30:.1f} GiB, above the limit of "
                                    f"{self.memory_limit / 2**30:.1f} GiB ({self.limits[1]})")
            if waiting is None and time.monotonic() > deadline:
                self._kill()
                raise WorkerFailure(f"timed out after {timeout:.0f} s ({self.limits[0]}); the worker was killed")

    def close(self, wait_s: float = 10.0) -> None:
        """Ask the worker to finish (it returns when its end of the pipe closes), give it ``wait_s`` to end its
        trial, then make sure it has."""
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
        if self._proc is not None:
            self._proc.join(wait_s)
        self._kill()


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        extra = " (out of memory, or killed from outside)" if -code == signal.SIGKILL else ""
        return f"the worker process died: killed by signal {name}{extra}"
    return f"the worker process died: exit code {code}"


class IsolatedBench:
    """``LocalBench``'s requests, answered by a worker process under a time and memory limit."""

    def __init__(self, backend: str, options: MeasureOptions, imports: list[str] | None = None,
                 trial_timeout: float = 300.0, memory_limit: int | None = None,
                 say: Callable[[str], None] = lambda message: None):
        self.worker = Worker(backend, options, imports, memory_limit, say)
        self.trial_timeout = trial_timeout
        self.prepare_timeout = max(600.0, 4 * trial_timeout)  # compiling the compiler's regions takes longest
        o = options  # the final comparison is measured again after a pause on a disturbed machine
        self.final_timeout = (o.retries + 1) * (trial_timeout + o.pause_s)
        self._key: Key | None = None
        self._starts = -1

    def _ready(self, key: Key, samples: str | None) -> None:
        if self._key != key or self._starts != self.worker.starts or not self.worker.alive:
            self._key = None
            try:
                self.worker.call("prepare", (key, samples), self.prepare_timeout)
            except WorkerFailure as e:
                raise WorkerFailure(f"preparing {key.label()}: {e}") from None
            self._key, self._starts = key, self.worker.starts

    def trial(self, key: Key, impl: str, config: dict[str, int], samples: str | None = None) -> TrialResult:
        try:
            self._ready(key, samples)
            return self.worker.call("trial", (key, impl, config, samples), self.trial_timeout)
        except WorkerFailure as e:
            return TrialResult(config, None, {"error": str(e)})

    def final(self, key: Key, impl: str, config: dict[str, int], samples: str | None = None) -> dict[str, Any]:
        try:
            self._ready(key, samples)
            return self.worker.call("final", (key, impl, config, samples), self.final_timeout)
        except WorkerFailure as e:
            return {"error": str(e)}

    def compile_ahead(self, work: list[tuple[Key, list[str], str | None]]) -> dict[Key, float | str]:
        """Each key's regions and first configs compiled once, untimed, before any key is timed
        (``LocalBench.precompile``): on every core, this worker and one more per further core taking the keys in
        turn. The extra workers end with it. Returns each key's seconds, or why it failed: a failure is left for
        the timed phase to meet and record as data."""
        done: dict[Key, float | str] = {}
        if not work:
            return done
        queue = list(reversed(work))
        extra = [Worker(self.worker.backend, self.worker.options, self.worker.imports, self.worker.memory_limit)
                 for _ in range(min(len(work), _cores()) - 1)]

        def drain(worker: Worker) -> None:
            while True:
                try:
                    key, impls, samples = queue.pop()
                except IndexError:
                    return
                try:
                    done[key] = worker.call("precompile", (key, impls, samples), self.prepare_timeout)
                except WorkerFailure as e:
                    done[key] = str(e)

        workers = (self.worker, *extra)
        threads = [threading.Thread(target=drain, args=(w,), name="nki-autotune-compile-ahead", daemon=True)
                   for w in workers]
        try:
            for w in workers:
                w.start()  # from this thread, so that each outlives the thread that drives it
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for w in extra:
                w.close(wait_s=0)
        return done

    @property
    def longest_s(self) -> float:
        """The longest a live worker may hold one claimed trial (preparing its key, then a final comparison), not
        counting waits for the machine lock: the lease of a trial no stamp has reached yet (``search``)."""
        return self.prepare_timeout + self.final_timeout + 60.0

    def close(self, wait_s: float = 10.0) -> None:
        self.worker.close(wait_s)


__all__ = ["IsolatedBench", "Worker", "WorkerFailure", "default_memory_limit"]
