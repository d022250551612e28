"""Worker of ``test_cross_rank.py::test_random_plans_equal_the_oracles`` under ``torchrun`` (gloo,
CPU): ``plan()``'s own context-parallel plans of random agentic forests (no forest or plan built for
a test), each run by ``cross_rank_worker.run_case`` on a family and a wrapper in turn; rank 0 saves
each case's log-probs and gradients beside the unpatched model's and the single-process engine's.

Every rank plans each case with the others (``planners.py``), and the plan must be the one a
process makes alone.

argv: the output folder, the first seed, how many cases (seeds that give a plan with no cross-rank
read are passed over)."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import cross_rank_worker
import numpy as np
import torch.distributed as dist

from harts_hf import RolloutForest, plan
from harts_hf.lab.planning import differing_fields
from harts_hf.planner.cost import DEFAULT_COST_MODEL
from harts_hf.planner.memory import MemoryModel
from harts_hf.planner.plan import Plan
from harts_hf.planner.planners import ALONE, Planners

FAMILIES = (
    "qwen3_5",
    "kimi_linear",
    "nemotron_h",
    "falcon_h1",
    "jamba",
    "minimax",
    "lfm2",
    "zamba2",
    "gemma2",
    "mamba",
    "mamba2",
)
"""Every layer kind: GDN, KDA + MLA, Mamba2, Mamba2 beside attention, Mamba1, lightning, conv, a
shared attention block, sliding windows; and models with no attention at all (the plan's context
rows read by no layer)."""
WRAPPERS = ("plain", "ddp", "checkpointing", "fsdp2")


def random_rows(rng: np.random.Generator) -> list[list[int]]:
    """An agentic batch (a system prompt, tasks, turns and branches off them), a chain several budgets
    deep with branches, or GRPO groups; every row within the tiny models' 512 positions."""
    seg = lambda n: [int(t) for t in rng.integers(3, 120, int(n))]
    rows = []
    kind = rng.integers(3)
    if kind == 0:
        system = seg(rng.integers(5, 60))
        for _ in range(rng.integers(1, 4)):
            task = system + seg(rng.integers(1, 30))
            for _ in range(rng.integers(1, 4)):
                trunk = task + seg(rng.integers(5, 90))
                rows.append(trunk)
                rows += [
                    trunk[: rng.integers(len(task), len(trunk) + 1)] + seg(rng.integers(1, 40))
                    for _ in range(rng.integers(3))
                ]
    elif kind == 1:
        chain = seg(rng.integers(100, 400))
        rows = [chain] + [
            chain[: rng.integers(1, len(chain))] + seg(rng.integers(1, 60)) for _ in range(rng.integers(1, 5))
        ]
    else:
        for _ in range(rng.integers(1, 4)):
            prompt = seg(rng.integers(5, 80))
            rows += [prompt + seg(rng.integers(1, 80)) for _ in range(rng.integers(2, 6))]
    return [row[:500] for row in rows]


def random_plan(seed: int, world_size: int, planners: Planners = ALONE) -> tuple[list[list[int]], Plan | None]:
    """The rows of ``seed`` and ``plan()``'s context-parallel plan of them over ``world_size`` ranks under
    a random budget, memory model (context from free to half an own token), link (free or the
    built-in one), chunk grid and host memory (none, or room for every graph the budget cannot keep:
    they wait there instead of rerunning), made by ``planners``; None where the budget is below what
    the rows need."""
    rng = np.random.default_rng(seed)
    rows = random_rows(rng)
    link = float(rng.choice([0.0, 1.0]))
    cost = dataclasses.replace(
        DEFAULT_COST_MODEL, byte=DEFAULT_COST_MODEL.byte * link, message=DEFAULT_COST_MODEL.message * link
    )
    try:
        return rows, plan(
            RolloutForest.from_sequences(rows),
            world_size=world_size,
            max_tokens_per_microbatch=int(rng.integers(40, 260)),
            memory_model=MemoryModel(token=1.0, context=float(rng.choice([0.0, 0.1, 0.5]))),
            cost_model=cost,
            chunk_size=int(rng.choice([16, 64])),
            context_parallel=True,
            planners=planners,
            max_host_bytes=float(rng.choice([0.0, 1e9])),  # drawn last: the draws above are the seed's as before
        )
    except ValueError:  # a budget below the longest row's context
        return rows, None


def cases(first: int, count: int, world_size: int) -> tuple[dict, dict, list[str]]:
    """(forests, plans, case names) of the first ``count`` seeds from ``first`` whose plan reads across ranks."""
    forests, plans, names, seed = {}, {}, [], first
    while len(names) < count:
        rows, p = random_plan(seed, world_size)
        if p is not None and p.handoffs + p.groups > 0:
            family, wrapper = FAMILIES[len(names) % len(FAMILIES)], WRAPPERS[len(names) % len(WRAPPERS)]
            forests[f"random{seed}"] = rows
            plans[f"random{seed}"] = (world_size, f"random{seed}", lambda _, p=p: p)
            names.append(f"{family}:random{seed}:{wrapper}")
        seed += 1
    return forests, plans, names


def together(seed: int, alone: Plan, forest: RolloutForest) -> Plan:
    """Seed ``seed``'s plan (of ``forest``) made by the launch's ranks together (``planners.py``, over
    gloo), which must be ``alone``, the plan one process makes."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def gather(obj: object) -> list:
        out = [None] * world
        dist.all_gather_object(out, obj)
        return out

    made = random_plan(seed, world, Planners(rank, world, gather))[1]
    assert not (differ := differing_fields(made, alone)), f"seed {seed}: planned together, {differ} differ"
    return made


if __name__ == "__main__":
    forests, plans, names = cases(int(sys.argv[2]), int(sys.argv[3]), int(os.environ["WORLD_SIZE"]))
    for name, (world, kind, make) in plans.items():  # run the plans the ranks make together
        plans[name] = (world, kind, functools.partial(together, int(name.removeprefix("random")), make(None)))
    sys.argv = [sys.argv[0], sys.argv[1], *names]
    cross_rank_worker.main(forests, plans)
