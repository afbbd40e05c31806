"""``nki-autotune verify``: the full training step under a table, against every kernel off and every kernel on."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table as RichTable

from ...registry.env import STRICT, read_settings
from ...registry.yamlio import atomic_write_text
from ..stats import MIN_ROUNDS
from .common import UsageError, add_imports, at_least, heavy, mib, not_recording, positive, writable


def cmd_verify(args, console: Console) -> int:
    not_recording("verify")
    heavy(args.imports)
    from ..verify import StepError, Verifier, load_step

    if args.prune and not args.output:
        raise UsageError("--prune needs -o OUT, the table to write")
    if args.output and not args.prune:
        raise UsageError("-o OUT writes the pruned table: it needs --prune")
    if args.prune and args.no_ablate:
        raise UsageError("--prune sends back the entries that do not pay with each switched off alone: "
                         "it needs the ablation that --no-ablate skips")
    for path, option in ((args.output, "-o"), (args.json, "--json")):
        if path:
            writable(path, option)
    from ...registry.switches import load_checked

    # a foreign or stale table cannot be verified: it is not what dispatch would follow
    table = load_checked(args.table, read_settings({STRICT: "1"}),
                         strict_because="verify measures only a table that is current on this machine")
    try:
        make_step = load_step(args.step)
    except StepError as e:
        raise UsageError(str(e)) from None
    v = Verifier(table, args.table, make_step, rounds=args.rounds, warmup=args.warmup, seed=args.seed,
                 tolerance=args.tolerance, ablate=not args.no_ablate,
                 say=lambda s: None if args.quiet else console.print(f"[dim]{s}[/]"))
    try:
        r = v.run()
    except StepError as e:
        raise UsageError(str(e)) from None
    t = RichTable(title=f"full training step under {args.table}")
    for col in ("variant", "ms/step (median)", "peak MiB", "loss vs off", "gradients vs off"):
        t.add_column(col)
    for name, row in r.variants.items():
        num = r.numerics.get(name, {})
        fmt = "{:.1e}".format
        t.add_row(name, f"{row['ms_per_step']:.2f}", mib(row["peak_mib"]),
                  fmt(num["loss_rel_diff"]) if "loss_rel_diff" in num else "-",
                  fmt(num["grad_rel_diff"]) if "grad_rel_diff" in num else "-")
    console.print(t)
    for name, s in r.speedups.items():
        ratio = r.memory.get(name)
        console.print(f"  speedup of {name}: {s['speedup']:.3f}x (95% CI {s['ci95'][0]:.3f}-{s['ci95'][1]:.3f})"
                      + ("" if ratio is None else f"; peak memory {ratio:.3f}x"))
    if r.entries:
        e = RichTable(title="each enabled entry switched off alone (saving: the step without it minus with it)",
                      caption="the only enabled entry switched off leaves what every kernel off runs: timed as off"
                      if any(row["timed_as"] for row in r.entries) else None)
        for col in ("#", "entry", "impl", "predicted ms/step", "realized ms/step", "95% CI", "realized peak MiB",
                    "pays"):
            e.add_column(col, overflow="fold")
        for row in r.entries:
            lo, hi = row["realized_ci95"]
            pred = "-" if row["predicted_ms"] is None else f"{row['predicted_ms']:+.3f}"
            peak = "-" if row["realized_peak_mib"] is None else f"{row['realized_peak_mib']:+.4g}"
            spans = " (median; its interval spans 0)" if lo <= 0 <= hi and row["objective"] == "time" else ""
            e.add_row(str(row["entry"]), row["key"], row["impl"], pred, f"{row['realized_ms']:+.3f}",
                      f"{lo:+.3f} to {hi:+.3f}", peak, ("[green]yes[/]" if row["kept"] else "[red]no[/]") + spans
                      + (" (objective memory)" if row["objective"] == "memory" else ""))
        console.print(e)
    console.print(("[red]" if r.slower else "[green]") + r.verdict + "[/]")
    if r.ceiling and r.ceiling["speedup"]:
        c = r.ceiling
        def ms(x: float) -> str:  # a tiny step's 0.04 ms is not 0.0
            return f"{x:.1f}" if x >= 1 else f"{x:.2g}"

        console.print(f"the table's call sites, measured apart, take {ms(c['compiler_ms'])} ms of the "
                      f"{ms(c['step_ms'])} ms step under the compiler: a table can make this step about "
                      f"{c['speedup']:.3f}x faster at most"
                      + ("; the table measured faster than that, so in this step its call sites cost more than "
                         "they did measured apart (memory the step's other work faults in or evicts, or a machine "
                         "busy while the tuner measured): the bound does not hold here" if c["exceeded"] else ""))
    if not r.numerics_ok:
        console.print(f"[red]numerics: a variant's loss or gradients differ from every kernel off by more than "
                      f"{args.tolerance:g}[/] (is STEP deterministic: same seeds, same data each call?)")
    if args.json:
        atomic_write_text(args.json, json.dumps(r.as_json(), indent=2))
    if args.prune:
        pruned = v.pruned(r)
        pruned.save(args.output)
        dropped = sum(1 for row in r.entries if not row["kept"])
        console.print(f"wrote {args.output}: {dropped} entr{'y' if dropped == 1 else 'ies'} sent back to the compiler")
    return 1 if r.slower or not r.numerics_ok else 0


def add_parser(sub) -> None:
    v = sub.add_parser("verify", help="time the full training step under a table, every kernel off and on")
    v.add_argument("table")
    v.add_argument("step", help="path/to/file.py:function or package.module:function returning a step callable")
    v.add_argument("--rounds", type=at_least(MIN_ROUNDS), default=20,
                   help=f"interleaved rounds of every variant (at least {MIN_ROUNDS}: fewer rounds bound no median "
                        "with 95%% confidence)")
    v.add_argument("--warmup", type=at_least(0), default=3, help="untimed steps of each variant first")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--tolerance", type=positive, default=1e-3,
                   help="largest relative difference of loss and gradients against every kernel off")
    v.add_argument("--no-ablate", action="store_true", help="skip switching each entry off alone")
    v.add_argument("--prune", action="store_true", help="send entries that do not pay back to the compiler")
    v.add_argument("-o", "--output", default=None, help="the pruned table to write (with --prune)")
    v.add_argument("--json", default=None, help="write every number as JSON to this file")
    v.add_argument("-q", "--quiet", action="store_true")
    add_imports(v)
    v.set_defaults(fn=cmd_verify)
