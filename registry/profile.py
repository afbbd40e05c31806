"""Profiles (docs/design.md §5.1): the call sites of a real run, which the autotuner turns into keys.

Version 2 records each input's layout (``strides``, only where not contiguous) and, as ``requires_grad``,
whether the call needed that input's gradient (false under ``torch.no_grad()``). Version 1 files still load:
their inputs are taken as contiguous. An optional tensor the call left out is ``null`` in ``inputs``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import yamlio
from .specs import DTYPES, INFERENCE, TRAINING, Key, TensorSpec, none_refused
from .yamlio import Fields, Flow, FlowDict, FormatError

if TYPE_CHECKING:
    from .op import Op

VERSION = 2
READS = (1, 2)
_SITE = ("op", "site", "inputs", "attrs", "calls", "samples", "summary")
_INPUT = ("shape", "dtype", "requires_grad", "strides")


class ProfileError(FormatError):
    """A profile is malformed; the message names the file, site and field."""


@dataclass
class Site:
    op: str
    inputs: tuple[TensorSpec | None, ...]
    attrs: dict[str, Any]
    site: str | None = None
    calls: int = 1
    samples: str | None = None
    """Captured real inputs (a torch.save'd dict of tensors), relative to the profile."""
    summary: dict[str, float] | None = None
    """What ``Op.summary`` made of the first call's data-dependent inputs (recorded with or without samples)."""

    def label(self) -> str:
        return self.site or self.op

    def to_yaml(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op}
        if self.site:
            out["site"] = self.site
        out["inputs"] = [None if s is None else
                         FlowDict(shape=Flow(s.shape), dtype=s.dtype, requires_grad=s.requires_grad,
                                  **({"strides": Flow(s.strides)} if s.strides is not None else {}))
                         for s in self.inputs]
        out["attrs"] = FlowDict(self.attrs)
        out["calls"] = self.calls
        if self.samples:
            out["samples"] = self.samples
        if self.summary:
            out["summary"] = FlowDict(self.summary)
        return out


@dataclass
class Profile:
    sites: list[Site] = field(default_factory=list)
    path: str | None = None

    def to_yaml(self) -> str:
        return yamlio.dump({"version": VERSION, "sites": [s.to_yaml() for s in self.sites]})

    def save(self, path: str | os.PathLike) -> None:
        yamlio.atomic_write_text(path, self.to_yaml())
        self.path = str(path)

    def samples_path(self, site: Site) -> Path | None:
        if not site.samples:
            return None
        base = Path(self.path).parent if self.path else Path.cwd()
        return base / site.samples

    def keys(self, ops: Mapping[str, Op], mode: str | None = None) -> dict[Key, list[Site]]:
        """Unique keys in first-seen order, each with the sites that share it.

        Each site's key is ``Key.of`` its recorded inputs (the rule dispatch applies to live calls); ``mode``
        ("training", "inference" or "both") overrides the recorded mode.
        """
        out: dict[Key, list[Site]] = {}
        for s in self.sites:
            for m in [TRAINING, INFERENCE] if mode == "both" else [mode]:
                key = Key.of(ops[s.op], s.inputs, s.attrs, m)
                sites = out.setdefault(key, [])
                if not any(x is s for x in sites):  # "both" on an op with no gradient: one key
                    sites.append(s)
        return out


def merge(profiles: list[Profile], into: str | os.PathLike) -> Profile:
    """One profile, to be saved at ``into``, of several (e.g. the ranks of one ``torchrun``): a site recorded
    alike in several keeps one entry with the most calls per step any of them saw (ranks run the same steps:
    calls are not summed). Sample files stay where they are, referred to from ``into``'s folder."""
    base = Path(into).resolve().parent
    out: dict[tuple, Site] = {}
    for p in profiles:
        for s in p.sites:
            k = (s.op, s.site, s.inputs, tuple(sorted(s.attrs.items())))
            if k not in out:
                path = p.samples_path(s)
                samples = os.path.relpath(path.resolve(), base) if path is not None else None
                out[k] = Site(s.op, s.inputs, dict(s.attrs), s.site, s.calls, samples, s.summary)
            else:
                out[k].calls = max(out[k].calls, s.calls)
    return Profile(list(out.values()))


def _fail(e: FormatError) -> ProfileError:
    return ProfileError(str(e))


def parse_profile(data: Any, path: str, ops: Mapping[str, Op]) -> Profile:
    if isinstance(data, dict) and "entries" in data and "sites" not in data:
        raise ProfileError(f"{path}: a dispatch table (it has 'entries'), not a profile: give the profile that "
                           "nki-autotune record wrote")
    try:
        top = Fields(data, path)
        top.unknown(("version", "sites"))
        version = top.get("version", int)
        if version not in READS:
            raise top.fail("version", f"unsupported version {version}; this nki-autotune reads versions "
                                      f"{', '.join(map(str, READS))}")
        sites = [_parse_site(raw, path, i, ops) for i, raw in enumerate(top.get("sites", list))]
    except ProfileError:
        raise
    except FormatError as e:
        raise _fail(e) from None
    return Profile(sites, path)


def _parse_site(raw: Any, path: str, i: int, ops: Mapping[str, Op]) -> Site:
    f = Fields(raw, f"{path}: sites[{i}]")
    name = f.get("op", str)
    label = f.get("site", str, default=None)
    f.where = f"{path}: sites[{i}] ({label or name})"
    if name not in ops:
        raise f.fail("op", f"unknown op {name!r}; known ops: {', '.join(sorted(ops)) or 'none'}")
    op = ops[name]
    f.unknown(_SITE)
    raw_inputs = f.get("inputs", list)
    if len(raw_inputs) != len(op.tensors):
        raise f.fail("inputs", f"{name} takes {len(op.tensors)} tensors ({', '.join(op.tensors)}), "
                               f"got {len(raw_inputs)}")
    specs = []
    for j, item in enumerate(raw_inputs):
        if item is None:
            why = none_refused(op, j)
            if why is not None:
                raise f.fail(f"inputs[{j}]", why)
            specs.append(None)
            continue
        g = Fields(item, f"{f.where}: field 'inputs[{j}]'")
        g.unknown(_INPUT)
        shape = g.shape(g.get("shape", list), "shape")
        strides = g.get("strides", list, default=None)
        if strides is not None and (len(strides) != len(shape) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in strides)):
            raise g.fail("strides", f"expected {len(shape)} integers (one per dim), got {strides!r}")
        specs.append(TensorSpec(
            shape=shape,
            dtype=g.dtype(g.get("dtype", str), "dtype", DTYPES),
            strides=None if strides is None else tuple(strides),
            requires_grad=g.get("requires_grad", bool, default=False),
        ))
    attrs = f.attrs("attrs", dict(op.attrs), dict(op.defaults))
    calls = f.get("calls", int, default=1)
    if calls < 1:
        raise f.fail("calls", f"must be at least 1, got {calls}")
    samples = f.get("samples", str, default=None)
    if samples is not None and not (Path(path).parent / samples).is_file():
        raise f.fail("samples", f"no such file {samples!r} beside the profile")
    summary = f.get("summary", dict, default=None)
    if summary is not None:
        bad = [k for k, v in summary.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
        if bad:
            raise f.fail(f"summary.{bad[0]}", f"expected a number, got {summary[bad[0]]!r}")
    return Site(name, tuple(specs), attrs, label, calls, samples, summary)


def load_profile(path: str | os.PathLike, ops: Mapping[str, Op]) -> Profile:
    try:
        data = yamlio.load(path, "profile")
    except FormatError as e:
        raise _fail(e) from None
    return parse_profile(data, str(path), ops)


__all__ = ["Profile", "ProfileError", "Site", "load_profile", "merge", "parse_profile"]
