"""Context-parallel groups chosen by the planner (``harts_hf/planner/groups.py``): a trajectory longer
than the budget runs its pieces at once over idle ranks, or spread over the free time busy ranks have in
a slot, when that lowers the predicted step.

Invariants of such plans (every token owned once; the budget holds; every rank's schedule compiles,
so the groups' spans align and never wait on themselves: ``schedule.crossrank.check_groups``), the
choice following idle ranks and free time, a plan left piece for piece as it was where groups do not
pay, the option off by default, and, under ``torchrun`` (2 ranks, gloo), the planned steps trained
exactly like the unpatched model and the single-process engine (``cp_plan_worker.py``, over
``cross_rank_worker.run_case``).
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch
from cp_plan_worker import BUDGET, SMALL_CONTEXT, SPREAD_CHUNK, busy_rows, cp_planned, long_chain, spread_planned
from launch import torchrun
from test_planner_handoffs import _owner_counts
from test_planner_invariants import case_plan
from tiny_models import tiny_model

from harts_hf import RolloutForest, patch_model, plan
from harts_hf.forest import sorted_unique
from harts_hf.modeling.registry import patched_adapter
from harts_hf.modeling.tables import model_tables
from harts_hf.ops.rounds import RoundsTable
from harts_hf.ops.tree_batch import TreeBatch
from harts_hf.planner import CostModel, MemoryModel
from harts_hf.planner.cost import DEFAULT_COST_MODEL
from harts_hf.planner.geometry import Geometry
from harts_hf.planner.groups import group_pieces, spread_pieces
from harts_hf.planner.memory import TOKEN_MEMORY, Budget
from harts_hf.planner.pieces import Pieces
from harts_hf.planner.plan import build_plan
from harts_hf.schedule import Schedule, rank_units
from harts_hf.sources import deep_chain


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
    assert all(s.units for s in _schedules(p, chain))
    again = cp_planned(chain, world_size)
    assert all(
        np.array_equal(getattr(p, k), getattr(again, k)) for k in ("piece_rank", "piece_slot", "piece_start", "cost")
    )


def _schedules(p, forest) -> list[Schedule]:
    """Every rank's compiled schedule of ``p`` (``Schedule.compile`` checks the groups: aligned, no cycle)."""
    hf, adapter = patched_adapter(patch_model(tiny_model("qwen3_5")))
    tables = model_tables(hf, adapter)
    return [Schedule.compile([forest], p, r, tables, torch.device("cpu")) for r in range(p.world_size)]


@pytest.mark.parametrize("world_size, per_rank", [(2, 4), (3, 8)])
def test_free_time_forms_groups(world_size, per_rank):
    """A GRPO step's rows, one trajectory three budgets long: every rank has work, but the long one's
    rank works longest in some slots; there the chain's piece spreads over microbatches with free time
    (busy ones among them), cut on the chunk grid, and the predicted step drops. Each token owned once,
    the budget holds, every rank's schedule compiles."""
    forest = RolloutForest.from_sequences(busy_rows(world_size, per_rank))
    serial = spread_planned(forest, world_size, context_parallel=False)
    p = spread_planned(forest, world_size)
    assert serial.groups == 0 and (serial.tokens.sum(axis=1) > 0).all()
    assert p.groups > 0 and p.group_bytes > 0 and p.step_seconds < serial.step_seconds
    assert p.num_slots == serial.num_slots and ((p.tokens > serial.tokens) & (serial.tokens > 0)).any()
    assert _same_slot_reads(p, forest) > 0
    assert (_owner_counts(p, forest) == 1).all()
    assert (p.budget.footprint(p.tokens, p.context) <= BUDGET).all()
    assert p.tokens.sum() == serial.tokens.sum()
    long = forest.restore[: forest.traj_offsets[1]]  # the long trajectory's compact tokens, root first
    cuts = np.intersect1d(p.piece_start, long[1:])
    assert cuts.size > 0 and (np.searchsorted(long, cuts) % SPREAD_CHUNK == 0).all()
    assert all(s.units for s in _schedules(p, forest))


