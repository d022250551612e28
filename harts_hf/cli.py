"""The ``harts-hf`` command line: a thin argparse front, one small function per command.

A command is a ``_<name>_parser(subparsers)`` that declares its arguments and sets ``run`` to
a ``cmd_<name>(args) -> int``; add it to ``_COMMANDS``. Knobs belong in configs, not here.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

from .workloads import WORKLOADS, forest_stats, get_workload

__all__ = ["build_parser", "main"]


def _format(value: object) -> str:
    if isinstance(value, float):  # four significant digits; big values as grouped integers
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _table(rows: dict[str, object]) -> str:
    """``key  value`` lines with the keys padded to one column."""
    width = max(len(k) for k in rows)
    return "\n".join(f"{k.replace('_', ' '):<{width}}  {_format(v)}" for k, v in rows.items())


def _workload_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("workload", help="generate a synthetic workload and print its forest statistics")
    p.add_argument("name", metavar="NAME", choices=sorted(WORKLOADS), help=", ".join(sorted(WORKLOADS)))
    p.add_argument("--scale", type=float, help="length multiplier (swe-like; see workloads.CPU_SCALE)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the statistics to this JSON file")
    p.set_defaults(run=cmd_workload)


def cmd_workload(args: argparse.Namespace) -> int:
    """Generate ``args.name``, build its forest, print (and optionally save) the statistics."""
    kwargs: dict[str, object] = {"seed": args.seed}
    if args.scale is not None:
        kwargs["scale"] = args.scale
    start = time.perf_counter()
    try:
        workload = get_workload(args.name, **kwargs)
    except (TypeError, ValueError) as err:
        raise SystemExit(f"harts-hf workload: {err}") from err
    generated = time.perf_counter()
    forest = workload.forest()
    built = time.perf_counter()
    stats = {
        "workload": args.name,
        **kwargs,
        **forest_stats(forest),
        "generate_seconds": generated - start,
        "build_seconds": built - generated,
    }
    print(_table(stats))
    if args.json is not None:
        args.json.write_text(json.dumps(stats, indent=2) + "\n")
    return 0


_COMMANDS = (_workload_parser,)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harts-hf", description="Train hybrid-attention LMs on rollout trees (harts-hf)."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``harts-hf`` console script and ``python -m harts_hf``."""
    args = build_parser().parse_args(argv)
    return args.run(args)
