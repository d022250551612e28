"""Cross-rank handoffs at scale (issue 35, item 3): per workload and world size, the predicted step
of the planner without handoffs ("no exchange"), of its best handoff candidate (kept by ``plan``
only where lower), the lower bound ``max(unique work / R, longest path)``, redundancy before and
after, and the candidate's messages, GB moved and transfer seconds. Communication priced by the
built-in estimate (25 GB/s, 20 us per message) and, in a second row, NVLink-class (400 GB/s,
5 us). Planner CPU seconds (``time.process_time``) of ``plan(handoffs=True)`` per row.

    python scripts/handoff_grid.py                  # swe-like 1 and 4 at 64, grpo and caterpillar at 8-256
    python scripts/handoff_grid.py --model qwen3_5  # context priced with the bench model's memory model
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from harts_hf.lab.plan_report import bench_memory_model, lower_bound
from harts_hf.planner import DEFAULT_COST_MODEL, DEFAULT_MAX_TOKENS, plan
from harts_hf.planner.assign import BRANCH_RULES, find_branches
from harts_hf.planner.geometry import Geometry
from harts_hf.planner.handoffs import handoff_pieces
from harts_hf.planner.memory import TOKEN_MEMORY
from harts_hf.planner.plan import build_plan, with_transfers
from harts_hf.sources import get_workload

ROWS = [  # (label, workload, keywords, budget, world sizes)
    ("swe-like-1", "swe-like", {"scale": 1.0}, DEFAULT_MAX_TOKENS, (64,)),
    ("swe-like-4", "swe-like", {"scale": 4.0}, DEFAULT_MAX_TOKENS, (64,)),
    (
        "grpo-256x16",
        "grpo-group",
        {"groups": 256, "G": 16, "prompt_len": 1024, "max_completion": 4096},
        DEFAULT_MAX_TOKENS,
        (8, 64, 256),
    ),
    ("caterpillar-128x40", "caterpillar", {"trees": 128, "turns": 40}, 2_048, (8, 64, 256)),
]
NVLINK = {"byte": 2.5e-12, "message": 5e-6}


def candidate(forest, ours, cost):
    """The best handoff candidate's plan (priced) over every rule's branches, whether or not ``plan``
    kept it; None if none."""
    geo = Geometry.of([forest], cost)
    best = None
    for rule in BRANCH_RULES:
        options = [(find_branches(geo, ours.world_size, ours.budget.tokens, rule), None)]
        cuts = handoff_pieces(
            geo, options, ours.world_size, ours.budget, ours.chunk_size, cost, float("inf"), ours.memory_model, "budget"
        )
        for pieces, handed in cuts:
            made = build_plan(
                geo, [forest], pieces, cost, ours.budget, ours.memory_model, ours.chunk_size, 0.0, ours.world_size
            )
            made = with_transfers(made, geo, pieces, handed)
            if made is not None:
                if best is None or made.step_seconds < best.step_seconds:
                    best = made
                break
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="price context with this bench model's memory model")
    args = parser.parse_args()
    memory = bench_memory_model(args.model) if args.model else TOKEN_MEMORY
    head = (
        "shape",
        "R",
        "comm",
        "bound",
        "no exch",
        "handoff",
        "kept",
        "ratio",
        "red off",
        "red on",
        "msgs",
        "GB",
        "xfer s",
        "plan s",
    )
    print("  ".join(head))
    for label, name, kw, budget, ranks in ROWS:
        forest = get_workload(name, **kw).forest()
        for world in ranks:
            for comm, cost in (
                ("25GB/s", DEFAULT_COST_MODEL),
                ("NVLink", dataclasses.replace(DEFAULT_COST_MODEL, **NVLINK)),
            ):
                common = {
                    "world_size": world,
                    "max_tokens_per_microbatch": budget,
                    "memory_model": memory,
                    "cost_model": cost,
                }
                off = plan(forest, **common)
                began = time.process_time()
                on = plan(forest, **common, handoffs=True)
                seconds = time.process_time() - began
                cand = candidate(forest, off, cost)
                bound = lower_bound([forest], off)["seconds"]
                c = cand or off
                print(
                    f"{label}  {world}  {comm}  {bound:.4f}  {off.step_seconds:.4f}  "
                    f"{'-' if cand is None else format(cand.step_seconds, '.4f')}  {on.step_seconds:.4f}  "
                    f"{on.step_seconds / bound:.3f}  {off.redundancy:.4f}  {c.redundancy:.4f}  {c.handoffs}  "
                    f"{c.handoff_bytes / 1e9:.2f}  {c.handoff_seconds:.4f}  {seconds:.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
