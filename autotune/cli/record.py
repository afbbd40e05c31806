"""``nki-autotune record``: run a command with recording on and write (or merge) its profiles."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from ...registry import load_profile
from ...registry.env import RECORD, RECORD_SAMPLES, read_settings
from ...registry.profile import merge
from ...registry.yamlio import load as load_yaml
from .common import Interrupted, UsageError, add_imports, heavy, writable


def cmd_record(args, console: Console) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command and not args.merge:
        raise UsageError("record needs a command to run, e.g. nki-autotune record -o profile.yaml -- python train.py; "
                         "or profiles to merge: nki-autotune record -o merged.yaml --merge a.yaml b.yaml")
    writable(args.output, "-o")
    registry = heavy(args.imports)
    out = Path(args.output).resolve()
    given = [load_profile(p, registry.ops()) for p in args.merge or ()]
    if command:
        recorded = _record_run(command, out, args, registry, console)
        if recorded is None:
            return 1
        given += recorded
    profile = given[0] if len(given) == 1 and not args.merge else merge(given, out)
    profile.save(out)
    console.print(f"wrote {args.output}: {len(profile.sites)} call sites, "
                  f"{len(profile.keys(registry.ops()))} unique keys")
    return 0


def _ops_named(path: Path) -> set[str]:
    """The ops a profile's sites name, read as plain data (they need not be registered here)."""
    data = load_yaml(path, "profile")
    sites = data.get("sites") if isinstance(data, dict) else None
    return {str(s.get("op")) for s in sites or () if isinstance(s, dict)}


def _record_run(command: list[str], out: Path, args, registry, console: Console) -> list | None:
    """Run ``command`` recording into ``out`` (and its ranks' files); their profiles, None if it wrote none.

    The profiles of an earlier recording are renamed aside (``*.before-record``), so that only this run's are
    merged, and renamed back if this run writes none: the command failed, could not start, or was interrupted
    (Ctrl-C, or SIGTERM from a scheduler). Killed outright, the earlier ones are still there, under that name."""
    aside = {}
    for p in [out, *out.parent.glob(f"{out.stem}.rank*{out.suffix}")]:
        if p.exists():
            aside[p] = p.with_name(p.name + ".before-record")
            os.replace(p, aside[p])
    kept = f"; {args.output} is left as it was" if out in aside else ""
    done = False
    terminate = _on_sigterm()
    try:
        samples = args.samples or read_settings(os.environ).record_samples  # --samples, or the variable
        env = {**os.environ, RECORD: str(out), RECORD_SAMPLES: "1" if samples else "0"}
        console.print(f"recording {' '.join(command)} -> {args.output}")
        try:
            rc = subprocess.run(command, env=env).returncode
        except OSError as e:  # no such program, not executable
            raise UsageError(f"cannot run {command[0]!r}: {e.strerror or e}{kept}") from None
        if -rc in (signal.SIGINT, signal.SIGTERM):  # the same Ctrl-C or SIGTERM reached the command first
            raise Interrupted(-rc)
        ranks = sorted(out.parent.glob(f"{out.stem}.rank*{out.suffix}"))
        written = ([out] if out.exists() else []) + ranks
        if rc != 0 or not written:
            console.print(f"[red]the command exited with code {rc}{kept}[/]" if rc != 0 else
                          "[red]no profile was written: the command made no call of a pack op (does it import "
                          f"nki_autotune.kernels?){kept}[/]")
            return None
        unknown = sorted(set().union(*map(_ops_named, written)) - set(registry.ops()))
        if unknown:  # the command registered ops of its own: this process needs their module to read them
            done = True  # this run's profiles are kept as written: run and record --merge read them with --import
            raise UsageError(
                f"the command recorded calls of {', '.join(unknown)}, which no module imported here registers: "
                f"pass the module that registers {'it' if len(unknown) == 1 else 'them'} with --import MODULE (to "
                f"record and to run); this run's profiles are left as written: "
                f"{', '.join(str(p) for p in written)}")
        profiles = [load_profile(p, registry.ops()) for p in written]
        if ranks:
            console.print(f"merging the profiles of {len(ranks)} ranks: {', '.join(p.name for p in ranks)}")
        done = True
        return profiles
    finally:
        terminate()
        if not done:
            for p in [out, *out.parent.glob(f"{out.stem}.rank*{out.suffix}")]:
                p.unlink(missing_ok=True)
        for p, a in aside.items():
            if done:
                a.unlink(missing_ok=True)
            else:
                os.replace(a, p)


def _on_sigterm() -> Callable[[], None]:
    """Until the returned function is called, SIGINT and SIGTERM unwind as ``Interrupted`` (so ``finally`` blocks
    run), even where SIGINT was ignored when this process started (a job started in the background by a shell
    that has no job control)."""
    def stop(signum, frame):
        raise Interrupted(signum)

    try:
        previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: leave signals alone
        return lambda: None

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    return restore


def add_parser(sub) -> None:
    rec = sub.add_parser("record", help="record a profile of a command: record -o PROFILE -- COMMAND ...")
    rec.add_argument("-o", "--output", required=True)
    rec.add_argument("--samples", action="store_true", help="save real inputs of data-dependent ops beside it")
    rec.add_argument("--merge", nargs="+", metavar="PROFILE", help="profiles to merge into the output")
    add_imports(rec)
    rec.add_argument("command", nargs=argparse.REMAINDER)
    rec.set_defaults(fn=cmd_record)