def test_a_chain_read_in_its_own_microbatch_stays_whole():
    """An RLOO step on 3 ranks: one 407-token prompt shared by 8 rows of short completions, beside 4
    rows of a 2-token prompt. A rank's last slot holds the prompt's last chain piece with the rows'
    completions below it; cut into spans, its later spans would run on another rank at the same call
    while the completions read them (a group waiting on itself, the context miscounted): the piece
    stays whole, and every rank's schedule compiles."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(8, 100, 407).tolist()
    rows = [prompt + rng.integers(8, 100, n).tolist() for n in (8, 3, 8, 8)]
    rows += [[5, 6] + rng.integers(8, 100, 8).tolist() for _ in range(4)]
    rows += [prompt + rng.integers(8, 100, n).tolist() for n in (8, 5, 8, 4)]
    forest = RolloutForest.from_sequences(rows)
    p = spread_planned(forest, 3, layers=3)
    assert (_owner_counts(p, forest) == 1).all()
    assert all(s.units for s in _schedules(p, forest))


def test_a_span_below_a_root_its_microbatch_computes():
    """A DPO step on 2 ranks: rank 0 two pairs of 12-token prompts, rank 1 one such pair and one of a
    440-token prompt whose first token is the first of a rank-0 prompt (one root). The long chain's
    spans land in rank 0's microbatches, one beside that root's own piece: the root is on the span's path
    but computed in the call, not read as context. Each microbatch's context is what its call reads,
    and every rank's schedule compiles."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(8, 100, n).tolist() for n in (12, 12, 12, 440)]
    prompts[3][0] = prompts[1][0]
    rows = []
    for mine in (prompts[:2], prompts[2:]):  # per rank its pairs: chosen rows, then rejected rows
        rows += [p + [5, 6, 2] for p in mine] + [p + [7, 2] for p in mine]
    forest = RolloutForest.from_sequences(rows)
    p = spread_planned(forest, 2, layers=3)
    assert p.groups > 0 and _same_slot_reads(p, forest) > 0
    for r in range(p.world_size):
        for s in range(p.num_slots):
            calls = [TreeBatch.from_forest(forest, sorted_unique(tokens)) for _, tokens in p.microbatch(r, s)]
            assert sum(c.num_context for c in calls) == p.context[r, s]
    assert all(s.units for s in _schedules(p, forest))


def test_spreading_never_raises_the_step():
    """Where groups do not pay (the built-in cost model: a tiny model's microbatch is mostly fixed
    overhead; or nothing to spread), the plan is the one made without ``context_parallel``, piece for
    piece; where they do, the predicted step is lower."""
    rng = np.random.default_rng(3)
    for world_size in (2, 3):
        forests = [RolloutForest.from_sequences(busy_rows(world_size))]
        forests += [
            RolloutForest.from_sequences([rng.integers(8, 100, n).tolist() for n in rng.integers(10, 400, 6)])
            for _ in range(3)
        ]
        for forest in forests:
            for make in (cp_planned, spread_planned):
                off, on = make(forest, world_size, context_parallel=False), make(forest, world_size)
                assert on.step_seconds <= off.step_seconds
                if on.groups == 0:
                    assert all(
                        np.array_equal(getattr(on, k), getattr(off, k))
                        for k in ("piece_rank", "piece_slot", "piece_start", "piece_end", "cost")
                    )
    busy = RolloutForest.from_sequences(busy_rows(2))
    assert cp_planned(busy, 2).groups == 0


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


CASES = ["qwen3_5:cp2:plain", "qwen3_5:cp2:ddp", "qwen3_5:cpspread2:ddp"]


@pytest.mark.slow
def test_planned_groups_train_exactly(tmp_path, capsys):
    """plan()'s context-parallel plans on two processes (idle rank; free time beside other rows): log-probs
    and SGD gradients summed over ranks equal the unpatched model's trajectory by trajectory and the
    single-process engine's."""
    from test_cross_rank import _check

    torchrun("cp_plan_worker.py", 2, str(tmp_path), *CASES, timeout=600)
    with capsys.disabled():
        print("\n" + "\n".join(_check(tmp_path, CASES)))


def test_a_spread_keeps_its_first_span_on_the_pieces_rank():
    """A chain spread over free time keeps its first span on its own rank, beside its context (found by
    the random-forest test): water-filled, that rank's share here was nothing, so the spans landed on
    two other ranks, reading the chain's ancestors from a rank that runs the forest at another call
    position, and the schedule refused the plan. Three forests on five ranks, attention only."""
    rng = np.random.default_rng(0)
    seg = lambda n: rng.integers(3, 30_000, n).tolist()
    chain = seg(168)
    deep = [chain[:56] + seg(17), chain[:112] + seg(17), chain + seg(17), chain + seg(73)]
    trunk = [seg(n) for n in (7, 9, 8, 5, 9, 9, 9, 1, 5)]  # a caterpillar: its trunk, a leg under each node
    legs = [seg(n) for n in (6, 3, 4, 6, 8, 6, 2, 7)]
    prefix = list(itertools.accumulate(trunk))  # the trunk down to each node's end
    rows = [prefix[i] + leg for i, leg in enumerate(legs)] + [prefix[-1] + seg(8), prefix[-1] + seg(2), prefix[-1]]
    forests = [RolloutForest.from_sequences(s) for s in ([seg(146)], rows, deep)]
    case = (forests, 5, 842, 8, CostModel(0.0, 1.0, 10.0, 5.0), MemoryModel(token=4.0, context=10.0))
    p = case_plan(case, context_parallel=True)
    for r in range(5):
        rank_units(forests, p, r, frozenset({RoundsTable(8)}), "cpu")  # refused before: ValueError


