"""``nki-autotune selftest``: on a Trainium host, the whole neuron path, with a report."""

from __future__ import annotations

from rich.console import Console


def cmd_selftest(args, console: Console) -> int:
    from ..selftest import selftest

    code, text = selftest(seed=args.seed, output=args.output)
    console.print(text, markup=False, highlight=False)
    return code


def add_parser(sub) -> None:
    st = sub.add_parser("selftest", help="on a Trainium host: confirm the whole neuron path, print a report")
    st.add_argument("-o", "--output", default=None, help="also write the report (Markdown) here")
    st.add_argument("--seed", type=int, default=0)
    st.set_defaults(fn=cmd_selftest)
