"""Recording a profile of a real run: every call of a pack op, by call site.

A site is labelled by the innermost ``nn.Module`` running (its qualified name in the
outermost one), else by the file:line that called the op's function (the first frame outside
nki_autotune and outside the module defining the op's reference, where a wrapper like docs/adding-an-op.md's
``axpy`` lives). A step is one call of the outermost module, or one ``Recorder.step()`` where the
program marks them; a program that runs no module and marks no steps takes the fewest calls of any
site (all its shapes together) as its number of steps. While recording, ``torch.compile``
regions run eagerly (``set_stance("force_eager")``) so that every call is seen
with its module; shapes, dtypes, layouts and call counts are those of the compiled run.
Each call's inputs are recorded through ``callkey.key_of_call``, the rule dispatch uses.

Under ``torchrun`` (``RANK`` set) each rank writes its own profile, ``<name>.rank<N>.yaml``;
``nki-autotune record`` merges the profiles it is given.
"""

from __future__ import annotations

import atexit
import os
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .callkey import key_of_call
from .env import RECORD, SettingsError
from .op import Op, get_op
from .profile import Profile, Site
from .switches import settings
from .yamlio import unwritable

_active: Recorder | None = None


def active() -> Recorder | None:
    """The recorder running in this process, if any (dispatch reports every eager call to it)."""
    return _active


class Recorder:
    def __init__(self, path: str | os.PathLike, samples: bool = False):
        self.path = Path(path)
        self.samples = samples
        self.counts: Counter[tuple] = Counter()
        self.captured: dict[tuple, dict[str, torch.Tensor]] = {}
        self.summaries: dict[tuple, dict[str, float]] = {}
        self.explicit_steps = 0
        self.root_calls: Counter[int] = Counter()
        self._stack: list[torch.nn.Module] = []
        self._names: dict[int, str] = {}
        self._hooks: list[Any] = []

    # -- module stack -------------------------------------------------------------------------------------
    def _pre(self, module, args):
        if not self._stack:
            self.root_calls[id(module)] += 1
            if id(module) not in self._names:
                root = type(getattr(module, "_orig_mod", module)).__name__
                self._names.update({id(m): (n.replace("_orig_mod.", "").removeprefix("_orig_mod") or root)
                                    for n, m in module.named_modules()})
        self._stack.append(module)

    def _post(self, module, args, output):
        while self._stack:
            if self._stack.pop() is module:
                break

    def start(self) -> None:
        global _active
        from torch.nn.modules import module as m

        # always_call: a forward that raises (gradient checkpointing stops its recomputation so) leaves the stack
        self._hooks = [m.register_module_forward_pre_hook(self._pre),
                       m.register_module_forward_hook(self._post, always_call=True)]
        # torch warns that global hooks also fire for the torch.compile wrapper; the stack above allows for it.
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        self._stance = torch.compiler.set_stance("force_eager")
        self._stance.__enter__()
        _active = self

    def stop(self) -> None:
        global _active
        if _active is self:
            _active = None
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if getattr(self, "_stance", None) is not None:
            self._stance.__exit__(None, None, None)
            self._stance = None

    # -- calls --------------------------------------------------------------------------------------------
    def step(self) -> None:
        """Mark the end of one training step (otherwise steps are counted as calls of the outermost module)."""
        self.explicit_steps += 1

    def _site(self, op: Op) -> str:
        if self._stack:
            return self._names.get(id(self._stack[-1]), type(self._stack[-1]).__name__)
        frame = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__", "").startswith("nki_autotune."):
            frame = frame.f_back
        home, outside = getattr(op.reference, "__module__", None), frame
        while home != "__main__" and outside is not None and outside.f_globals.get("__name__") == home:
            outside = outside.f_back
        frame = outside or frame
        if frame is None:
            return "unknown"
        return f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno}"

    def log(self, op: Op, tensors: tuple, raw: tuple, attrs: tuple, grad_enabled: bool) -> None:
        key = key_of_call(op, raw, op.attr_dict(attrs), grad_enabled)
        k = (op.name, self._site(op), key.inputs, attrs)
        self.counts[k] += 1
        if op.summary is not None and k not in self.summaries:
            self.summaries[k] = op.summary(dict(zip(op.tensors, tensors)), op.attr_dict(attrs))
        if self.samples and op.data_dependent and k not in self.captured:
            self.captured[k] = {n: t.detach().cpu().clone() for n, t in zip(op.tensors, tensors) if t is not None}

    # -- output -------------------------------------------------------------------------------------------
    def profile(self) -> Profile:
        per_site = Counter()
        for (name, label, _, _), n in self.counts.items():
            per_site[name, label] += n
        steps = self.explicit_steps or max(self.root_calls.values(), default=0) or min(per_site.values(), default=1)
        sites, sample_dir = [], self.path.parent / (self.path.stem + ".samples")
        for i, ((name, label, specs, attrs), n) in enumerate(self.counts.items()):
            site = Site(name, specs, get_op(name).attr_dict(attrs), label, max(1, round(n / steps)),
                        summary=self.summaries.get((name, label, specs, attrs)))
            if (name, label, specs, attrs) in self.captured:
                sample_dir.mkdir(parents=True, exist_ok=True)
                rel = f"{sample_dir.name}/{i:04d}.pt"
                torch.save(self.captured[(name, label, specs, attrs)], self.path.parent / rel)
                site.samples = rel
            sites.append(site)
        return Profile(sites)

    def write(self) -> Profile:
        profile = self.profile()
        profile.save(self.path)
        return profile


def rank_path(path: str | os.PathLike, env: dict[str, str] | None = None) -> Path:
    """Where this process writes its profile: ``path``, or under ``torchrun`` one file per rank beside it."""
    env = os.environ if env is None else env
    path = Path(path)
    rank = env.get("RANK", env.get("LOCAL_RANK"))
    if rank is None or env.get("WORLD_SIZE", "2") == "1":
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


@contextmanager
def record(path: str | os.PathLike, samples: bool = False) -> Iterator[Recorder]:
    """Record every pack call in the block; the profile is written to ``path`` when it ends."""
    rec = Recorder(path, samples)
    rec.start()
    try:
        yield rec
    finally:
        rec.stop()
        rec.write()


def autostart() -> Recorder | None:
    """Honour ``NKI_AUTOTUNE_RECORD``: record the whole process, write the profile at exit (one per rank).

    Only a process that made a pack call writes, and only the one that started recording: every process that
    imports the pack with the variable set records (a CLI command, a spawned worker, the parent of spawned
    ranks), and one that made no call must not replace the profile another wrote."""
    s = settings()
    if not s.record or _active is not None:
        return None
    path = rank_path(s.record)
    why = unwritable(path)
    if why is not None:  # found now, not after the whole run, when the profile could not be written
        raise SettingsError(f"{RECORD}={s.record!r}: {path} {why}")
    rec = Recorder(path, samples=s.record_samples)
    rec.start()
    pid = os.getpid()

    def finish() -> None:
        rec.stop()
        if os.getpid() != pid:  # a forked child: the process that started recording writes
            return
        if not rec.counts:
            print(f"nki-autotune: NKI_AUTOTUNE_RECORD={s.record}: process {pid} made no call of a pack op; "
                  f"{rec.path} is left as it was", file=sys.stderr)
            return
        rec.write()

    atexit.register(finish)
    return rec
