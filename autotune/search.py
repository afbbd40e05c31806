"""The config search (docs/design.md §6.2): one Optuna study per (key, impl), resumable and shared by many workers.

Small spaces are run exhaustively, larger ones by seeded TPE whose first trial (enqueued) is the impl's default
config fitted to the key, where that is a config of the space: the search measures what runs untuned. Every piece
of work is an Optuna trial, claimed through the storage: a worker enqueues a config nobody has claimed
(``enqueue_trial``) and takes the oldest waiting trial (``ask`` inside ``optimize``), so any number of workers on one
storage share the work. Two workers that claim the same config at once both see both trials: the one with the
higher trial number steps back (PRUNED). Optuna's pop of a waiting trial is atomic on PostgreSQL and MySQL (``SELECT
... FOR UPDATE``), not on SQLite, where two workers starting at once can both take one waiting trial: it is then
measured twice, and the slower worker drops its copy.
The final comparison of an impl's best config is a trial too (``kind: final``), measured once and stored.

A worker that dies leaves its claimed trial RUNNING: on RDB storages Optuna's heartbeat fails it and
``RetryFailedTrialCallback`` puts it back; on a journal file, which has no heartbeat of Optuna's, the worker
stamps its trial with its number and the time (``alive_at``, seconds since the epoch: no time zone; machines
sharing a journal need clocks within a minute of each other) while it runs it, waits for the machine lock
included; a trial that misses a few stamps (or, not stamped yet, is older than the lease) is failed and put back
the same way.
A worker whose trial was taken over meanwhile (it stalled past the lease) drops its own result: the copy stands.
A config that fails as data (raises, crashes the worker, times out, fails numerics) is a FAIL trial that records
why: it is never retried.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import optuna
import sqlalchemy
from optuna.storages import JournalStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState

from ..registry import Impl, Key
from ..registry.switches import settings

optuna.logging.set_verbosity(optuna.logging.ERROR)

TRIAL, FINAL = "trial", "final"
HEARTBEAT_S = 10
ALIVE = "alive_at"
WORKER = f"{socket.gethostname()}:{os.getpid()}"
"""Written on every trial this process claims (who measured what, e.g. in optuna-dashboard)."""


def default_storage() -> str:
    """SQLite in the user cache directory: embedded, and resumable after a kill."""
    path = os.path.join(settings().cache_dir, "studies.db")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return f"sqlite:///{path}"


def open_storage(url: str | None, heartbeat_s: int = HEARTBEAT_S) -> Any:
    """An Optuna storage from a URL: any RDB URL (with heartbeats), or ``journal:///path`` for a journal file.
    A URL no installed database driver takes is a ValueError."""
    url = url or default_storage()
    if url.startswith("journal:"):
        path = url.split(":", 1)[1].removeprefix("//")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return JournalStorage(JournalFileBackend(path))
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        os.makedirs(os.path.dirname(os.path.abspath(url.removeprefix("sqlite:///"))), exist_ok=True)
    url = _driver(url)
    try:  # a malformed URL, an unknown database or a missing driver fails here, at once, not after the retries
        sqlalchemy.engine.make_url(url).get_dialect().import_dbapi()
    except Exception as e:
        raise ValueError(f"not a storage URL this machine can open ({type(e).__name__}: {e}); use sqlite:///PATH, "
                         "postgresql://..., mysql://... or journal:///PATH") from None
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    if url == "sqlite:///:memory:":  # one process, one thread: nobody to hand work back to
        return optuna.storages.RDBStorage(url, engine_kwargs=engine)
    for attempt in range(5):  # workers starting together on an empty database race to create its tables
        try:
            with warnings.catch_warnings():  # heartbeats are marked experimental
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(url, engine_kwargs=engine, heartbeat_interval=heartbeat_s,
                                                  grace_period=3 * heartbeat_s, heartbeat_stale_trial_callback=_retry())
        except ImportError:
            raise
        except Exception:
            if attempt == 4:
                raise
            time.sleep(0.5 * (attempt + 1))


def _driver(url: str) -> str:
    """``postgresql://`` with whichever driver is installed: psycopg2 (SQLAlchemy's default), else psycopg 3."""
    if url.startswith("postgresql://"):
        import importlib.util

        for module, dialect in (("psycopg2", "postgresql+psycopg2://"), ("psycopg", "postgresql+psycopg://")):
            if importlib.util.find_spec(module) is not None:
                return dialect + url.removeprefix("postgresql://")
    return url


