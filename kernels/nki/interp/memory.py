"""On-chip memory of one launch, counted by live range: a tile is live from its allocation to its last use.

The compiler allocates SBUF and PSUM from the program, not from Python's references: under NKI 0.7 Python loops
are unrolled at specialization (docs: nki/deep-dives/nki-loops.rst), so each iteration's tiles are separate
allocations whose lives end at their last instruction. A compiled loop (``nl.fori_loop``, ``nl.while_loop``) is
one body run many times: the tensors it allocates are allocated once for the whole loop, and every tensor it uses
stays live until the loop ends (docs: nki/deep-dives/nki-dynamic-loops.rst, "Register Allocation Implications").
The peak over the program is checked against the target's capacity when the launch ends.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .errors import NkiError

_HERE = str(Path(__file__).parent)


@dataclass(eq=False)
class Interval:
    buffer: str
    nbytes: int
    start: int
    end: int
    label: str


@dataclass(eq=False)
class _Loop:
    start: int
    slots: dict = field(default_factory=dict)
    seen: dict = field(default_factory=dict)
    touched: set = field(default_factory=set)


def _site() -> tuple[str, int]:
    """The kernel line that allocates (the first frame outside the interpreter)."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_HERE):
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno) if f is not None else ("?", 0)


class Memory:
    """SBUF and PSUM of one program of a launch."""

    def __init__(self, target):
        self.target = target
        self.clock = 0
        self.intervals: list[Interval] = []
        self.loops: list[_Loop] = []

    def footprint(self, shape, itemsize: int, buffer: str) -> int:
        nbytes = math.prod(shape[1:]) * itemsize
        if buffer == "psum":  # ARCH2: PSUM tensors start on a bank boundary and take whole banks
            bank = self.target.psum_bank_bytes
            nbytes = -(-nbytes // bank) * bank
        return nbytes

    def capacity(self, buffer: str) -> int:
        return self.target.sbuf_partition_bytes if buffer == "sbuf" else self.target.psum_partition_bytes

    def allocate(self, storage, shape, itemsize: int, buffer: str, name: str) -> None:
        """Check one allocation alone and open its live range (one range per site within a compiled loop)."""
        t = self.target
        what = f"nl.ndarray({name + ', ' if name else ''}shape={list(shape)}, buffer=nl.{buffer})"
        if shape[0] > t.partitions:
            raise NkiError(f"{what}: partition dimension {shape[0]} exceeds maximum {t.partitions}")
        nbytes, cap = self.footprint(shape, itemsize, buffer), self.capacity(buffer)
        if nbytes > cap:
            raise NkiError(f"{what}: {nbytes} bytes per partition exceed the {buffer.upper()} capacity of "
                           f"{cap} bytes per partition on {t.name}")
        if self.loops:  # a compiled loop's body allocates once for the whole loop
            outer, inner = self.loops[0], self.loops[-1]
            site = _site()
            n = inner.seen.get(site, 0)
            inner.seen[site] = n + 1
            key = (site, n)
            iv = outer.slots.get(key)
            if iv is None:
                iv = outer.slots[key] = Interval(buffer, nbytes, outer.start, outer.start, what)
                self.intervals.append(iv)
        else:
            iv = Interval(buffer, nbytes, self.clock + 1, self.clock + 1, what)
            self.intervals.append(iv)
        storage.interval = iv

    def touch(self, storage) -> None:
        iv = getattr(storage, "interval", None)
        if iv is None:
            return
        iv.end = max(iv.end, self.clock)
        if self.loops:
            self.loops[-1].touched.add(iv)

    def tick(self) -> None:
        self.clock += 1

    def loop_start(self) -> None:
        self.loops.append(_Loop(self.clock + 1))

    def iteration(self) -> None:
        self.loops[-1].seen.clear()

    def loop_end(self) -> None:
        loop = self.loops.pop()
        for iv in loop.touched | set(loop.slots.values()):
            iv.end = max(iv.end, self.clock)
        if self.loops:
            self.loops[-1].touched |= loop.touched | set(loop.slots.values())

    def check(self) -> None:
        """The peak of live bytes per partition, per buffer, against the capacity."""
        for buffer in ("sbuf", "psum"):
            cap = self.capacity(buffer)
            events = []
            for iv in self.intervals:
                if iv.buffer == buffer:
                    events.append((iv.start, 1, iv))
                    events.append((iv.end + 1, 0, iv))  # releases sort before allocations at the same instant
            live, count = 0, 0
            for _, kind, iv in sorted(events, key=lambda e: (e[0], e[1])):
                if kind == 0:
                    live, count = live - iv.nbytes, count - 1
                    continue
                if live + iv.nbytes > cap:
                    raise NkiError(f"{iv.label}: {buffer.upper()} full on {self.target.name}: {live} bytes per "
                                   f"partition live in {count} tensor(s), {iv.nbytes} more requested, capacity {cap} "
                                   "(live range: from allocation to last use; a compiled loop holds its tiles for "
                                   "the whole loop)")
                live, count = live + iv.nbytes, count + 1
