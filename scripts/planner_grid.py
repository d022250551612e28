"""The planner grid: harts' predicted step beside each baseline's on the scale study's shapes, at
8, 64, 256 and 1,024 ranks, and the seconds harts takes to plan (issue 36, items 3 and 4).

Shapes (``harts_hf.sources`` generators, what ``harts-hf plan --workload NAME --set KEY=VALUE`` makes):
swe-like at scale 0.25, 1 and 4 (context priced with ``--model``'s memory model, so 131K-token
trajectories plan under the 64K budget), GRPO 256 prompts x 16 completions, a random forest of 3,000
nodes under 64 roots, 128 caterpillars of 40 turns. Every row: the step of harts and of every baseline
(``harts_hf.lab.baselines``; lower is better), harts over the best baseline (< 1: harts ahead), the CPU
seconds harts takes to plan (this process's: a loaded machine stretches the wall clock, not these). The
exact solver runs with ``--exact`` only (it is for small instances; its limit is ``--exact-seconds``).

    python scripts/planner_grid.py --quick             # the small shapes at 8 and 64 ranks
    python scripts/planner_grid.py                     # the whole grid (minutes: swe-like 4 is 16M tokens)
    python scripts/planner_grid.py --ranks 1024 --shapes swe-like-1 --json grid.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from harts_hf.lab.baselines import dfs_kcut, exact, per_trajectory, trie_packing
from harts_hf.lab.plan_report import bench_memory_model
from harts_hf.planner import DEFAULT_MAX_TOKENS, plan
from harts_hf.sources import get_workload

SMALL_BUDGET = 2_048
"""The budget of the small shapes (a few hundred tokens a trajectory): 64K would hold a whole rank."""

SHAPES = {  # name: (workload, generator keywords, budget, priced with the model's memory model)
    "swe-like-0.25": ("swe-like", {"scale": 0.25}, DEFAULT_MAX_TOKENS, True),
    "swe-like-1": ("swe-like", {"scale": 1.0}, DEFAULT_MAX_TOKENS, True),
    "swe-like-4": ("swe-like", {"scale": 4.0}, DEFAULT_MAX_TOKENS, True),
    "grpo-256x16": (
        "grpo-group",
        {"groups": 256, "G": 16, "prompt_len": 1024, "max_completion": 4096},
        DEFAULT_MAX_TOKENS,
        False,
    ),
    "random-tree-3000": ("random-tree", {"num_nodes": 3000, "roots": 64}, SMALL_BUDGET, False),
    "caterpillar-128x40": ("caterpillar", {"trees": 128, "turns": 40}, SMALL_BUDGET, False),
}
RANKS = (8, 64, 256, 1024)
QUICK = {"shapes": ("swe-like-0.25", "grpo-256x16", "random-tree-3000", "caterpillar-128x40"), "ranks": (8, 64)}
BASELINE_NAMES = ("per_trajectory", "trie_packing", "dfs_kcut", "exact")


def grid_row(forest, world: int, budget: int, memory, with_exact: bool, exact_seconds: float) -> dict:
    """harts and every baseline on one forest at one world size."""
    began = time.process_time()
    ours = plan(forest, world_size=world, max_tokens_per_microbatch=budget, memory_model=memory)
    seconds = time.process_time() - began
    args = ([forest], world, ours.budget, ours.cost_model)
    runs = {
        "per_trajectory": per_trajectory(*args),
        "trie_packing": trie_packing(*args),
        "dfs_kcut": dfs_kcut(*args, ours.chunk_size, ours.memory_model),
    }
    if with_exact:
        runs["exact"] = exact(*args, ours.chunk_size, ours.memory_model, exact_seconds)
    steps = {name: run.record()["step_seconds"] for name, run in runs.items()}
    best = min((s for s in steps.values() if s is not None), default=None)
    return {
        "world_size": world,
        "slots": ours.num_slots,
        "harts": ours.step_seconds,
        **steps,
        "ratio": None if best is None else ours.step_seconds / best,
        "plan_seconds": seconds,
    }


def _cell(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK['shapes'])} at 8 and 64 ranks")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="these shapes only")
    parser.add_argument("--ranks", nargs="+", type=int, help=f"these world sizes (default {RANKS})")
    parser.add_argument("--model", default="qwen3_5", help="the bench family whose memory model prices swe-like")
    parser.add_argument("--exact", action="store_true", help="run the exact (CP-SAT) baseline too")
    parser.add_argument("--exact-seconds", type=float, default=10.0, help="its time limit per row")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    shapes = args.shapes or (QUICK["shapes"] if args.quick else tuple(SHAPES))
    ranks = args.ranks or (QUICK["ranks"] if args.quick else RANKS)
    names = ("harts", *BASELINE_NAMES[: 4 if args.exact else 3])
    memory = bench_memory_model(args.model, "default") if any(SHAPES[s][3] for s in shapes) else None
    head = ["shape", "R", "S", *names, "harts/best", "plan cpu s"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head), flush=True)
    rows = []
    for shape in shapes:
        workload, kwargs, budget, priced = SHAPES[shape]
        forest = get_workload(workload, **kwargs).forest()
        for world in ranks:
            row = {
                "shape": shape,
                **grid_row(forest, world, budget, memory if priced else None, args.exact, args.exact_seconds),
            }
            rows.append(row)
            cells = [shape, str(world), str(row["slots"]), *(_cell(row.get(n), ".4f") for n in names)]
            print(
                "| " + " | ".join([*cells, _cell(row["ratio"], ".4f"), f"{row['plan_seconds']:.2f}"]) + " |", flush=True
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