def test_a_spread_lands_only_on_ranks_without_a_copy_of_its_tokens():
    """A chain spread over free time never lands on a rank that holds a replica of its tokens in
    another slot, which would then compute them twice (found by the random-forest test; the
    schedule refused the plan): three deep chains of branches on five ranks, an 18-token budget."""
    rng = np.random.default_rng(5)  # the random-forest test's draw of seed 5
    forests = [
        deep_chain(int(rng.integers(2, 45)), fanout=int(rng.integers(2, 4)), seed=5 + k).forest() for k in range(3)
    ]
    case = (forests, 5, 18, 4, CostModel(0.0, 1.0, 0.0, 0.0), MemoryModel(token=4.0, context=0.0))
    p = case_plan(case, context_parallel=True)
    assert p.groups > 0
    for r in range(5):
        rank_units(forests, p, r, frozenset({RoundsTable(4)}), "cpu")  # refused before: ValueError


def _trunk_beside(other: int, trunk: int, chain: int, leaf: int, rows: list, slots: int, budget: int):
    """(geometry, plan) of a hand-built 3-rank plan of two forests: one ``other``-token row, and a
    ``trunk`` continued by a ``chain`` and a ``leaf``; ``rows`` its pieces (rank, slot, global DFS
    start and end, branch, replica) in ``slots`` slots under a ``budget`` of tokens."""
    rng = np.random.default_rng(0)
    seg = lambda n: rng.integers(3, 30_000, n).tolist()
    shared = seg(trunk)
    forests = [
        RolloutForest.from_sequences([seg(other)]),
        RolloutForest.from_sequences([shared + seg(chain), shared + seg(leaf)]),
    ]
    geo = Geometry.of(forests, DEFAULT_COST_MODEL)
    pieces = Pieces(*(np.array(c) for c in zip(*rows)), slots)
    return geo, build_plan(
        geo, forests, pieces, DEFAULT_COST_MODEL, Budget(budget), TOKEN_MEMORY, 4, time.perf_counter(), 3
    )


def test_a_spread_leaves_a_chain_whose_ancestors_another_rank_owns_in_its_slot():
    """Rank 0 owns a trunk and runs a second forest first; rank 1 recomputes the trunk and continues it
    with a long chain; rank 2 idles. Spread over rank 2, the chain's second span would read the trunk
    from its owner, rank 0, at another call position (found by the random-forest test; the schedule
    refused the plan): the chain is not spread."""
    a, t, x = 110, 110 + 451, 110 + 451 + 2000  # forest B: the trunk [a, t), the chain [t, x), a leaf [x, x + 11)
    rows = [(0, 0, 0, a, 0, False), (0, 0, a, t, -1, False), (0, 0, x, x + 11, 2, False)]
    rows += [(1, 0, a, t, -1, True), (1, 0, t, x, 1, False)]
    geo, base = _trunk_beside(110, 451, 2000, 11, rows, 1, 10_000)
    assert int(np.argmax(base.cost[:, 0])) == 1 and base.tokens[2, 0] == 0  # the chain's rank is the busiest
    assert spread_pieces(base, geo, 4) is None


def test_idle_ranks_leave_a_serial_rank_that_recomputes_what_another_owns_then():
    """Rank 0 owns a trunk in slot 0 and runs a second forest first; rank 1 recomputes the trunk and
    runs a long chain under it over two slots; rank 2 idles. Moved onto rank 2, the chain's later
    span would read the trunk from its owner, rank 0, at another call position (found by the
    random-forest test with handoffs; the schedule refused the plan): rank 1 is left serial."""
    rows = [(0, 0, 0, 50, 0, False), (0, 0, 50, 150, -1, False), (0, 0, 350, 360, 2, False)]
    rows += [(1, 0, 50, 150, -1, True), (1, 0, 150, 250, 1, False), (1, 1, 250, 350, 1, False)]
    geo, base = _trunk_beside(50, 100, 200, 10, rows, 2, 1_000)
    assert base.tokens[2].sum() == 0 and (base.tokens[1] > 0).all()  # rank 1 serial, rank 2 idle
    assert group_pieces(base, geo, 4) is None
