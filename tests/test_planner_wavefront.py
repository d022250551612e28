"""The forests' DFS order cut into one span per (slot, rank) (``harts_hf/planner/wavefront.py``).

Invariants of the cut as ``plan()`` keeps it (every token once, no recomputed chain; slot-major spans
of the DFS order, so reads inside a slot go from a lower rank to a higher one; the budget holds; every
rank's schedule compiles, groups aligned and acyclic), its pricing (a chain of spans takes the layer
wavefront; cross-rank reads of rows and chunk-grid states), the choice (a deep chain of branches,
8x the budget, where the rank-wise plan recomputes the chain: kept; refused where a read would join
calls at different positions). Exactness under ``torchrun`` is in ``test_cross_rank.py``
(``cpwave2``, ``cpwave3``: plan()'s cut of a deep tree at 2 and 3 ranks).
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch
from cross_rank_worker import forest_of, wavefront_plan
from hypothesis import given, settings
from test_planner_groups import _schedules
from test_planner_handoffs import _owner_counts
from test_planner_invariants import case_plan, cases
from tiny_models import tiny_model

from harts_hf import RolloutForest, patch_model, plan
from harts_hf.modeling.registry import patched_adapter
from harts_hf.modeling.tables import model_tables
from harts_hf.ops.rounds import RoundsTable
from harts_hf.planner.cost import DEFAULT_COST_MODEL
from harts_hf.planner.crossreads import _wavefront, priced
from harts_hf.planner.geometry import Geometry
from harts_hf.planner.memory import MemoryModel
from harts_hf.planner.plan import build_plan
from harts_hf.planner.wavefront import _pieces, _span_starts, wavefront_cut
from harts_hf.schedule import Schedule, rank_units
from harts_hf.sources import get_workload


def _spans(p) -> list[tuple[int, int, int, int]]:
    """(slot, rank, first, end) of each microbatch's tokens, in slot-major order."""
    out = []
    for s in range(p.num_slots):
        for r in range(p.world_size):
            mine = (p.piece_rank == r) & (p.piece_slot == s)
            if mine.any():
                out.append((s, r, int(p.piece_start[mine].min()), int(p.piece_end[mine].max())))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_cut_invariants(world_size):
    _, forest = forest_of("deep")
    p = wavefront_plan(forest, world_size)
    assert p.groups > 0 and p.group_ranks == world_size and p.group_layers > 0 and p.group_bytes > 0
    assert not p.piece_replica.any() and p.tokens.sum() == forest.num_compact_tokens  # every token once
    spans = _spans(p)
    assert [(s, r) for s, r, _, _ in spans] == sorted((s, r) for s, r, _, _ in spans)
    assert spans[0][2] == 0 and all(a[3] == b[2] for a, b in itertools.pairwise(spans))  # the DFS order, slot-major
    assert spans[-1][3] == forest.num_compact_tokens
    assert (p.budget.footprint(p.tokens, p.context) <= p.budget.tokens).all()
    assert (p.tokens > 0).all()  # every rank busy in every slot
    assert all(s.units for s in _schedules(p, forest))  # streams aligned, no cycle (check_groups)


def test_wavefront_prices_a_chain_of_spans():
    """w spans of equal cost reading each other in a chain take (L + w - 1) / L of one; a span
    reading nothing of its slot, its own cost; a reader of a slower span ends a layer after it."""
    layers = 4
    chain = np.array([[0, 1, 2], [1, 2, 3]])
    assert np.allclose(_wavefront(np.ones(4), chain, layers), [1, 1.25, 1.5, 1.75])
    assert np.allclose(_wavefront(np.array([1.0, 2.0]), np.zeros((2, 0), dtype=np.int64), layers), [1, 2])
    assert np.allclose(_wavefront(np.array([4.0, 1.0]), np.array([[0], [1]]), layers), [4, 4.25])
    assert np.allclose(_wavefront(np.array([1.0, 4.0]), np.array([[0], [1]]), layers), [1, 4.25])


