"""Schedule compile time at scale: build a swe-like forest, plan its step over R ranks, then compile
every rank's units (``harts_hf.schedule.rank_units``: token ids, tree tables, handoff addresses) for the
default bench model, and print the seconds of each. Ranks compile their own units in parallel,
so the step pays the largest rank's time; a process's first compile also builds the forest's cached
arrays, as every rank's does each step (its forest is new), so the ranks after the first here are
warm (``--rank`` names the ranks to compile). The forest build and the plan are timed in CPU seconds of
this process (user + system: a loaded machine stretches the wall clock, not these; the system part is
the kernel faulting in fresh pages, which the first build of a process pays in full).

    python scripts/compile_time.py                      # scale 1 (21.7M trajectory tokens), 8 ranks
    python scripts/compile_time.py --scale 0.1 --world-size 4
    python scripts/compile_time.py --num-tasks 64 --model qwen3_5 --world-size 1024 --plan-only --repeat 5
        # issue 36's figure: 14,177 trajectories (315M tokens, 54.6M compact), forest and plan seconds
    python scripts/compile_time.py --workload deep-chain --set levels=1640 --max-tokens 1024 --model qwen3_5 \
        --plan-only --repeat 3    # another workload of harts_hf.sources: a chain of 1,640 branch levels
    python scripts/compile_time.py --model qwen3_5 --world-size 64 --max-tokens 65536 --context-parallel
        # a cross-rank step (the relay: handoffs between ranks, context-parallel groups)
    python scripts/compile_time.py --num-tasks 64 --model qwen3_5 --world-size 1024 --max-tokens 65536 \
        --context-parallel --sample 16    # 16 of its 1,024 ranks, spread evenly
    python scripts/compile_time.py --num-tasks 64 --model qwen3_5 --world-size 1024 --max-tokens 65536 \
        --context-parallel --rank 500 --rank 501    # one rank's step as a process runs it (the first), then warm
    python scripts/compile_time.py --model qwen3_5 --world-size 64 --max-tokens 65536 --context-parallel \
        --plan-only --planners 64    # every rank planning the step together: each one's CPU seconds
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from harts_hf.app.cli import _workload_arg
from harts_hf.lab.models import build_model
from harts_hf.lab.plan_report import bench_memory_model
from harts_hf.lab.planning import differing_fields, plan_together
from harts_hf.modeling import patch_model
from harts_hf.modeling.registry import patched_adapter
from harts_hf.modeling.tables import model_tables
from harts_hf.planner.plan import DEFAULT_MAX_TOKENS, plan
from harts_hf.schedule import rank_units
from harts_hf.sources import get_workload


def _cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="swe-like", help="a workload of harts_hf.sources (default swe-like)")
    parser.add_argument(
        "--set", action="append", default=[], type=_workload_arg, metavar="KEY=VALUE", help="a generator keyword"
    )
    parser.add_argument("--scale", type=float, default=1.0, help="swe-like length scale (default 1)")
    parser.add_argument("--num-tasks", type=int, default=5, help="swe-like tasks, 8 samples each (default 5)")
    parser.add_argument("--world-size", type=int, default=8, help="data-parallel ranks (default 8)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="microbatch budget")
    parser.add_argument("--model", help="price context with this bench family's memory model (default: as own tokens)")
    parser.add_argument("--plan-only", action="store_true", help="stop after the plan (no model, no compile)")
    parser.add_argument("--repeat", type=int, default=1, help="build and plan this many times (median printed)")
    parser.add_argument(
        "--context-parallel", action="store_true", help="plan with cross-rank handoffs and context-parallel groups"
    )
    parser.add_argument(
        "--planners",
        type=int,
        default=1,
        help="also plan with this many planners together (harts_hf.lab.planning: threads, then three of them "
        "alone on their records) and print their CPU seconds",
    )
    parser.add_argument("--sample", type=int, help="compile this many ranks, spread evenly (default: every rank)")
    parser.add_argument(
        "--rank",
        type=int,
        action="append",
        help="compile this rank (repeatable; instead of --sample): the first compile of a process is a step's, "
        "building the forest's cached arrays",
    )
    args = parser.parse_args()

    swe = {"scale": args.scale, "num_tasks": args.num_tasks} if args.workload == "swe-like" else {}
    workload = get_workload(args.workload, **swe | dict(args.set))
    memory = bench_memory_model(args.model) if args.model else None
    builds, plans = [], []
    options = {
        "world_size": args.world_size,
        "max_tokens_per_microbatch": args.max_tokens,
        "memory_model": memory,
        "context_parallel": args.context_parallel,
        "handoffs": args.context_parallel,
    }
    for _ in range(args.repeat):
        forest = None  # the last forest's memory is freed before the next build
        u0, s0 = _cpu()
        forest = workload.forest()
        u1, s1 = _cpu()
        builds.append((u1 - u0, s1 - s0))
        began = time.process_time()
        the_plan = plan(forest, **options)
        plans.append(time.process_time() - began)
    print(
        f"{args.workload} {swe | dict(args.set)}: {workload.num_trajectories:,} trajectories, "
        f"{workload.num_tokens:,} trajectory tokens, {forest.num_compact_tokens:,} compact"
    )
    print("forest build, CPU s (user + system): " + ", ".join(f"{u:.2f} + {s:.2f}" for u, s in builds))
    print(
        f"plan at {args.world_size} ranks, CPU s: {', '.join(f'{p:.2f}' for p in plans)} "
        f"(median {statistics.median(plans):.2f}); {the_plan.num_slots} slots of {args.max_tokens:,} tokens, "
        f"predicted step {the_plan.step_seconds:.3f} s"
    )
    if args.planners > 1:
        sampled = sorted({0, args.planners // 2, args.planners - 1})
        together = plan_together(forest, args.planners, sampled, **options)
        same = not any(differing_fields(p, the_plan) for p in together.plans)
        print(
            f"plan with {args.planners} planners together, CPU s of planners {sampled}: "
            f"{', '.join(f'{together.seconds[r]:.2f}' for r in sampled)} ({together.gathers[0]} gathers); "
            f"{'the same plan' if same else 'A DIFFERENT PLAN'}"
        )
    if args.plan_only:
        return
    hf, adapter = patched_adapter(patch_model(build_model("qwen3_5", max_positions=forest.max_length + 1).model))
    tables = model_tables(hf, adapter)
    seconds = []
    step = max(args.world_size // (args.sample or args.world_size), 1)
    for rank in args.rank or range(0, args.world_size, step):
        began = time.perf_counter()
        units = rank_units([forest], the_plan, rank, tables, "cpu")
        seconds.append(time.perf_counter() - began)
        tokens = sum(unit.tokens.size for unit in units)
        print(f"rank {rank}: {len(units)} units, {tokens:,} tokens, compiled in {seconds[-1]:.2f} s", flush=True)
    print(
        f"compile: {max(seconds):.2f} s (the slowest rank), {statistics.mean(seconds):.2f} s the mean, over "
        f"{len(seconds)} ranks; peak memory of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB"
    )


if __name__ == "__main__":
    main()
