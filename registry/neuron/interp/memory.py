"""On-chip memory of one launch, counted by live range: a tile is live from its first use to its last.

The compiler allocates SBUF and PSUM from the program, not from Python's references: it "assigns an address to a
tile at its first write and releases the address after its last read" (docs: nki.compiler.Allocation, LINEAR), so a
tile declared up front takes no bytes before an instruction first uses it, and none after the last one does, however
long the kernel keeps naming it. An instruction reads its inputs before it writes its outputs, so the tiles it first
writes may take the bytes of those it reads last. Under NKI 0.7 Python loops are unrolled at specialization (docs:
nki/deep-dives/nki-loops.rst), so each iteration's tiles are separate allocations. A compiled loop (``nl.fori_loop``,
``nl.while_loop``) is one body run many times: the tensors it allocates are allocated once for the whole loop, and
every tensor it uses stays live for the whole loop (docs: nki/deep-dives/nki-dynamic-loops.rst, "Register Allocation
Implications"). A tile no instruction uses counts at its allocation. The peak over the program is checked against the
target's capacity when the launch ends. A tensor placed with ``address=(partition, byte offset)``
(nki.language.ndarray; the NKI Library's allocators place every tile) occupies those bytes: placed tensors that share
addresses share them, and the bytes of every placed tensor live at an instant count once alongside the
compiler-allocated ones.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import NkiError

_HERE = str(Path(__file__).parent)


@dataclass(eq=False)
class Interval:
    buffer: str
    nbytes: int
    start: int
    end: int
    label: str
    address: int | None = None
    """The first byte within the partition of a tensor placed with ``address=``; None where the compiler places it."""
    used: str = ""
    """The kernel line of the first use (empty until then): the live range starts there, not at the allocation."""


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

    def allocate(self, storage, shape, itemsize: int, buffer: str, name: str, address=None) -> None:
        """Check one allocation alone and open its live range (one range per site within a compiled loop)."""
        t = self.target
        what = f"nl.ndarray({name + ', ' if name else ''}shape={list(shape)}, buffer=nl.{buffer})"
        if shape[0] > t.partitions:
            raise NkiError(f"{what}: partition dimension {shape[0]} exceeds maximum {t.partitions}")
        nbytes, cap = self.footprint(shape, itemsize, buffer), self.capacity(buffer)
        if nbytes > cap:
            raise NkiError(f"{what}: {nbytes} bytes per partition exceed the {buffer.upper()} capacity of "
                           f"{cap} bytes per partition on {t.name}")
        byte = None
        if address is not None:
            partition, byte = _placement(what, address)
            if partition + shape[0] > t.partitions:
                raise NkiError(f"{what}: address=({partition}, {byte}) places {shape[0]} partitions from partition "
                               f"{partition}, past the {t.partitions} of {buffer.upper()}")
            if byte + math.prod(shape[1:]) * itemsize > cap:
                raise NkiError(f"{what}: address=({partition}, {byte}) places {math.prod(shape[1:]) * itemsize} bytes "
                               f"per partition from byte {byte}, past the {buffer.upper()} capacity of {cap} bytes "
                               f"per partition on {t.name}")
            storage.partition0 = partition
        if self.loops:  # a compiled loop's body allocates once for the whole loop
            outer, inner = self.loops[0], self.loops[-1]
            site = _site()
            n = inner.seen.get(site, 0)
            inner.seen[site] = n + 1
            key = (site, n)
            iv = outer.slots.get(key)
            if iv is None:
                used = f"the start of the compiled loop allocating it at {Path(site[0]).name}:{site[1]}"
                iv = outer.slots[key] = Interval(buffer, nbytes, outer.start, outer.start, what, byte, used)
                self.intervals.append(iv)
        else:
            iv = Interval(buffer, nbytes, self.clock + 1, self.clock + 1, what, byte)
            self.intervals.append(iv)
        storage.interval = iv

    def touch(self, storage) -> None:
        """A use by the current instruction: the first one opens the live range, every one extends it."""
        iv = getattr(storage, "interval", None)
        if iv is None:
            return
        if not iv.used:
            file, line = _site()
            iv.used = f"{Path(file).name}:{line}"
            iv.start = max(iv.start, self.clock)  # a write outside an instruction (nl.zeros) is at its allocation
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
        for iv in loop.touched | set(loop.slots.values()):  # the body runs again: live for the whole loop
            iv.start, iv.end = min(iv.start, loop.start), max(iv.end, self.clock)
        if self.loops:
            self.loops[-1].touched |= loop.touched | set(loop.slots.values())

    def check(self) -> None:
        """The peak of live bytes per partition, per buffer, against the capacity: the compiler-allocated tensors'
        sizes plus the bytes covered by placed tensors (each byte once). Releases sort before allocations at the same
        instant, and a compiler-allocated tensor used last by an instruction is released at that instruction: the
        instruction reads it before it writes, so the tiles it first writes may take its bytes (an engine may write
        in place, dst over data; a register allocator gives a result the register of an operand that dies there).
        A placed tensor holds its own bytes to the end of its last instruction."""
        for buffer in ("sbuf", "psum"):
            cap = self.capacity(buffer)
            events = []
            for iv in self.intervals:
                if iv.buffer == buffer:
                    events.append((iv.start, 1, iv))
                    events.append((iv.end + (iv.address is not None or iv.end == iv.start), 0, iv))
            live, alive = 0, {}
            placed = _Coverage(cap)
            for _, kind, iv in sorted(events, key=lambda e: (e[0], e[1])):
                if kind == 0:
                    del alive[iv]
                    if iv.address is None:
                        live -= iv.nbytes
                    else:
                        placed.remove(iv.address, iv.nbytes)
                    continue
                added = iv.nbytes if iv.address is None else placed.added(iv.address, iv.nbytes)
                if live + placed.covered + added > cap:
                    raise self._full(buffer, cap, [*alive, iv])
                alive[iv] = None
                if iv.address is None:
                    live += iv.nbytes
                else:
                    placed.add(iv.address, iv.nbytes)

    def _full(self, buffer: str, cap: int, live: list[Interval]) -> NkiError:
        """The error of an instant whose live tensors overflow: the one allocated last is the one requested."""
        req = max(live, key=self.intervals.index)
        rest = [iv for iv in live if iv is not req]
        placed = _Coverage(cap)
        for iv in rest:
            if iv.address is not None:
                placed.add(iv.address, iv.nbytes)
        held = sum(iv.nbytes for iv in rest if iv.address is None) + placed.covered
        where = f", first used at {req.used}" if req.used else ""
        return NkiError(f"{req.label}{where}: {buffer.upper()} full on {self.target.name}: {held} bytes per partition "
                        f"live in {len(rest)} tensor(s), {req.nbytes} more requested, capacity {cap} (live range: "
                        "from first use to last use, whose tiles may take the bytes of those it uses last; a compiled "
                        "loop holds its tiles for the whole loop; placed tensors count the bytes they cover)")


class _Coverage:
    """Bytes of one partition covered by placed tensors, each byte counted once."""

    def __init__(self, cap: int):
        self.depth = np.zeros(cap, np.int32)
        self.covered = 0

    def added(self, start: int, nbytes: int) -> int:
        """Bytes a placement at ``start`` would add to the covered ones."""
        return int(np.count_nonzero(self.depth[start:start + nbytes] == 0))

    def add(self, start: int, nbytes: int) -> None:
        self.covered += self.added(start, nbytes)
        self.depth[start:start + nbytes] += 1

    def remove(self, start: int, nbytes: int) -> None:
        self.depth[start:start + nbytes] -= 1
        self.covered -= int(np.count_nonzero(self.depth[start:start + nbytes] == 0))


def _placement(what: str, address) -> tuple[int, int]:
    """``address=(partition, byte offset)`` of nl.ndarray, both compile-time ints."""
    if not (isinstance(address, tuple) and len(address) == 2
            and all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) and a >= 0 for a in address)):
        raise NkiError(f"{what}: address={address!r}: a placement is (partition, byte offset), two non-negative "
                       "compile-time ints (nki.language.ndarray)")
    return int(address[0]), int(address[1])
