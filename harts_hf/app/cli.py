"""The ``harts-hf`` command line: a thin argparse front, one small function per command.

A command is a ``_<name>_parser(subparsers)`` that declares its arguments and sets ``run`` to
a ``cmd_<name>(args) -> int``; add it to ``_COMMANDS``. Knobs belong in configs, not here.

Inputs are checked before any work: counts and scales by their argparse ``type=`` (``_positive_int``
and its siblings), output folders and ``--config`` by :func:`main`, the rest by the command, which
refuses a value with ``SystemExit("harts-hf NAME: why")``. Every refusal is one line,
``harts-hf NAME: error: why``, with argparse's exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

from ..lab import plan_record, plot_plan, record_table
from ..lab.plan_report import bench_memory_model
from ..planner import DEFAULT_MAX_TOKENS, CostModel, MemoryModel, plan
from ..planner.groups import DEFAULT_LAYERS
from ..sources import CPU_SCALE, WORKLOADS, forest_stats, get_workload
from .train import add_parser as add_train_parsers

__all__ = ["build_parser", "main"]


def _format(value: object) -> str:
    if isinstance(value, float):  # four significant digits; big values as grouped integers
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _table(rows: dict[str, object]) -> str:
    """``key  value`` lines with the keys padded to one column."""
    width = max(len(k) for k in rows)
    return "\n".join(f"{k.replace('_', ' '):<{width}}  {_format(v)}" for k, v in rows.items())


_T = TypeVar("_T", int, float)


def _bounded(parse: Callable[[str], _T], accept: Callable[[_T], bool], what: str) -> Callable[[str], _T]:
    """An argparse ``type=`` that refuses text ``parse`` rejects or a value outside ``accept`` in one
    line, saying ``what`` the value must be."""

    def convert(text: str) -> _T:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    return convert


_positive_int = _bounded(int, lambda n: n >= 1, "a positive integer")
_non_negative_int = _bounded(int, lambda n: n >= 0, "a non-negative integer")
_positive_float = _bounded(float, lambda x: 0 < x < math.inf, "positive and finite")  # NaN fails too


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``harts-hf NAME: error: why`` (exit code 2); the usage it
    would print first is one ``--help`` away. Subcommands inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse an output path (``--json``, ``--plot``) whose folder does not exist before the work
    runs, not after (a bench's results would be lost)."""
    for option in ("json", "plot"):
        path = getattr(args, option, None)
        if path is not None and (path.is_dir() or not path.parent.is_dir()):
            raise SystemExit(
                f"harts-hf {args.command}: cannot write --{option} {path}: not a file in an existing folder"
            )


def _check_config(args: argparse.Namespace) -> None:
    """Refuse a recipe (``--config``) that is missing, not YAML or sets an unknown key before the model
    is built (imported here: it loads transformers)."""
    if getattr(args, "config", None) is not None:
        from .recipe import check_config

        try:
            check_config(args.config, args.trainer)
        except ValueError as err:
            raise SystemExit(f"harts-hf {args.command}: {err}") from err


def _add_run_options(p: argparse.ArgumentParser, *, plot: str) -> None:
    """--device, --dtype, --json and --plot of a benchmark command (``plot``: what its figure draws)."""
    p.add_argument("--device", choices=("cpu", "cuda"), help="default cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), help="default fp32")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the record to this JSON file")
    p.add_argument("--plot", type=Path, metavar="PNG", help=plot)


def _write_json(path: Path | None, record: dict) -> None:
    """Save a command's record as indented JSON when ``--json`` asked for it, and say where."""
    if path is not None:
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {path}")


def _write_plot(path: Path | None, draw: Callable[[Path], None]) -> None:
    """Draw a command's figure to ``path`` when ``--plot`` asked for it, and say where."""
    if path is not None:
        draw(path)
        print(f"wrote {path}")


def _workload_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("workload", help="generate a synthetic workload and print its forest statistics")
    p.add_argument("name", metavar="NAME", choices=sorted(WORKLOADS), help=", ".join(sorted(WORKLOADS)))
    p.add_argument("--scale", type=_positive_float, help="length multiplier (swe-like; see workloads.CPU_SCALE)")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="random seed (default 0)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the statistics to this JSON file")
    p.set_defaults(run=cmd_workload)


