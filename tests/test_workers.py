"""Many workers, one study, on real storages: a journal file, and a PostgreSQL server this fixture starts.
No (key, impl, config) is measured twice, every worker writes the same table, timing never overlaps on one
machine, and a worker killed mid-trial leaves its work to the others."""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
import yaml

from nki_autotune.autotune.search import open_storage
from nki_autotune.registry import load_table

WORKER = Path(__file__).parent / "data" / "fake_worker.py"
PG_BIN = Path("/usr/lib/postgresql/15/bin")
PROFILE = {"version": 2, "sites": [
    {"op": "rmsnorm", "site": f"m.{n}", "attrs": {"eps": 1e-6},
     "inputs": [{"shape": [n, 64], "dtype": "float32", "requires_grad": True},
                {"shape": [64], "dtype": "float32", "requires_grad": True}]} for n in (32, 48)]}


def _configs() -> int:
    from nki_autotune.registry import Key, TensorSpec, get_op

    op = get_op("rmsnorm")
    return sum(len(op.impls["cpu_rows"].configs(Key.of(op, (TensorSpec((n, 64), "float32", requires_grad=True),
               TensorSpec((64,), "float32", requires_grad=True)), {"eps": 1e-6}))) for n in (32, 48))


CONFIGS = _configs()


def _as(user: pwd.struct_passwd):
    def drop():
        os.setgid(user.pw_gid)
        os.setuid(user.pw_uid)
    return drop


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL 15 server in a temporary directory, run as an unprivileged user; its URL."""
    if not (PG_BIN / "initdb").exists():
        pytest.skip(f"PostgreSQL server binaries are not installed here ({PG_BIN}/initdb is absent)")
    pytest.importorskip("psycopg2", reason="psycopg2 (the dev extra's psycopg2-binary) is not installed")
    root = Path(tempfile.mkdtemp(prefix="nki-autotune-pg-"))  # under /tmp: reachable by the server's user
    drop = None
    if os.geteuid() == 0:  # initdb refuses to run as root
        user = pwd.getpwnam("nobody")
        shutil.chown(root, user.pw_uid, user.pw_gid)
        drop = _as(user)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = root / "data"
    try:
        subprocess.run([PG_BIN / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8"],
                       check=True, capture_output=True, preexec_fn=drop)
        subprocess.run([PG_BIN / "pg_ctl", "-D", data, "-l", root / "log", "-w", "start", "-o",
                        f"-p {port} -h 127.0.0.1 -k {root}"], check=True, capture_output=True, preexec_fn=drop)
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([PG_BIN / "pg_ctl", "-D", data, "-m", "immediate", "stop"], capture_output=True,
                       preexec_fn=drop)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["journal", pytest.param("postgresql", marks=pytest.mark.xdist_group("postgres"))])
def storage(request, tmp_path):
    """A fresh study storage. The server is asked for by name, which pytest cannot see ahead: the mark keeps the
    tests that start it on one xdist worker, so it starts once."""
    if request.param == "journal":
        return f"journal:///{tmp_path}/studies.log"
    url = request.getfixturevalue("postgres")
    db = f"t{os.getpid()}_{int(time.time() * 1000) % 10**9}"
    import psycopg2

    conn = psycopg2.connect(url)
    conn.autocommit = True
    conn.cursor().execute(f"CREATE DATABASE {db}")
    conn.close()
    return url.rsplit("/", 1)[0] + "/" + db


def _start(tmp_path, storage, name, step=0.02, lease=600.0, profile_doc=PROFILE, trials=20):
    profile = tmp_path / "profile.yaml"
    if not profile.exists():
        profile.write_text(yaml.safe_dump(profile_doc))
    cmd = [sys.executable, WORKER, storage, profile, tmp_path / f"{name}.yaml", "--step", str(step), "--lease",
           str(lease), "--heartbeat", "1", "--lock", tmp_path / "measure.lock", "--lock-log", tmp_path / "lock.log",
           "--trials", trials]
    return subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@functools.cache
def _open(storage):
    return open_storage(storage)  # one connection pool per storage: polling must not open one per look


def _trials(storage):
    st = _open(storage)
    out = []
    for s in optuna.get_all_study_summaries(st):
        out += [(s.study_name, t) for t in optuna.load_study(study_name=s.study_name, storage=st).trials]
    return out


def _measured_once(storage, finals=2):
    """Every (study, kind, config) measured exactly once; returns the workers that measured."""
    measured = Counter()
    workers = set()
    for study, t in _trials(storage):
        done = t.state.name == "COMPLETE" or (t.state.name == "FAIL" and "info" in t.user_attrs)
        if done:
            measured[(study, t.user_attrs["kind"], str(sorted(t.user_attrs["config"].items())))] += 1
            workers.add(t.user_attrs["worker"])
    assert measured and max(measured.values()) == 1, [k for k, n in measured.items() if n > 1]
    assert sum(k[1] == "final" for k in measured) == finals  # one final comparison per key (one impl each)
    return measured, workers


def _entries(path):
    return [(e.key, e.impl, e.config, e.measured) for e in load_table(path).entries]


def _no_overlap(log):
    spans = sorted(tuple(map(float, line.split())) for line in Path(log).read_text().splitlines())
    assert all(a_end <= b_start + 1e-3 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_two_workers_share_the_work_and_write_the_same_table(tmp_path, storage):
    a, b = _start(tmp_path, storage, "a"), _start(tmp_path, storage, "b")
    for p in (a, b):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    measured, workers = _measured_once(storage)
    assert len(measured) == CONFIGS + 2 and workers  # every config and both finals, each measured once
    assert _entries(tmp_path / "a.yaml") == _entries(tmp_path / "b.yaml")
    assert len(_entries(tmp_path / "a.yaml")) == 2
    _no_overlap(tmp_path / "lock.log")


def test_a_worker_killed_mid_trial_leaves_its_work_to_the_other(tmp_path, storage):
    slow = _start(tmp_path, storage, "slow", step=0.3, lease=6.0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until the slow worker holds a trial
        if any(t.state.name == "RUNNING" and t.user_attrs.get("worker", "").endswith(f":{slow.pid}")
               for _, t in _trials(storage)):
            break
        time.sleep(0.3)
    else:
        pytest.fail("the slow worker never claimed a trial")
    fast = _start(tmp_path, storage, "fast", lease=6.0)
    slow.send_signal(signal.SIGKILL)
    slow.wait()
    out, err = fast.communicate(timeout=300)
    assert fast.returncode == 0, err
    measured, _ = _measured_once(storage)
    assert len(measured) == CONFIGS + 2
    assert len(_entries(tmp_path / "fast.yaml")) == 2
    killed = [t for _, t in _trials(storage) if t.state.name == "FAIL" and "info" not in t.user_attrs]
    assert killed, "the killed worker's trial was failed and put back"


SOFTMAX = {"version": 2, "sites": [{"op": "softmax", "site": "attn", "attrs": {"dim": -1},
                                    "inputs": [{"shape": [32, 64], "dtype": "float32", "requires_grad": True}]}]}


def _softmax_configs() -> int:
    from nki_autotune.registry import Key, TensorSpec, get_op

    op = get_op("softmax")
    key = Key.of(op, (TensorSpec((32, 64), "float32", requires_grad=True),), {"dim": -1})
    return sum(len(i.configs(key)) for i in op.impls.values() if i.backend == "cpu")


SOFTMAX_CONFIGS = _softmax_configs()


def test_a_worker_killed_holding_the_last_trial_is_taken_over(tmp_path, storage):
    """Nothing else is left to claim: the survivor must hand the dead worker's trial back itself."""
    slow = _start(tmp_path, storage, "slow", step=0.1, lease=5.0, profile_doc=SOFTMAX)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        trials = [t for _, t in _trials(storage)]
        done = [t for t in trials if t.state.name == "COMPLETE" and t.user_attrs.get("kind") == "trial"]
        running = [t for t in trials if t.state.name == "RUNNING"]
        if running and len(done) == SOFTMAX_CONFIGS - 1 and slow.poll() is None:  # it holds the last one
            break
        time.sleep(0.1)
    else:
        pytest.fail("the slow worker never held the last trial")
    slow.send_signal(signal.SIGKILL)
    slow.wait()
    fast = _start(tmp_path, storage, "fast", lease=5.0, profile_doc=SOFTMAX)
    out, err = fast.communicate(timeout=300)
    assert fast.returncode == 0, err
    measured, _ = _measured_once(storage, finals=1)
    assert len(_entries(tmp_path / "fast.yaml")) == 1


