"""Worker of ``test_planner_handoffs.py`` under ``torchrun`` (gloo, CPU): the plan ``plan()`` makes
with ``handoffs=True`` for :func:`tasks_forest`, run by ``cross_rank_worker.run_case`` (its
references: the unpatched model trajectory by trajectory and the single-process engine)."""

from __future__ import annotations

import cross_rank_worker
import numpy as np

from harts_hf import RolloutForest, plan
from harts_hf.planner import CostModel

FREE_COMM = CostModel(token=1e-5, pair=0.0, round=0.0, microbatch=0.0, byte=0.0, message=0.0)
"""Tokens cost, nothing else: handing a shared chain over beats recomputing it."""

BUDGET = 1000


def tasks_forest(scale: int = 30) -> list[list[int]]:
    """A short system prompt over two task prompts of ``2 * scale`` tokens, six samples of ``scale``
    tokens under the first task and two under the second: on two ranks the first task's samples
    are divided, so its prompt is either recomputed on both or handed over."""
    rng = np.random.default_rng(0)
    seg = lambda n: [int(t) for t in rng.integers(3, 120, n)]
    system, first, second = seg(max(1, scale // 6)), seg(2 * scale), seg(2 * scale)
    return [system + first + seg(scale) for _ in range(6)] + [system + second + seg(scale) for _ in range(2)]


def planned(forest: RolloutForest):
    return plan(forest, world_size=2, max_tokens_per_microbatch=BUDGET, cost_model=FREE_COMM, handoffs=True)


if __name__ == "__main__":
    cross_rank_worker.main({"tasks": tasks_forest()}, {"planned2": (2, "tasks", planned)})