def _quiet() -> None:
    """The train console's filters for a command that builds models (transformers' CPU-irrelevant
    kernel-fallback advice would break its progress bars)."""
    from .console import quiet_third_party

    quiet_third_party()


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
    _write_json(args.json, stats)
    return 0


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan a workload's microbatch slots on R ranks and compare the baselines")
    names = sorted(WORKLOADS)
    p.add_argument("--workload", required=True, metavar="NAME", choices=names, help=", ".join(names))
    p.add_argument("--scale", type=_positive_float, help="length multiplier (swe-like; default 1: planning is cheap)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        type=_workload_arg,
        metavar="KEY=VALUE",
        help="a keyword of the workload's generator (harts_hf.sources), e.g. num_tasks=64: swe-like's 14K trajectories",
    )
    p.add_argument("--world-size", type=_positive_int, required=True, metavar="R", help="data-parallel ranks")
    p.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=DEFAULT_MAX_TOKENS,
        metavar="T",
        help=f"microbatch budget: compact tokens + ancestor context (default {DEFAULT_MAX_TOKENS:,})",
    )
    p.add_argument(
        "--cost-model",
        type=Path,
        metavar="JSON",
        help="coefficients written by `harts-hf calibrate` (default: built in)",
    )
    p.add_argument(
        "--model",
        metavar="FAMILY",
        help="price the context with this bench model's memory model (its K/V, not a whole token: trajectories "
        "longer than the budget then plan; default: a context token costs an own token)",
    )
    p.add_argument("--size", default="default", help="the --model's size from harts_hf.lab.SIZES (default default)")
    p.add_argument(
        "--memory-model",
        type=Path,
        metavar="JSON",
        help="price the context with these memory model coefficients instead (what `harts-hf calibrate --memory "
        "--json` writes: a real model's, with gradient checkpointing where it trains with it)",
    )
    p.add_argument(
        "--no-handoffs",
        action="store_true",
        help="recompute every shared chain on the ranks reading it, never hand one over (a plan each rank can "
        "run alone; the report shows this plan as no_exchange either way)",
    )
    p.add_argument(
        "--context-parallel",
        action="store_true",
        help="run a trajectory's pieces at once over idle ranks (context-parallel groups) where that lowers the step",
    )
    p.add_argument(
        "--layers",
        type=_positive_int,
        default=DEFAULT_LAYERS,
        metavar="L",
        help=f"decoder layers a context-parallel group's wavefront passes (default {DEFAULT_LAYERS})",
    )
    p.add_argument(
        "--host-memory",
        type=float,
        default=0.0,
        metavar="GB",
        help="host memory per rank for the graphs the budget cannot hold, instead of rerunning them where the "
        "copies cost less (a GPU, one process or DDP: the trainers' harts_max_host_bytes; default 0: none)",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report to this JSON file")
    p.add_argument("--plot", type=Path, metavar="PNG", help="draw the slots per rank, coloured by tree")
    p.set_defaults(run=cmd_plan)


def _workload_arg(text: str) -> tuple[str, int | float | str]:
    """``KEY=VALUE`` -> (key, the value as an int, else a float, else the text)."""
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    for convert in (int, float):
        try:
            return key, convert(value)
        except ValueError:
            pass
    return key, value


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan ``args.workload``, measure the baselines beside it, print (and optionally save) them."""
    kwargs = ({} if args.scale is None else {"scale": args.scale}) | dict(args.set)
    try:
        cost = None if args.cost_model is None else CostModel(**json.loads(args.cost_model.read_text()))
        if args.model is not None and args.memory_model is not None:
            raise ValueError("give --model or --memory-model, not both")
        memory = None if args.model is None else bench_memory_model(args.model, args.size)
        if args.memory_model is not None:
            memory = MemoryModel(**json.loads(args.memory_model.read_text()))
        forest = get_workload(args.workload, **kwargs).forest()
        result = plan(
            forest,
            world_size=args.world_size,
            max_tokens_per_microbatch=args.max_tokens,
            cost_model=cost,
            memory_model=memory,
            handoffs=not args.no_handoffs,
            context_parallel=args.context_parallel,
            layers=args.layers,
            max_host_bytes=args.host_memory * 1e9,
        )
    except (TypeError, ValueError) as err:
        raise SystemExit(f"harts-hf plan: {err}") from err
    record = plan_record([forest], result)
    print(record_table(record))
    _write_json(args.json, record)
    _write_plot(args.plot, lambda path: plot_plan(result, forest, path, record=record, workload=args.workload))
    return 0


def _calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate", help="fit the planner's cost model (--memory: memory model) to a model on this machine"
    )
    p.add_argument("--model", metavar="FAMILY", default="qwen3_5", help="model family (default qwen3_5)")
    p.add_argument("--size", default="quick", help="model size from harts_hf.lab.SIZES (default quick)")
    p.add_argument(
        "--repeats", type=_positive_int, default=3, help="timed runs per forest; the fastest counts (default 3)"
    )
    p.add_argument(
        "--memory", action="store_true", help="fit the memory model (bytes) to measured peaks instead of the cost model"
    )
    p.add_argument(
        "--comm",
        action="store_true",
        help="also measure the communication terms: a 2-process gloo exchange on this machine (seconds per byte "
        "and per message) and the model's bytes per handed context token and path start",
    )
    p.add_argument(
        "--tokens",
        type=_positive_int,
        default=2048,
        metavar="T",
        help="with --memory: chains of T, 2T, 4T tokens, and of 2-8 pieces of T; near the budget you train "
        "with (default 2048)",
    )
    p.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help="write the coefficients here (for `plan --cost-model`; with --memory, for harts_memory_model)",
    )
    p.set_defaults(run=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Time the model's forward + backward on calibration forests and fit the cost model."""
    _quiet()
    from ..lab.calibrate import calibrate, format_cost_model
    from ..lab.models import build_model

    began = time.perf_counter()
    try:
        model = build_model(args.model, args.size).model
    except (KeyError, ValueError) as err:
        raise SystemExit(f"harts-hf calibrate: {err}") from err
    if args.memory:
        from ..engine import memory_model
        from ..engine.memory import memory_breakdown
        from ..lab.calibrate_memory import calibrate_memory, format_breakdown, format_memory_model
        from ..modeling import patch_model

        try:
            measured = calibrate_memory(patch_model(model), tokens=args.tokens)
        except ValueError as err:
            raise SystemExit(f"harts-hf calibrate: {err}") from err
        title = f"memory model of {args.model} ({args.size}) in {time.perf_counter() - began:.1f} s:"
        print(format_memory_model(measured, memory_model(model), title))
        print(format_breakdown(memory_breakdown(model)))
        _write_json(args.json, measured.as_dict())
        return 0
    fitted = calibrate(model, repeats=args.repeats)
    if args.comm:
        from ..lab.calibrate_comm import calibrate_comm
        from ..modeling import patch_model

        fitted = calibrate_comm(fitted, patch_model(model), repeats=args.repeats)
    print(
        format_cost_model(fitted, f"cost model of {args.model} ({args.size}) in {time.perf_counter() - began:.1f} s:")
    )
    _write_json(args.json, fitted.as_dict())
    return 0


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="time stock, trajectory-wise and forest training steps of one model")
    p.add_argument("--quick", action="store_true", help="a small model and workload (CI's check; under 45 s)")
    p.add_argument("--model", metavar="FAMILY", help="model family (default qwen3_5; see harts_hf.lab.BENCH_FAMILIES)")
    p.add_argument(
        "--workload",
        metavar="NAME",
        choices=sorted(WORKLOADS),
        help="default swe-like; " + ", ".join(sorted(WORKLOADS)),
    )
    p.add_argument(
        "--scale", type=_positive_float, help="length multiplier of the workload (swe-like default 0.005, quick 0.002)"
    )
    p.add_argument("--size", help="model size from harts_hf.lab.SIZES (default: default; gpu for a CUDA run)")
    _add_run_options(p, plot="draw seconds per phase and mode, the ideal marked")
    p.set_defaults(run=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark (imported here: it loads torch and transformers), print and save it."""
    _quiet()
    from ..lab import bench_record, default_config, plot_bench, run_bench, table

    try:
        config = default_config(
            args.quick,
            model=args.model,
            size=args.size,
            workload=args.workload,
            scale=args.scale,
            dtype=args.dtype,
            device=args.device,
        )
    except ValueError as err:
        raise SystemExit(f"harts-hf bench: {err}") from err
    record = bench_record(run_bench(config))
    print(table(record))
    _write_json(args.json, record)
    _write_plot(args.plot, lambda path: plot_bench(record, path))
    return 0


def _bench_ops_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-ops", help="time each tree kernel vs the same kernel run trajectory by trajectory")
    p.add_argument(
        "--scale", type=_positive_float, default=CPU_SCALE, help=f"swe-like length multiplier (default {CPU_SCALE})"
    )
    p.add_argument(
        "--tasks", type=_positive_int, default=1, help="swe-like tasks of 8 episodes (default 1: ~1.5 min on one core)"
    )
    p.add_argument("--kinds", nargs="+", metavar="KIND", help="layer kinds (default all of harts_hf.lab.ops.KINDS)")
    p.add_argument(
        "--repeats", type=_positive_int, default=3, help="timed runs per kind and mode, after a warm-up (default 3)"
    )
    p.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        help="torch CPU threads (default 1: ratios free of thread-scheduling noise)",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results to this JSON file")
    p.set_defaults(run=cmd_bench_ops)


def cmd_bench_ops(args: argparse.Namespace) -> int:
    """Benchmark the tree kernels on a SWE-like forest (imported here: it loads torch), print and save."""
    _quiet()
    from ..lab.ops import bench_ops, format_table

    kinds = {} if args.kinds is None else {"kinds": args.kinds}
    try:
        workload = get_workload("swe-like", scale=args.scale, num_tasks=args.tasks)
        record = {"workload": "swe-like", "scale": args.scale, "tasks": args.tasks}
        record |= bench_ops(workload.sequences, repeats=args.repeats, threads=args.threads, keep_memory=True, **kinds)
    except ValueError as err:
        raise SystemExit(f"harts-hf bench-ops: {err}") from err
    print(format_table(record))
    _write_json(args.json, record)
    return 0


def _memory_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory", help="peak memory and step time vs trajectory length at one microbatch budget")
    p.add_argument("--model", metavar="FAMILY", help="model family (default qwen3_5; see harts_hf.lab.BENCH_FAMILIES)")
    p.add_argument("--size", help="model size from harts_hf.lab.SIZES (default quick)")
    p.add_argument(
        "--lengths",
        type=_positive_int,
        nargs="+",
        metavar="L",
        help="longest-trajectory lengths: a prompt of L/2 and 2 completions of L/2 (default 2048 ... 32768)",
    )
    p.add_argument("--budget", type=_positive_int, metavar="T", help="harts' tokens per microbatch (default 8192)")
    p.add_argument(
        "--one-unit-max-tokens",
        type=_positive_int,
        metavar="N",
        help="also run harts as one unit where the trajectories' 2L tokens are at most N (default 16384)",
    )
    p.add_argument(
        "--stock-max-tokens", type=_positive_int, metavar="N", help="run stock where L is at most N (default 8192)"
    )
    p.add_argument("--repeats", type=_positive_int, help="runs per mode and length; the fastest counts (default 1)")
    _add_run_options(p, plot="draw peak MB and step seconds against length")
    p.set_defaults(run=cmd_memory)


def cmd_memory(args: argparse.Namespace) -> int:
    """Sweep trajectory lengths at one budget (imported here: it loads torch), print and save the record."""
    _quiet()
    from ..lab import MemorySweepConfig, memory_sweep, memory_table, plot_memory_sweep

    names = ("model", "size", "lengths", "budget", "one_unit_max_tokens", "stock_max_tokens", "repeats", "device")
    options = {name: getattr(args, name) for name in (*names, "dtype") if getattr(args, name) is not None}
    try:
        record = memory_sweep(MemorySweepConfig(**options))
    except ValueError as err:
        raise SystemExit(f"harts-hf memory: {err}") from err
    print(memory_table(record))
    _write_json(args.json, record)
    _write_plot(args.plot, lambda path: plot_memory_sweep(record, path))
    return 0


_COMMANDS = (
    _workload_parser,
    _plan_parser,
    _calibrate_parser,
    _bench_parser,
    _bench_ops_parser,
    _memory_parser,
    add_train_parsers,
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="harts-hf", description="Train hybrid-attention LMs on rollout trees (harts-hf).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``harts-hf`` console script and ``python -m harts_hf``: a command's refusal
    (``SystemExit("harts-hf NAME: why")``) or a file it cannot read or write ends in argparse's
    one-line form and exit code 2, as a bad argument does."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not hasattr(args, "trl_flags"):  # only the recipe commands take TRL's flags
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.trl_flags = extra
    prefix = f"harts-hf {args.command}: "
    try:
        _check_outputs(args)
        _check_config(args)
        return args.run(args)
    except OSError as err:
        why = str(err)
    except SystemExit as err:
        if not isinstance(err.code, str):
            raise
        why = err.code.removeprefix(prefix)
    parser.exit(2, f"{prefix}error: {why}\n")
