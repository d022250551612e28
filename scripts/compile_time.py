"""Schedule compile time at scale: plan a swe-like step over R ranks, then compile every rank's
units (``harts_hf.schedule.rank_units``: token ids, tree tables, handoff addresses) for the
default bench model, and print the seconds of each. Ranks compile their own units in parallel,
so the step pays the largest rank's time.

    python scripts/compile_time.py                      # scale 1 (21.7M trajectory tokens), 8 ranks
    python scripts/compile_time.py --scale 0.1 --world-size 4
"""

from __future__ import annotations

import argparse
import time

from harts_hf.lab.models import build_model
from harts_hf.modeling import patch_model
from harts_hf.modeling.registry import patched_adapter
from harts_hf.modeling.tables import model_tables
from harts_hf.planner.plan import DEFAULT_MAX_TOKENS, plan
from harts_hf.schedule import rank_units
from harts_hf.sources import get_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="swe-like length scale (default 1)")
    parser.add_argument("--world-size", type=int, default=8, help="data-parallel ranks (default 8)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="microbatch budget")
    args = parser.parse_args()

    workload = get_workload("swe-like", scale=args.scale)
    forest = workload.forest()
    print(
        f"swe-like scale {args.scale}: {workload.num_tokens:,} trajectory tokens, {forest.num_compact_tokens:,} compact"
    )
    began = time.perf_counter()
    the_plan = plan(forest, world_size=args.world_size, max_tokens_per_microbatch=args.max_tokens)
    print(f"plan: {time.perf_counter() - began:.2f} s, {the_plan.num_slots} slots of {args.max_tokens:,} tokens")
    hf, adapter = patched_adapter(patch_model(build_model("qwen3_5", max_positions=forest.max_length + 1).model))
    tables = model_tables(hf, adapter)
    seconds = []
    for rank in range(args.world_size):
        began = time.perf_counter()
        units = rank_units([forest], the_plan, rank, tables, "cpu")
        seconds.append(time.perf_counter() - began)
        tokens = sum(unit.tokens.size for unit in units)
        print(f"rank {rank}: {len(units)} units, {tokens:,} tokens, compiled in {seconds[-1]:.2f} s", flush=True)
    print(f"compile: {max(seconds):.2f} s (the slowest rank), {sum(seconds):.2f} s over all ranks")


if __name__ == "__main__":
    main()
