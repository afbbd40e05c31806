"""The config search (DESIGN §6.2): one Optuna study per (key, impl), resumable, shareable.

Small spaces are run exhaustively; larger ones by seeded TPE. A config that breaks
the impl's constraint is pruned before it runs; one that raises, times out or
fails numerics is a failed trial with its reason, and the search goes on.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState, create_trial

from ..registry import Impl, Key, settings

optuna.logging.set_verbosity(optuna.logging.WARNING)


def default_storage() -> str:
    """SQLite in the user cache directory: embedded, and resumable after a kill."""
    path = os.path.join(settings().cache_dir, "studies.db")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return f"sqlite:///{path}"


def open_storage(url: str | None) -> Any:
    """An Optuna storage from a URL: any RDB URL, or ``journal:///path`` for a journal file."""
    url = url or default_storage()
    if url.startswith("journal:"):
        path = url.split(":", 1)[1].removeprefix("//")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return JournalStorage(JournalFileBackend(path))
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        os.makedirs(os.path.dirname(os.path.abspath(url.removeprefix("sqlite:///"))), exist_ok=True)
    return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}}
                                      if url.startswith("sqlite") else {})


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


@dataclass
class TrialResult:
    config: dict[str, int]
    speedup: float | None
    """Median per-round compiler/kernel ratio; None when the trial failed."""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.speedup is None


def _config_id(config: dict[str, int]) -> str:
    return json.dumps(config, sort_keys=True)


class Search:
    def __init__(self, storage: Any, fingerprint: dict[str, Any], trials: int = 16, seed: int = 0):
        self.storage, self.trials, self.seed = storage, trials, seed
        self.fp = digest(fingerprint)

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

    @staticmethod
    def finished(study: optuna.Study) -> list[TrialResult]:
        out = []
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
            cfg = t.user_attrs.get("config")
            if cfg is None:
                continue
            out.append(TrialResult(dict(cfg), t.value if t.state == TrialState.COMPLETE else None,
                                   dict(t.user_attrs.get("info", {}))))
        return out

    def run(self, key: Key, impl: Impl, evaluate: Callable[[dict[str, int]], TrialResult],
            stop: Callable[[], bool] = lambda: False,
            on_trial: Callable[[TrialResult], None] = lambda r: None) -> list[TrialResult]:
        """Run the trials the study still lacks; returns every finished trial (old and new)."""
        study = self.study(key, impl)
        done = self.finished(study)
        allowed = impl.configs(key)
        fixed = {p: impl.default[p] for p in impl.backward_params} if key.mode == "inference" else {}
        free = {p: tuple(v) for p, v in impl.space.items() if p not in fixed}
        dists = {p: CategoricalDistribution(v) for p, v in free.items()}

        def record(trial_params: dict, res: TrialResult) -> None:
            attrs = {"config": res.config, "info": res.info}
            if res.failed:
                study.add_trial(create_trial(params=trial_params, distributions=dists, state=TrialState.FAIL,
                                             user_attrs=attrs))
            else:
                study.add_trial(create_trial(params=trial_params, distributions=dists, value=res.speedup,
                                             user_attrs=attrs))
            done.append(res)
            on_trial(res)

        if len(allowed) <= self.trials:  # exhaustive
            seen = {_config_id(r.config) for r in done}
            for cfg in allowed:
                if stop():
                    break
                if _config_id(cfg) not in seen:
                    record({p: cfg[p] for p in free}, evaluate(cfg))
            return done

        attempts = 0
        while sum(1 for _ in done) < self.trials and attempts < 20 * self.trials and not stop():
            attempts += 1
            trial = study.ask()
            cfg = {p: trial.suggest_categorical(p, list(v)) for p, v in free.items()}
            cfg = {p: (fixed[p] if p in fixed else cfg[p]) for p in impl.space}
            if not impl.allows(cfg, key) or _config_id(cfg) in {_config_id(r.config) for r in done}:
                study.tell(trial, state=TrialState.PRUNED)
                continue
            res = evaluate(cfg)
            trial.set_user_attr("config", res.config)
            trial.set_user_attr("info", res.info)
            if res.failed:
                study.tell(trial, state=TrialState.FAIL)
            else:
                study.tell(trial, res.speedup)
            done.append(res)
            on_trial(res)
        return done

    def final(self, key: Key, impl: Impl) -> dict[str, Any] | None:
        """The stored final measurement of this (key, impl), if a run completed it."""
        return self.study(key, impl).user_attrs.get("final")

    def save_final(self, key: Key, impl: Impl, final: dict[str, Any]) -> None:
        self.study(key, impl).set_user_attr("final", final)
