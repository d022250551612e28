"""Worker of ``test_planner_groups.py`` under ``torchrun`` (gloo, CPU): the plan ``plan()`` makes
with ``context_parallel=True`` for one trajectory several times the budget (:func:`long_chain`) on
two ranks, cut again into spans of equal cost, and the plan spreading :func:`busy_rows`' long trajectory
over the other rank's free time, run by ``cross_rank_worker.run_case`` (its references: the unpatched
model trajectory by trajectory and the single-process engine)."""

from __future__ import annotations

import dataclasses

import cross_rank_worker
import numpy as np

from harts_hf import RolloutForest, plan
from harts_hf.planner.cost import DEFAULT_COST_MODEL, CostModel
from harts_hf.planner.memory import MemoryModel

BUDGET = 150
SMALL_CONTEXT = MemoryModel(token=1.0, context=0.1)
"""A context token at a tenth of an own token: the 448-token chain plans in pieces of the 150-token budget."""


def long_chain() -> list[list[int]]:
    """One trajectory of 448 tokens: seven GDN chunks (the tiny models hold 512 positions), room for
    spans cut at chunk-aligned depths."""
    return [[int(t) for t in np.random.default_rng(0).integers(3, 120, 448)]]


SPREAD_COST = {"token": 1e-5, "pair": 0.0, "round": 0.0, "microbatch": 1e-4, "byte": 0.0, "message": 0.0}
"""A cost model where a microbatch's fixed overhead is small next to its tokens and moving a span is free:
spreading a chain over the other ranks' free time in a slot pays."""
SPREAD_CHUNK = 16
"""A finer cut grid than the kernels' 64: a 150-token piece of the chain has cut points to spread over."""


def busy_rows(world_size: int, per_rank: int = 4) -> list[list[int]]:
    """A GRPO step's rows, rank-major: row 0 a trajectory of 448 tokens (three budgets), every other row
    30 tokens of its own (14 prompt, 16 completion), so every rank has work; ids in 8..99 (no special
    token of ``harts_hf.sources.tokenizer``)."""
    rng = np.random.default_rng
    return [rng([1, row]).integers(8, 100, 448 if row == 0 else 30).tolist() for row in range(world_size * per_rank)]


QUIET_LINK = dataclasses.replace(DEFAULT_COST_MODEL, message=0.0)
"""The built-in cost model without a message's latency: a group streams a few messages a layer, which
on the built-in link cost more than a tiny model's microseconds of compute."""


@cross_rank_worker.without_cuts
def cp_planned(forest: RolloutForest, world_size: int = 2, context_parallel: bool = True, **options):
    return plan(
        forest,
        world_size=world_size,
        max_tokens_per_microbatch=BUDGET,
        memory_model=SMALL_CONTEXT,
        context_parallel=context_parallel,
        **{"cost_model": QUIET_LINK} | options,
    )


def spread_planned(forest: RolloutForest, world_size: int = 2, context_parallel: bool = True, **options):
    """:func:`cp_planned` under :data:`SPREAD_COST` on the :data:`SPREAD_CHUNK` grid."""
    options |= {"cost_model": CostModel(**SPREAD_COST), "chunk_size": SPREAD_CHUNK}
    return cp_planned(forest, world_size, context_parallel, **options)


if __name__ == "__main__":
    cross_rank_worker.main(
        {"long": long_chain(), "busy": busy_rows(2)},
        {"cp2": (2, "long", cp_planned), "cpspread2": (2, "busy", spread_planned)},
    )