def test_on_a_journal_a_trial_is_alive_while_its_worker_waits_and_dead_once_it_stops_stamping(tmp_path):
    """A worker may wait for the machine lock (or compile) longer than the lease: its stamps keep its trial; a
    trial whose stamps stopped (its worker died) is put back after a few missed stamps, whatever the time zone, and
    its copy, which Optuna gives the dead trial's attributes, is not taken for dead by the old stamp."""
    import threading

    from nki_autotune.autotune.search import ALIVE, TRIAL, Search, TrialResult, handlers
    from nki_autotune.registry import Key, TensorSpec, get_op

    search = Search(open_storage(f"journal:///{tmp_path}/studies.log"), {"backend": "cpu"}, trials=2, lease_s=2.0)
    op = get_op("rmsnorm")
    impl = op.impls["cpu_rows"]
    key = Key.of(op, (TensorSpec((32, 64), "float32", requires_grad=True),
                      TensorSpec((64,), "float32", requires_grad=True)), {"eps": 1e-6})
    study = search.study(key, impl)
    seen: list[str] = []

    def watch():  # another worker reading the storage meanwhile: it expires what looks dead
        while not stop.is_set():
            seen.extend(t.state.name for t in search._trials(study))
            time.sleep(0.1)

    def slow(cfg):  # waits over two leases, as for the machine lock
        time.sleep(5.0)
        return TrialResult(cfg, 1.5, {})

    search._enqueue(study, impl, key, {"threads": 1, "rows_per_task": 16}, TRIAL)  # a config the key allows
    stop = threading.Event()
    watcher = threading.Thread(target=watch)
    watcher.start()
    search._claim(study, key, impl, handlers(slow, lambda cfg: {}), lambda r: None)
    stop.set()
    watcher.join()
    (trial,) = study.get_trials()
    assert trial.state.name == "COMPLETE" and "FAIL" not in seen and trial.user_attrs[ALIVE][0] == trial.number

    dead = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, user_attrs={
        "kind": TRIAL, "config": dict(impl.default)})
    study.add_trial(dead)
    number = study.get_trials()[-1].number
    study._storage.set_trial_user_attr(study.get_trials()[-1]._trial_id, ALIVE, [number, time.time() - 100.0])
    states = [t.state.name for t in search._trials(study)]
    assert states.count("FAIL") == 1 and states.count("WAITING") == 1  # failed and its work put back
    copy = study.ask()  # a worker claims the copy, which carries the dead trial's stamp
    assert copy.user_attrs[ALIVE][0] == number != copy.number
    assert [t.state.name for t in search._trials(study)].count("FAIL") == 1  # the copy is not failed for it


