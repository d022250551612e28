"""The planner's node-level arithmetic against the forests' own token arrays (position, prev,
subtree_end, trajectories) and its rounds count against ``ops.rounds.build_rounds``."""

from __future__ import annotations

import numpy as np
import pytest
from trees import NASTY_TREES, nasty_tree_params

from harts_hf.forest import RolloutForest
from harts_hf.ops.rounds import build_rounds
from harts_hf.ops.tree_batch import TreeBatch
from harts_hf.planner import CostModel
from harts_hf.planner.geometry import Geometry
from harts_hf.planner.node_parts import node_parts_of
from harts_hf.trees import min_rounds

COST = CostModel(token=1.5, pair=0.25, round=0.0, microbatch=0.0)


@pytest.fixture
def forests(rng) -> list[RolloutForest]:
    """Every nasty tree as one forest, concatenated in one plan-wide index space."""
    return [RolloutForest.from_sequences(build(rng)) for build in NASTY_TREES.values()]


def _cat(forests: list[RolloutForest], get) -> np.ndarray:
    off = np.cumsum([0] + [f.num_compact_tokens for f in forests])
    return np.concatenate([get(f, o) for f, o in zip(forests, off)])


def test_tokens_depths_parents_and_costs(forests):
    geo = Geometry.of(forests, COST)
    t = np.arange(geo.num_tokens)
    position = _cat(forests, lambda f, o: f.position)
    prev = _cat(forests, lambda f, o: np.where(f.prev >= 0, f.prev + o, -1))
    np.testing.assert_array_equal(geo.token_depth(t), position)
    np.testing.assert_array_equal(geo.parent_token(t), prev)
    weights = COST.token + COST.pair * (position + 1)
    prefix = np.concatenate(([0.0], np.cumsum(weights)))
    np.testing.assert_allclose(geo.prefix(np.arange(geo.num_tokens + 1)), prefix, rtol=1e-12)
    np.testing.assert_allclose(geo.token_at(prefix), np.arange(geo.num_tokens + 1), atol=1e-6)
    np.testing.assert_array_equal(geo.local(t), _cat(forests, lambda f, o: np.arange(f.num_compact_tokens)))


def test_ancestors(forests, rng):
    geo = Geometry.of(forests, COST)
    prev = _cat(forests, lambda f, o: np.where(f.prev >= 0, f.prev + o, -1))
    t = rng.integers(0, geo.num_tokens, 300)
    which, lo, hi = geo.path_intervals(t)
    for i in range(t.size):
        walk, x = [], prev[t[i]]
        while x >= 0:
            walk.append(x)
            x = prev[x]
        got = np.concatenate([np.arange(a, b) for a, b in zip(lo[which == i], hi[which == i])] + [np.zeros(0, int)])
        np.testing.assert_array_equal(np.sort(got), np.sort(walk))


def test_common_prefix_of_trajectories(forests, rng):
    geo = Geometry.of(forests, COST)
    off = np.cumsum([0] + [f.num_compact_tokens for f in forests])
    trajs = [  # (token ids, global last token) of every trajectory
        (f.trajectory(i), f.trajectory_index(i)[-1] + o)
        for f, o in zip(forests, off)
        for i in range(f.num_trajectories)
    ]
    pairs = rng.integers(0, len(trajs), (400, 2))
    got = geo.common_prefix(np.array([trajs[i][1] for i in pairs[:, 0]]), np.array([trajs[j][1] for j in pairs[:, 1]]))
    for (i, j), g in zip(pairs, got):
        a, b = trajs[i][0], trajs[j][0]
        same_forest = np.searchsorted(off, trajs[i][1], "right") == np.searchsorted(off, trajs[j][1], "right")
        n = min(a.size, b.size)
        common = int(np.argmin(np.r_[a[:n] == b[:n], False])) if same_forest else 0
        assert g == common


@pytest.mark.parametrize("build", nasty_tree_params())
def test_rounds_of_whole_forests_match_ops(build, rng):
    forest = RolloutForest.from_sequences(build(rng))
    assert min_rounds(forest.node_parent)[0].max() == build_rounds(TreeBatch.from_forest(forest), 64).num_rounds


@pytest.mark.parametrize("build", nasty_tree_params())
def test_node_parts_of_random_pieces_match_tree_batches(build, rng):
    """Random DFS ranges as microbatches: rounds and external entries as ops.rounds derives them."""
    forest = RolloutForest.from_sequences(build(rng))
    geo = Geometry.of([forest], COST)
    n = forest.num_compact_tokens
    cuts = np.unique(np.r_[0, rng.integers(1, n, 4), n])
    lo, hi = cuts[:-1], cuts[1:]
    mb = np.arange(lo.size)
    parts = node_parts_of(geo, mb, lo, hi, lo.size)
    for m in range(lo.size):
        batch = TreeBatch.from_forest(forest, tokens=np.arange(lo[m], hi[m]))
        rd = build_rounds(batch, 8)
        assert parts.rounds[m] == rd.num_rounds
        entries = np.sort(parts.lo[parts.external & (parts.mb == m)])
        local = batch.prev.numpy()[batch.num_context :]
        expect = batch.global_index.numpy()[batch.num_context :][(local >= 0) & (local < batch.num_context)]
        np.testing.assert_array_equal(entries, np.sort(expect))