def _retry() -> RetryHeartbeatStaleTrialCallback:
    """Puts a dead worker's trial back for another (its user attrs, kind and config, come along)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RetryHeartbeatStaleTrialCallback(max_retry=3)


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


@dataclass
class TrialResult:
    config: dict[str, int]
    speedup: float | None
    """Median compiler/kernel ratio; None when the trial failed."""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.speedup is None


class _Failed(Exception):
    """A config that failed as data: its trial is FAIL, with the reason in its user attrs."""


def _config_id(config: dict[str, int]) -> str:
    return json.dumps(config, sort_keys=True)


def _kind(t: FrozenTrial) -> str:
    return t.user_attrs.get("kind", TRIAL)


def _measured(t: FrozenTrial) -> bool:
    """Finished with a result: complete, or failed as data (a worker that died leaves no ``info``)."""
    return t.state == TrialState.COMPLETE or (t.state == TrialState.FAIL and "info" in t.user_attrs)


def _again(t: FrozenTrial) -> bool:
    """A final comparison measured on a disturbed machine, or timed without the peak memory of each side (by an
    earlier version): kept, but measured again by the next run."""
    measured = t.user_attrs.get("info", {}).get("measured", {})
    unpeaked = "speedup" in measured and "kernel_peak_mib" not in measured and "peak_error" not in measured
    return bool((measured.get("calibration") or {}).get("disturbed")) or unpeaked


def _holds(t: FrozenTrial) -> bool:
    """Stands for its config: done (and not to be measured again, for a final), running, or waiting for a worker."""
    return (_measured(t) and not _again(t)) or t.state in (TrialState.RUNNING, TrialState.WAITING)


def _in_space(impl: Impl, key: Key, config: dict[str, int] | None, allowed: list[dict[str, int]]) -> dict | None:
    """``config`` as the search runs it (an inference key's backward params at the default's), where it is one of
    the ``allowed`` configs of the space; else None (a fitted value between the space's, as the fused loss's chunk
    of 245 tokens at a vocabulary of 128256, is not a config the sampler can name)."""
    if config is None:
        return None
    if key.mode == "inference":
        config = {**config, **{p: impl.default[p] for p in impl.backward_params}}
    return config if config in allowed else None


def first_config(impl: Impl, key: Key) -> dict[str, int]:
    """The config a study of ``impl`` at ``key`` runs first: the fitted default where the space has it, else the
    space's first (exhaustive order)."""
    allowed = impl.configs(key)
    return _in_space(impl, key, impl.config_at(key), allowed) or allowed[0]


def handlers(evaluate: Callable[[dict[str, int]], TrialResult],
             measure: Callable[[dict[str, int]], dict[str, Any]]) -> dict[str, Callable[[dict[str, int]], TrialResult]]:
    """How each kind of claimed work is done: a config trial, and a final comparison (stored as measured)."""
    def final(cfg: dict[str, int]) -> TrialResult:
        m = measure(cfg)
        return TrialResult(cfg, m.get("speedup"), {"measured": m, **({"error": m["error"]} if "error" in m else {})})

    return {TRIAL: evaluate, FINAL: final}