def test_an_error_of_the_tuner_itself_while_running_a_trial_is_not_taken_for_a_takeover(tmp_path):
    """Only a trial another worker took over is dropped quietly; anything else the tuner raises propagates."""
    from nki_autotune.autotune.search import Search, handlers
    from nki_autotune.registry import Key, TensorSpec, get_op

    search = Search(open_storage(f"journal:///{tmp_path}/studies.log"), {"backend": "cpu"}, trials=2)
    op = get_op("rmsnorm")
    key = Key.of(op, (TensorSpec((32, 64), "float32"), TensorSpec((64,), "float32")), {"eps": 1e-6})
    study = search.study(key, op.impls["cpu_rows"])

    def broken(cfg):
        raise ValueError("a bug in the bench")

    with pytest.raises(ValueError, match="a bug in the bench"):
        search._claim(study, key, op.impls["cpu_rows"], handlers(broken, lambda cfg: {}), lambda r: None)


THREE = {"version": 2, "sites": [
    {"op": "rmsnorm", "site": f"m.{n}", "attrs": {"eps": 1e-6},
     "inputs": [{"shape": [n, 64], "dtype": "float32", "requires_grad": True},
                {"shape": [64], "dtype": "float32", "requires_grad": True}]} for n in (32, 48, 80)]}


def _states(storage):
    return {(study, t.number): t.state.name for study, t in _trials(storage)}


def _holding(storage, pid) -> bool:
    return any(t.state.name == "RUNNING" and t.user_attrs.get("worker", "").endswith(f":{pid}")
               for _, t in _trials(storage))


def test_a_run_where_every_key_is_decided_adds_nothing_after_a_worker_was_killed(tmp_path, storage):
    """Two workers, the sampler's search (fewer trials than configs), one killed mid-trial, the survivor finishes:
    the storage then holds no trial left waiting or running, and a further run of the profile adds no trial and
    writes the same table."""
    slow = _start(tmp_path, storage, "slow", step=0.3, lease=6.0, profile_doc=THREE, trials=3)
    deadline = time.monotonic() + 120
    while not _holding(storage, slow.pid):
        assert time.monotonic() < deadline, "the slow worker never claimed a trial"
        time.sleep(0.3)
    fast = _start(tmp_path, storage, "fast", lease=6.0, profile_doc=THREE, trials=3)
    slow.send_signal(signal.SIGKILL)
    slow.wait()
    out, err = fast.communicate(timeout=300)
    assert fast.returncode == 0, err
    before = _states(storage)
    assert not [k for k, state in before.items() if state in ("WAITING", "RUNNING")], before
    for run in ("again",):
        again = _start(tmp_path, storage, run, lease=6.0, profile_doc=THREE, trials=3)
        out, err = again.communicate(timeout=300)
        assert again.returncode == 0, err
        assert _states(storage) == before
        assert _entries(tmp_path / f"{run}.yaml") == _entries(tmp_path / "fast.yaml")
