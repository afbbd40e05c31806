"""The interpreter's run state: the target's limits, the launch, and on-chip memory in use."""

from __future__ import annotations

import math
import os
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np


class NkiError(Exception):
    """A kernel broke an NKI rule or a hardware limit; the message names the call."""


@dataclass(frozen=True)
class Target:
    name: str
    gen: int
    sbuf_partition_bytes: int
    psum_partition_bytes: int = 16 * 1024
    psum_bank_bytes: int = 2 * 1024
    partitions: int = 128
    matmul_k: int = 128
    matmul_m: int = 128
    matmul_n_fp32: int = 512
    matmul_n_bf16: int = 512


# Usable SBUF bytes per partition (the tile_size.sbuf_fmax_bytes of each target).
TARGETS = {
    "trn1": Target("trn1", 2, 192 * 1024),
    "trn2": Target("trn2", 3, 208 * 1024),
    "trn3": Target("trn3", 4, 240 * 1024, matmul_n_fp32=4096, matmul_n_bf16=8192),
}
ALIASES = {"inf2": "trn1", "gen2": "trn1", "gen3": "trn2", "gen4": "trn3"}


def target_from_env() -> Target:
    """The simulator's target: NEURON_PLATFORM_TARGET_OVERRIDE (trn1|trn2|trn3 or gen2..4), unset -> trn3.

    This is the Neuron tools' own variable, read where the real simulator reads it: at each launch.
    """
    raw = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "").strip().lower()
    if not raw:
        return TARGETS["trn3"]
    name = ALIASES.get(raw, raw)
    if name not in TARGETS:
        raise NkiError(f"NEURON_PLATFORM_TARGET_OVERRIDE={raw!r} is not a target; use trn1, trn2, trn3 "
                       "(or gen2, gen3, gen4)")
    return TARGETS[name]


def limits_target() -> Target:
    """The limits kernels must respect: the named target, else trn2's (which hold on trn2 and trn3)."""
    named = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "").strip()
    return target_from_env() if named else TARGETS["trn2"]


@dataclass
class Run:
    """One kernel launch (one program of it)."""

    target: Target
    lnc: int = 1
    program_id: int = 0
    used: dict = field(default_factory=lambda: {"sbuf": 0, "psum": 0})
    act_acc: np.ndarray = field(default_factory=lambda: np.zeros(128, np.float32))
    shared: list = field(default_factory=list)
    shared_next: int = 0

    def allocate(self, shape: tuple[int, ...], itemsize: int, buffer: str, name: str) -> None:
        t = self.target
        what = f"nl.ndarray({name + ', ' if name else ''}shape={list(shape)}, buffer=nl.{buffer})"
        if shape[0] > t.partitions:
            raise NkiError(f"{what}: partition dimension {shape[0]} exceeds maximum {t.partitions}")
        nbytes = self.footprint(shape, itemsize, buffer)
        cap = t.sbuf_partition_bytes if buffer == "sbuf" else t.psum_partition_bytes
        if nbytes > cap:
            raise NkiError(f"{what}: {nbytes} bytes per partition exceed the {buffer.upper()} capacity of "
                           f"{cap} bytes per partition on {t.name}")
        if self.used[buffer] + nbytes > cap:
            raise NkiError(f"{what}: {buffer.upper()} full on {t.name}: {self.used[buffer]} bytes per partition "
                           f"live, {nbytes} more requested, capacity {cap}")

    def shared_alloc(self, make):
        """Shared HBM is one tensor for every program of an LNC launch: the k-th allocation of each program."""
        if self.program_id == 0:
            t = make()
            self.shared.append(t)
            return t
        if self.shared_next >= len(self.shared):
            raise NkiError("program 1 allocated more shared_hbm tensors than program 0: all programs of an LNC "
                           "launch must run the same control flow")
        t = self.shared[self.shared_next]
        self.shared_next += 1
        return t

    def footprint(self, shape, itemsize: int, buffer: str) -> int:
        nbytes = math.prod(shape[1:]) * itemsize
        if buffer == "psum":  # PSUM tensors start on a bank boundary and take whole banks
            bank = self.target.psum_bank_bytes
            nbytes = -(-nbytes // bank) * bank
        return nbytes

    def track(self, storage, shape, itemsize: int) -> None:
        nbytes = self.footprint(shape, itemsize, storage.buffer)
        self.used[storage.buffer] += nbytes
        weakref.finalize(storage, self._release, storage.buffer, nbytes)

    def _release(self, buffer: str, nbytes: int) -> None:
        self.used[buffer] -= nbytes


_local = threading.local()


def current() -> Run:
    run = getattr(_local, "run", None)
    if run is None:  # outside a launch (e.g. building tiles in a test): the default target
        run = _local.run = Run(target_from_env())
    return run


def enter(run: Run) -> Run | None:
    prev = getattr(_local, "run", None)
    _local.run = run
    return prev


def leave(prev: Run | None) -> None:
    _local.run = prev
