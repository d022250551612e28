"""Worker of ``test_planner_groups.py`` under ``torchrun`` (gloo, CPU): the plan ``plan()`` makes
with ``context_parallel=True`` for one trajectory several times the budget (:func:`long_chain`) on
two ranks, cut again into spans of equal cost, run by ``cross_rank_worker.run_case`` (its references: the unpatched
model trajectory by trajectory and the single-process engine)."""

from __future__ import annotations

import cross_rank_worker
import numpy as np

from harts_hf import RolloutForest, plan
from harts_hf.planner.memory import MemoryModel

BUDGET = 150
SMALL_CONTEXT = MemoryModel(token=1.0, context=0.1)
"""A context token at a tenth of an own token: the 448-token chain plans in pieces of the 150-token budget."""


def long_chain() -> list[list[int]]:
    """One trajectory of 448 tokens: seven GDN chunks (the tiny models hold 512 positions), room for
    spans cut at chunk-aligned depths."""
    return [[int(t) for t in np.random.default_rng(0).integers(3, 120, 448)]]


def cp_planned(forest: RolloutForest, world_size: int = 2, context_parallel: bool = True):
    return plan(
        forest,
        world_size=world_size,
        max_tokens_per_microbatch=BUDGET,
        memory_model=SMALL_CONTEXT,
        context_parallel=context_parallel,
    )


if __name__ == "__main__":
    cross_rank_worker.main({"long": long_chain()}, {"cp2": (2, "long", cp_planned)})
