"""What the suite's tests share, made safe for two pytest-xdist workers, and what keeps it in its time budget.

Imported by ``conftest.py`` before the package is: the user cache it points at is read by the package's settings
at import. What each worker has of its own and what the workers share:

- ``SEED``: one per run, the same in every worker (which must collect the same test ids: the fresh shapes in
  ``test_pack.py``'s ids come from it). ``NKI_TESTS_SEED=<n> make test`` runs again with the seed a failing id
  names.
- The user cache (``XDG_CACHE_HOME``, where ``nki-autotune run`` keeps its studies by default): a temporary
  folder per test process, and per test (``own_user_cache``), for the test and the commands it starts; never the
  user's ``~/.cache/nki-autotune/studies.db``.
- Compile caches, shared on purpose: numba's (``NUMBA_CACHE_DIR``) and Inductor's (``TORCHINDUCTOR_CACHE_DIR``)
  write each entry to a temporary file and rename it into place, so workers read whole entries or none; a kernel
  one worker compiled is loaded from disk by the other. Two workers that need the same uncached kernel at once
  (both start on tests of RMSNorm) would each compile it: ``share_numba_compiles`` makes the second wait for the
  first's entry and load it.
- The machine-wide measurement lock (``autotune/measure.py: LOCK_PATH``), shared on purpose: a test that times
  for real holds it as a user's run does, so the two workers never time at the same moment. The other worker's
  compiling still loads the machine, and the tuner's calibration says so (DISTURBED): end-to-end tests accept
  that verdict where it is the truth; tests of the tuner's logic inject a clock and a load meter (``fakes.py``).
- The cores: each worker's PyTorch (its OpenMP runtime, ``OMP_NUM_THREADS``) gets its share of them, one on two
  cores with two workers, and so do the commands its tests start. Two workers each running PyTorch's default of
  one thread per core oversubscribe the machine, and the eager steps of a tiny model, hundreds of parallel regions
  of microseconds each, then wait on threads the other worker's threads hold: 20 AdamW steps of a tiny Llama took
  13-44 s on two loaded cores, 0.3 s on one thread. numba's thread count (``NUMBA_NUM_THREADS``) is left alone, so
  the kernels' two-thread configs are still tested.
- Fixtures of module scope or wider defined in the tests (``test_cli.py``'s tuned run, ``test_workers.py``'s
  PostgreSQL server): every test using one runs on the same worker (``xdist_group``), so its setup is paid once.
  Function-scoped state (``tmp_path``, ``monkeypatch``, the ``switches`` fixture) is per test and per worker.
- The order: after the groups, the files of the longest tests (``FIRST``), so that the run ends on short tests and
  neither worker waits long for the other at the end.
"""

from __future__ import annotations

import atexit
import fcntl
import itertools
import os
import random
import shutil
import tempfile

import pytest

SEED = int(os.environ.setdefault("NKI_TESTS_SEED", str(random.SystemRandom().randrange(2**31))))
"""This run's seed for fresh inputs chosen at collection. Set here in the first process (pytest's, or xdist's
controller) and inherited by the workers it starts."""

_USER_CACHE = tempfile.mkdtemp(prefix="nki-autotune-tests-cache-")
atexit.register(shutil.rmtree, _USER_CACHE, ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = _USER_CACHE  # each process its own, not the one it inherited
_tests = itertools.count()


@pytest.fixture(autouse=True)
def own_user_cache(monkeypatch):
    """A user cache folder of this test's own (not yet created), for it and the commands it runs."""
    monkeypatch.setenv("XDG_CACHE_HOME", os.path.join(_USER_CACHE, str(next(_tests))))


def share_numba_compiles() -> None:
    """A numba function cached on disk is compiled under a lock file beside its cache entry: a process that needs it
    while another compiles it waits, then loads the other's entry instead of compiling it again. (The kernels of
    the pack call no other cached function, so no two such locks are ever waited for in opposite orders; numba's
    own compiler lock is taken first, so threads of one process do not either.)"""
    from numba.core.compiler_lock import global_compiler_lock
    from numba.core.dispatcher import Dispatcher

    if getattr(Dispatcher.compile, "shares_compiles", False):
        return
    compile_ = Dispatcher.compile
    held: set[str] = set()

    def compile(self, sig):
        folder = getattr(self._cache, "_cache_path", None)  # None: not cached on disk (NullCache)
        if folder is None:
            return compile_(self, sig)
        lock = os.path.join(folder, f"{self._cache._cache_file._index_name}.lock")
        with global_compiler_lock:
            if lock in held:
                return compile_(self, sig)
            os.makedirs(folder, exist_ok=True)
            with open(lock, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, or the process dies
                held.add(lock)
                try:
                    return compile_(self, sig)
                finally:
                    held.discard(lock)

    compile.shares_compiles = True
    Dispatcher.compile = compile


def share_the_cores() -> None:
    """``OMP_NUM_THREADS`` in an xdist worker: its share of the machine's cores, unless the caller set it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))


share_the_cores()
share_numba_compiles()

_WIDE = ("class", "module", "package", "session")

FIRST = ("test_isolation.py", "test_workers.py", "test_cli.py", "test_selftest.py", "test_trainer.py", "test_hf.py",
         "test_tuner.py", "test_switches.py", "test_profile.py", "test_special_values.py", "test_pack_nki.py")
"""Files of the longest tests (real runs, processes of their own, tiny models), in the order they are handed out
after the groups: long tests started first leave short ones for the end of the run, where a long one would keep
one worker busy while the other has nothing left to do."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests that use a fixture of module scope or wider defined in the tests go to one xdist worker together
    (with ``--dist loadgroup``), so the fixture is set up once; the others are spread one by one, the files of
    ``FIRST`` first. (xdist hands out the groups before single tests, the largest first.)"""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        for name in info.names_closure:
            defs = info.name2fixturedefs.get(name)
            if defs and defs[-1].scope in _WIDE and defs[-1].baseid.startswith("tests"):
                item.add_marker(pytest.mark.xdist_group(f"{os.path.basename(defs[-1].baseid)}:{name}"))
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(FIRST)))  # stable: files keep order
    if getattr(config.option, "loadgroup", False):
        _name_groups(items)


def _name_groups(items) -> None:
    """Each grouped test's id ends in ``@<group>``, which is how xdist's controller, which sees ids only, groups
    tests. xdist 3.8 writes it to ``item._nodeid``, which pytest 9.2 no longer reads (its ids are ``item._id``):
    here it is written where pytest reads it, as xdist names it. Where ``_id`` is absent, xdist's own write works."""
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:
        return
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        if groups and hasattr(item, "_id") and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")
