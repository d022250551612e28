"""Context-parallel groups chosen by the planner (``harts_hf/planner/groups.py``): a trajectory longer
than the budget runs its pieces at once over idle ranks, one slot per group, when that lowers the
predicted step.

Invariants of such plans (every token owned once; the budget holds; every rank's schedule compiles,
so the groups' spans align and never wait on themselves: ``schedule.crossrank.check_groups``), the
choice following idle ranks, the option off by default, and, under ``torchrun`` (2 ranks, gloo), the
planned step trained exactly like the unpatched model and the single-process engine
(``cp_plan_worker.py``, over ``cross_rank_worker.run_case``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cp_plan_worker import BUDGET, SMALL_CONTEXT, cp_planned, long_chain
from launch import torchrun
from test_planner_handoffs import _owner_counts
from tiny_models import tiny_model

from harts_hf import RolloutForest, patch_model, plan
from harts_hf.modeling.registry import patched_adapter
from harts_hf.modeling.tables import model_tables
from harts_hf.schedule import Schedule


@pytest.fixture(scope="module")
def chain():
    return RolloutForest.from_sequences(long_chain())


def _same_slot_reads(p, forest) -> int:
    """Pieces whose parent token another rank computes in the same slot (a group's streamed reads)."""
    count = 0
    for r, s, start in zip(p.piece_rank, p.piece_slot, p.piece_start):
        parent = forest.prev[start]
        holds = (p.piece_start <= parent) & (parent < p.piece_end) & (p.piece_slot == s) & (p.piece_rank != r)
        count += bool(parent >= 0 and holds.any())
    return count


@pytest.mark.parametrize("world_size", [2, 3])
def test_group_plan_invariants(chain, world_size):
    """The chain's pieces, cut again at chunk-aligned depths, run in fewer slots, spread over every
    rank; each token owned once, every microbatch within the budget, and each rank's schedule compiles
    (groups aligned, no cycle)."""
    serial = cp_planned(chain, world_size, context_parallel=False)
    p = cp_planned(chain, world_size)
    assert serial.groups == 0 and (serial.tokens.sum(axis=1) > 0).sum() == 1 and serial.num_slots >= 3
    assert p.groups > 0 and p.group_ranks == world_size and p.group_bytes > 0
    assert p.num_slots < serial.num_slots and p.step_seconds < serial.step_seconds
    assert (p.tokens.sum(axis=1) > 0).all() and _same_slot_reads(p, chain) > 0
    assert (_owner_counts(p, chain) == 1).all()
    assert (p.budget.footprint(p.tokens, p.context) <= BUDGET).all()
    assert p.tokens.sum() == serial.tokens.sum() == chain.num_compact_tokens
    assert set(p.piece_start.tolist()) - {0} <= set(range(64, 448, 64))
    hf, adapter = patched_adapter(patch_model(tiny_model("qwen3_5")))
    tables = model_tables(hf, adapter)
    schedules = [Schedule.compile([chain], p, r, tables, torch.device("cpu")) for r in range(world_size)]
    assert all(s.units for s in schedules)
    again = cp_planned(chain, world_size)
    assert all(
        np.array_equal(getattr(p, k), getattr(again, k)) for k in ("piece_rank", "piece_slot", "piece_start", "cost")
    )


def test_busy_ranks_form_no_group():
    """Two such chains on two ranks: both ranks busy, nothing to group; on four ranks, each chain its group."""
    rng = np.random.default_rng(0)
    forest = RolloutForest.from_sequences([[int(t) for t in rng.integers(3, 120, 448)] for _ in range(2)])
    assert cp_planned(forest, 2).groups == 0
    p = cp_planned(forest, 4)
    assert p.groups >= 2 and p.group_ranks == 2 and (p.tokens.sum(axis=1) > 0).all()
    assert (_owner_counts(p, forest) == 1).all()


def test_off_by_default(chain):
    """Without ``context_parallel`` the chain runs serially on one rank while the other idles."""
    p = plan(chain, world_size=2, max_tokens_per_microbatch=BUDGET, memory_model=SMALL_CONTEXT)
    assert p.groups == 0 and (p.tokens.sum(axis=1) > 0).sum() == 1


CASES = ["qwen3_5:cp2:plain", "qwen3_5:cp2:ddp"]


@pytest.mark.slow
def test_planned_groups_train_exactly(tmp_path, capsys):
    """plan()'s context-parallel plan on two processes: log-probs and SGD gradients summed over ranks
    equal the unpatched model's trajectory by trajectory and the single-process engine's."""
    from test_cross_rank import _check

    torchrun("cp_plan_worker.py", 2, str(tmp_path), *CASES, timeout=600)
    with capsys.disabled():
        print("\n" + "\n".join(_check(tmp_path, CASES)))
