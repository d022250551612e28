"""Worker of ``test_shared_root.py`` under ``torchrun`` (gloo, CPU): the plan ``plan()`` makes with
``context_parallel=True`` for trajectories under one long shared prompt (:func:`shared_prompt`), the
prompt split over the ranks as a group in slot 0 and read across ranks after it, run by
``cross_rank_worker.run_case`` (its references: the unpatched model trajectory by trajectory and the
single-process engine)."""

from __future__ import annotations

import cross_rank_worker
import numpy as np

from harts_hf import RolloutForest, plan
from harts_hf.planner import CostModel

CHEAP_CALLS = CostModel(
    token=2e-5, pair=1e-9, round=1e-4, microbatch=1e-4, message=0.0, context_bytes=1_024.0, state_bytes=20_000.0
)
"""Model calls cheap beside tokens (a large model's regime), a tiny model's bytes on the wire and no
message latency (a group streams a few messages a layer), so splitting a prompt of a few hundred
tokens pays."""


def shared_prompt(ranks: int = 2) -> list[list[int]]:
    """Two trajectories per rank under one prompt of two chunks per rank (the tiny models hold 512
    positions)."""
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, 120, 128 * ranks)]
    return [prompt + [int(t) for t in rng.integers(3, 120, 40 + 9 * i)] for i in range(2 * ranks)]


@cross_rank_worker.without_cuts
def root_planned(forest: RolloutForest, world_size: int = 2, context_parallel: bool = True):
    return plan(
        forest,
        world_size=world_size,
        max_tokens_per_microbatch=512,
        cost_model=CHEAP_CALLS,
        context_parallel=context_parallel,
        layers=3,
    )


if __name__ == "__main__":
    cross_rank_worker.main(
        {"root2": shared_prompt(2), "root3": shared_prompt(3)},
        {
            "cproot2": (2, "root2", root_planned),
            "cproot3": (3, "root3", lambda f: root_planned(f, 3)),
        },
    )