def test_a_deep_chain_runs_each_token_once():
    """The deep chain 8x the budget: the rank-wise plan recomputes the chain above every rank's
    leaves; the cut runs each token once, over every rank, and predicts a lower step."""
    forest = get_workload("deep-chain", levels=200).forest()
    budget, ranks = 128, 8
    memory = MemoryModel(token=1.0, context=0.05)
    off = plan(forest, world_size=ranks, max_tokens_per_microbatch=budget, memory_model=memory)
    on = plan(forest, world_size=ranks, max_tokens_per_microbatch=budget, memory_model=memory, context_parallel=True)
    assert forest.max_length > 6 * budget and off.replicated_tokens > forest.num_compact_tokens
    assert on.groups > 0 and on.replicated_tokens == 0 and (on.tokens.sum(axis=1) > 0).all()
    assert on.step_seconds < 0.7 * off.step_seconds


def test_refused_where_a_read_joins_calls_at_different_positions():
    """A small tree, then a chain, over two ranks in one slot: rank 0 runs the small tree's call first
    and the chain's second, rank 1 the chain's first; a stream between them would wait at different
    call positions (``check_groups`` refuses it), so that cut is not priced; the cut the pass keeps
    (more slots) and ``plan()``'s plan compile on every rank."""
    rng = np.random.default_rng(0)
    forests = [
        RolloutForest.from_sequences([rng.integers(3, 120, 20).tolist()]),
        RolloutForest.from_sequences([rng.integers(3, 120, 300).tolist()]),
    ]
    geo = Geometry.of(forests, DEFAULT_COST_MODEL)
    memory = MemoryModel(token=1.0, context=0.1)
    budget = memory.budget(max_tokens=400)

    def build(pieces):
        return build_plan(geo, forests, pieces, DEFAULT_COST_MODEL, budget, memory, 64, time.perf_counter(), 2)

    starts = _span_starts(geo, budget, 2, 64)
    pieces = _pieces(geo, starts, 2)
    one_slot = build(pieces)
    assert one_slot.num_slots == 1 and one_slot.fits_budget and starts[1] > 20  # rank 0: both forests
    assert priced(one_slot, geo, pieces, 24) is None
    hf, adapter = patched_adapter(patch_model(tiny_model("qwen3_5")))
    tables = model_tables(hf, adapter)
    kept = wavefront_cut(geo, budget, 2, 64, build, 24)
    planned = plan(forests, world_size=2, max_tokens_per_microbatch=400, memory_model=memory, context_parallel=True)
    for p in (kept, planned):
        assert p is None or all(Schedule.compile(forests, p, r, tables, torch.device("cpu")).units for r in range(2))


def test_off_by_default():
    _, forest = forest_of("deep")
    p = plan(forest, world_size=3, max_tokens_per_microbatch=100, memory_model=MemoryModel(token=1.0, context=0.1))
    assert p.groups == 0 and p.piece_replica.any()  # the chain recomputed above the ranks' leaves


@settings(max_examples=40, deadline=None)
@given(cases())
def test_context_parallel_plans_compile_on_random_forests(case):
    """Whatever pass ``plan()`` keeps with ``context_parallel=True`` on 1-3 forests of every workload
    shape: every compact token owned once, every microbatch within the budget, every rank's units
    compile (each read from an earlier slot or a group of its own slot, aligned and acyclic:
    ``compile_rank`` refuses any other)."""
    forests, world, chunk = case[0], max(case[1], 2), case[3]
    p = case_plan(case, world_size=world, context_parallel=True)
    assert all((_owner_counts(p, forest, f) == 1).all() for f, forest in enumerate(forests))
    assert p.fits_budget
    for r in range(world):
        assert len(rank_units(forests, p, r, frozenset({RoundsTable(chunk)}), "cpu")) == p.unit_counts[r]