class Search:
    def __init__(self, storage: Any, fingerprint: dict[str, Any], trials: int = 16, seed: int = 0,
                 lease_s: float = 3600.0):
        self.storage, self.trials, self.seed = storage, trials, seed
        self.fp = digest(fingerprint)
        self.lease_s = lease_s
        """Storages without heartbeats: a trial RUNNING longer than this belongs to a dead worker."""
        self.stamp_s = min(HEARTBEAT_S, lease_s / 4)
        """How often a worker stamps the trial it runs (storages without heartbeats)."""
        self.began = datetime.now()
        """When this run began (Optuna's local time): a final comparison completed since, by any worker, is this
        run's, so concurrent workers take the same one rather than each measuring a disturbed one again."""

    # -- the machine's quiet calibration reference (calibration.py) -------------------------------------------
    def _reference_study(self) -> optuna.Study:
        return optuna.create_study(study_name=f"calibration:fp-{self.fp}", storage=self.storage, load_if_exists=True)

    def calibration_reference(self) -> float | None:
        """The calibration region's time (us) on this machine when quiet, stored by an earlier run (or None)."""
        value = self._reference_study().user_attrs.get("typical_us")  # (a typical reading: older runs kept a fastest)
        return float(value) if isinstance(value, (int, float)) else None

    def offer_calibration(self, us: float, reference: float | None) -> float | None:
        """Store ``us``, a run's typical quiet reading, as the reference where there is none or it is clearly faster
        (``calibration.REFRESH``); returns the reference in force."""
        from .calibration import REFRESH

        if reference is not None and us * REFRESH >= reference:
            return reference
        study = self._reference_study()
        study.set_user_attr("typical_us", round(us, 1))
        study.set_user_attr("taken_at", datetime.now().isoformat(timespec="seconds"))
        return us

    def study_name(self, key: Key, impl: Impl) -> str:
        return f"{key.op}:{digest(key)}:{impl.name}:src-{impl.source_hash}:fp-{self.fp}"

    def study(self, key: Key, impl: Impl) -> optuna.Study:
        name = self.study_name(key, impl)
        seed = int(digest([self.seed, name]), 16) % (2**31)
        study = optuna.create_study(study_name=name, storage=self.storage, direction="maximize",
                                    sampler=optuna.samplers.TPESampler(seed=seed), load_if_exists=True)
        if "key" not in study.user_attrs:
            study.set_user_attr("key", key.label())
        return study

    # -- reading the storage ---------------------------------------------------------------------------------
    def _trials(self, study: optuna.Study) -> list[FrozenTrial]:
        """The study's trials, after handing back those of dead workers (by heartbeat, or past the lease)."""
        if isinstance(self.storage, optuna.storages.RDBStorage):
            if self.storage.get_heartbeat_interval() is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    optuna.storages.fail_stale_trials(study)
            return study.get_trials(deepcopy=False)
        self._expire(study, study.get_trials(deepcopy=False))
        return study.get_trials(deepcopy=False)

    def _expire(self, study: optuna.Study, trials: list[FrozenTrial]) -> None:
        """No heartbeat of Optuna's here: fail trials whose worker has not stamped them for longer than the lease
        (or, not stamped yet, started longer ago) and put their work back, as the heartbeat would."""
        now, local_now = time.time(), datetime.now()
        for t in trials:
            if t.state != TrialState.RUNNING:
                continue
            stamp = t.user_attrs.get(ALIVE)
            if isinstance(stamp, list) and stamp[:1] == [t.number]:  # stamped: dead after missing a few stamps
                dead = now - stamp[1] > min(self.lease_s, 6 * self.stamp_s)
            else:
                dead = t.datetime_start is not None and local_now - t.datetime_start > timedelta(seconds=self.lease_s)
            if dead:
                try:
                    self.storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
                except Exception:  # another worker expired it first
                    continue
                _retry()(study, t)

    @staticmethod
    def finished(trials: list[FrozenTrial], kind: str = TRIAL) -> list[TrialResult]:
        """Results of every config measured, once each (the lowest trial number stands for its config)."""
        out: dict[str, TrialResult] = {}
        for t in sorted(trials, key=lambda t: t.number):
            cfg = t.user_attrs.get("config")
            if cfg is None or _kind(t) != kind or not _measured(t) or _config_id(cfg) in out:
                continue
            value = t.value if t.state == TrialState.COMPLETE else None
            out[_config_id(cfg)] = TrialResult(dict(cfg), value, dict(t.user_attrs.get("info", {})))
        return list(out.values())

    def settled(self, key: Key, impl: Impl) -> bool:
        """Whether the study of ``impl`` at ``key`` already holds what a run needs of it: a final comparison not to
        be measured again, or as many trials as the run asks for, every one failed (nothing to compare)."""
        trials = self.study(key, impl).get_trials(deepcopy=False)
        if any(_kind(t) == FINAL and _measured(t) and not _again(t) for t in trials):
            return True
        done = self.finished(trials)
        return len(done) >= min(self.trials, len(impl.configs(key))) and all(r.failed for r in done)

    # -- claiming and running work ---------------------------------------------------------------------------
    def _claim(self, study: optuna.Study, key: Key, impl: Impl, handlers: dict[str, Callable[[dict], TrialResult]],
               on_trial: Callable[[TrialResult], None]) -> None:
        """Take one trial from the storage (the oldest waiting, else a new one from the sampler) and run it."""
        fixed = {p: impl.default[p] for p in impl.backward_params} if key.mode == "inference" else {}
        free = {p: tuple(v) for p, v in impl.space.items() if p not in fixed}

        taken: list[bool] = []
        claimed: list[int] = []
        own: list[bool] = []  # the objective itself raised: a bug of the bench or the tuner, never dropped

        def objective(trial: optuna.Trial) -> float:
            claimed.append(trial._trial_id)
            try:
                with self._stamping(trial._trial_id, trial.number):
                    kind = trial.user_attrs.get("kind", TRIAL)
                    values = {p: trial.suggest_categorical(p, list(v)) for p, v in free.items()}
                    cfg = {p: fixed.get(p, values.get(p)) for p in impl.space}
                    trial.set_user_attr("kind", kind)
                    trial.set_user_attr("config", cfg)
                    trial.set_user_attr("worker", WORKER)
                    if kind not in handlers or not impl.allows(cfg, key) or \
                            self._taken(study, trial.number, kind, cfg):
                        raise optuna.TrialPruned()
                    res = handlers[kind](cfg)
                trial.set_user_attr("info", res.info)
            except optuna.exceptions.UpdateFinishedTrialError:
                taken.append(True)  # another worker failed it past the lease and put its work back
                raise
            except optuna.TrialPruned:
                raise
            except Exception:
                own.append(True)
                raise
            on_trial(res)
            if res.failed:
                raise _Failed(res.info.get("error", "failed"))
            return res.speedup

        try:
            study.optimize(objective, n_trials=1, catch=(_Failed,))
        except (ValueError, optuna.exceptions.UpdateFinishedTrialError):
            # Optuna refuses to tell a trial another worker finished: one taken over past the lease, or one two
            # workers took at once from SQLite's waiting trials (no atomic pop there). That copy stands, not this.
            if own or not (taken or (claimed and study._storage.get_trial(claimed[-1]).state.is_finished())):
                raise

    @contextlib.contextmanager
    def _stamping(self, trial_id: int, number: int) -> Iterator[None]:
        """While the block runs, stamp the trial with (its number, the time) every few seconds, on storages
        without heartbeats: a worker waiting for the machine lock, or compiling, is alive however long it takes.
        A stamp names its trial's number because Optuna copies a failed trial's attributes into its retry."""
        if isinstance(self.storage, optuna.storages.RDBStorage):
            yield
            return
        done = threading.Event()

        def stamp() -> None:
            while True:
                try:
                    self.storage.set_trial_user_attr(trial_id, ALIVE, [number, time.time()])
                except optuna.exceptions.UpdateFinishedTrialError:
                    return  # taken over: the worker finds out when it reports
                except Exception:  # a storage hiccup (a network file system): the next stamp may get through
                    pass
                if done.wait(self.stamp_s):
                    return

        beat = threading.Thread(target=stamp, name=f"nki-autotune-alive-{trial_id}", daemon=True)
        beat.start()
        try:
            yield
        finally:
            done.set()
            beat.join()

    @staticmethod
    def _taken(study: optuna.Study, number: int, kind: str, cfg: dict[str, int]) -> bool:
        """Whether an earlier trial already stands for this (kind, config): then this one steps back.

        Called after this trial's own config is written. An earlier trial just drawn from the sampler may not
        have written its config yet: wait for it, else two workers could each pass the other by."""
        cid = _config_id(cfg)
        for _ in range(400):
            earlier = [t for t in study.get_trials(deepcopy=False) if t.number < number and _kind(t) == kind]
            if not any(t.state == TrialState.RUNNING and "config" not in t.user_attrs for t in earlier):
                break
            time.sleep(0.05)
        return any(_config_id(t.user_attrs.get("config") or {}) == cid and _holds(t) for t in earlier)

    def _enqueue(self, study: optuna.Study, impl: Impl, key: Key, cfg: dict[str, int], kind: str) -> None:
        fixed = set(impl.backward_params) if key.mode == "inference" else set()
        study.enqueue_trial({p: v for p, v in cfg.items() if p not in fixed}, user_attrs={"kind": kind, "config": cfg})

    def run(self, key: Key, impl: Impl, work: dict[str, Callable[[dict[str, int]], TrialResult]],
            stop: Callable[[], bool] = lambda: False,
            on_trial: Callable[[TrialResult], None] = lambda r: None) -> tuple[list[TrialResult], bool]:
        """Claim and run the trials this study still needs while any are unclaimed (``work``: ``handlers``; a
        waiting final comparison another worker enqueued may be claimed on the way).

        Returns every finished trial (this worker's and others') and whether the search is complete: false
        while other workers still run some of its trials (come back later) or when ``stop`` ended it."""
        study = self.study(key, impl)
        allowed = impl.configs(key)
        exhaustive = len(allowed) <= self.trials
        default = _in_space(impl, key, impl.config_at(key), allowed)
        attempts = 0
        while not stop() and attempts < 20 * self.trials:
            trials = self._trials(study)
            done = self.finished(trials)
            mine = [t for t in trials if _kind(t) == TRIAL]
            held = {_config_id(t.user_attrs["config"]) for t in mine if _holds(t) and "config" in t.user_attrs}
            waiting = any(t.state == TrialState.WAITING for t in trials)
            running = any(t.state == TrialState.RUNNING for t in mine)
            if exhaustive:
                missing = [c for c in allowed if _config_id(c) not in held]
                if not missing and not waiting:
                    return done, not running
                if missing and not waiting:
                    self._enqueue(study, impl, key, missing[0], TRIAL)
            elif not trials and default is not None:  # the sampler's search starts from what runs untuned
                self._enqueue(study, impl, key, default, TRIAL)
            elif len(done) + sum(t.state == TrialState.RUNNING for t in mine) >= self.trials and not waiting:
                return done, not running
            attempts += 1
            self._claim(study, key, impl, work, on_trial)
        trials = self._trials(study)
        return self.finished(trials), not stop() and not any(
            t.state == TrialState.RUNNING and _kind(t) == TRIAL for t in trials)

    def final(self, key: Key, impl: Impl, config: dict[str, int],
              work: dict[str, Callable[[dict[str, int]], TrialResult]],
              stop: Callable[[], bool] = lambda: False) -> dict[str, Any] | None:
        """The stored final comparison of ``config``, measured here if no worker has; None while another
        worker is measuring it (or when ``stop`` ended the wait with none stored). One measured on a disturbed
        machine, or without peak memory, is measured again, once per run: its result stands only if it was
        measured during this run (here or by a concurrent worker), or if ``stop`` leaves no time to measure it
        again."""
        study = self.study(key, impl)
        cid = _config_id(config)
        here: list[bool] = []  # measured by this worker: this run's, whatever the clocks say
        measure = work[FINAL]

        def measured_here(cfg: dict[str, int]) -> TrialResult:
            here.append(True)
            return measure(cfg)

        for _ in range(20):
            trials = self._trials(study)
            mine = sorted((t for t in trials if _kind(t) == FINAL and _config_id(t.user_attrs.get("config") or {})
                           == cid), key=lambda t: t.number)
            done = [t for t in mine if _measured(t)]
            quiet = [t for t in done if not _again(t)]
            recent = any(t.datetime_complete is not None and t.datetime_complete >= self.began for t in done)
            if quiet or (done and (here or recent or stop())):
                return dict((quiet or done)[-1 if not quiet else 0].user_attrs["info"]["measured"])
            if stop():
                return None
            waiting = any(t.state == TrialState.WAITING for t in trials)
            if any(t.state == TrialState.RUNNING for t in mine) and not waiting:
                return None
            if not any(t.state == TrialState.WAITING for t in mine):
                self._enqueue(study, impl, key, config, FINAL)
            self._claim(study, key, impl, {**work, FINAL: measured_here}, lambda r: None)
        return None
