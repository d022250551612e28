"""A shared root chain split over ranks (``harts_hf/planner/shared_root.py``): the prompt every rank
would recompute runs once, as a context-parallel group in a new first slot, and is read across ranks.

Invariants of such plans (every token owned once, no root token recomputed, the budget holds,
every read from an earlier slot or the group's own slot, every rank's schedule compiles), the choice
following the cost model, the option off by default, and, under ``torchrun`` (gloo), the planned
step trained exactly like the unpatched model and the single-process engine on 2 and 3 ranks
(``shared_root_plan_worker.py``, over ``cross_rank_worker.run_case``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from launch import torchrun
from shared_root_plan_worker import CHEAP_CALLS, root_planned, shared_prompt
from test_planner_handoffs import _owner_counts
from tiny_models import tiny_model

from harts_hf import RolloutForest, patch_model
from harts_hf.modeling.registry import patched_adapter
from harts_hf.modeling.tables import model_tables
from harts_hf.schedule import Schedule


@pytest.mark.parametrize("ranks", [2, 3])
def test_root_group_plan_invariants(ranks):
    forest = RolloutForest.from_sequences(shared_prompt(ranks))
    p = root_planned(forest, ranks)
    serial = root_planned(forest, ranks, context_parallel=False)
    root_end = 128 * ranks  # the prompt: the forest's first tokens
    assert p.groups == 1 and p.group_ranks == ranks and p.handoffs > 0
    assert p.step_seconds < serial.step_seconds and p.replicated_tokens == 0 < serial.replicated_tokens
    assert (_owner_counts(p, forest) == 1).all()
    assert (p.budget.footprint(p.tokens, p.context) <= p.budget.tokens).all()
    spans = p.piece_slot == 0
    assert sorted(p.piece_rank[spans]) == list(range(ranks)) and (p.piece_end[spans] <= root_end).all()
    assert (p.piece_start[~spans] >= root_end).all()  # no later piece holds a root token
    for r, s, start in zip(p.piece_rank, p.piece_slot, p.piece_start):
        parent = forest.prev[start]
        holds = (p.piece_start <= parent) & (parent < p.piece_end)
        earlier = holds & ((p.piece_slot < s) | ((p.piece_slot == s) & (p.piece_rank == r)))
        assert parent < 0 or earlier.any() or (s == 0 and (holds & (p.piece_slot == 0)).any()), (r, s, start)
    hf, adapter = patched_adapter(patch_model(tiny_model("qwen3_5")))
    tables = model_tables(hf, adapter)
    schedules = [Schedule.compile([forest], p, r, tables, torch.device("cpu")) for r in range(ranks)]
    assert all(s.units for s in schedules)


def test_only_the_roots_readers_are_priced():
    """Beside another tree in the same forest, the root's group is read (and priced: one message a
    pair of span rank and reading rank) by the ranks holding its tree's later pieces only."""
    other = np.random.default_rng(5)
    seqs = shared_prompt(3) + [[1, *other.integers(3, 120, 90).tolist()] for _ in range(3)]
    forest = RolloutForest.from_sequences(seqs)
    p = root_planned(forest, 3)
    assert p.groups == 1 and p.group_ranks == 3

    def root_id(t: int) -> int:
        while forest.prev[t] >= 0:
            t = forest.prev[t]
        return int(forest.tokens[t])

    readers = {int(r) for r, s, t in zip(p.piece_rank, p.piece_slot, p.piece_start) if s > 0 and root_id(t) != 1}
    others = {int(r) for r, s, t in zip(p.piece_rank, p.piece_slot, p.piece_start) if s > 0 and root_id(t) == 1}
    assert others - readers  # a rank holding only the other tree
    assert p.handoffs == sum(q != r for q in range(3) for r in readers)


def test_the_cost_model_decides():
    """Off by default; not kept where moving the prompt costs more than recomputing it; not on one rank."""
    forest = RolloutForest.from_sequences(shared_prompt(2))
    assert root_planned(forest, 2, context_parallel=False).groups == 0
    slow_link = dataclasses.replace(CHEAP_CALLS, byte=1e-3)
    from harts_hf import plan

    p = plan(forest, world_size=2, max_tokens_per_microbatch=512, cost_model=slow_link, context_parallel=True)
    assert p.groups == 0 and p.replicated_tokens > 0
    assert root_planned(forest, 1).groups == 0


CASES = {
    2: ["qwen3_5:cproot2:plain", "qwen3_5:cproot2:ddp"],
    3: ["qwen3_5:cproot3:checkpointing", "kimi_linear:cproot3:plain"],
}


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_root_group_trains_exactly(ranks, tmp_path, capsys):
    """plan()'s root group on 2 and 3 processes (plain, DDP, checkpointing; GDN + attention, KDA +
    MLA): log-probs and SGD gradients summed over ranks equal the unpatched model's trajectory by
    trajectory and the single-process engine's."""
    from test_cross_rank import _check

    torchrun("shared_root_plan_worker.py", ranks, str(tmp_path), *CASES[ranks], timeout=600)
    with capsys.disabled():
        print("\n" + "\n".join(_check(tmp_path, CASES[ranks])))
