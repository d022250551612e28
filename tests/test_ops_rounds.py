"""Path decomposition into rounds: minimum round count (vs brute force) and packed-layout invariants."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from trees import NASTY_TREES, nasty_tree_params

from harts_hf.forest import RolloutForest
from harts_hf.ops.rounds import Rounds, rounds_of
from harts_hf.ops.tree_batch import TreeBatch


def brute_force_rounds(forest: RolloutForest) -> int:
    """Min over every choice of continued child (at every token with several children) of the
    round count, rounds counted by walking the tree: a non-continued child starts one round later."""
    kids: dict[int, list[int]] = {}
    for t, p in enumerate(forest.prev.tolist()):
        kids.setdefault(p, []).append(t)
    branching = [t for t, c in kids.items() if t >= 0 and len(c) > 1]
    best = None
    for choice in itertools.product(*(kids[t] for t in branching)):
        cont = dict(zip(branching, choice))
        rnd = np.zeros(forest.num_compact_tokens, dtype=np.int64)
        for t, p in enumerate(forest.prev.tolist()):  # DFS pre-order: parents first
            if p >= 0:
                rnd[t] = rnd[p] + (len(kids[p]) > 1 and cont[p] != t)
        best = rnd.max() + 1 if best is None else min(best, rnd.max() + 1)
    return int(best)


def binary_tree(levels: int) -> list[list[int]]:
    """Complete binary tree with ``levels`` branching levels, two tokens per edge."""
    paths = itertools.product((0, 1), repeat=levels)
    return [sum(([2 * i + b, 2 * i + b] for i, b in enumerate(bits)), [9, 9]) for bits in paths]


def rounds(seqs: list[list[int]], chunk: int = 16) -> Rounds:
    return rounds_of(TreeBatch.from_forest(RolloutForest.from_sequences(seqs)), chunk)


@pytest.mark.parametrize(
    "name, expected",
    [
        pytest.param("grpo_group", 2, id="grpo_group"),
        pytest.param("caterpillar", 2, id="caterpillar"),
        pytest.param("deep_chain", 2, id="deep_chain"),
        pytest.param("wide_fanout", 2, id="wide_fanout"),
        pytest.param("strict_prefix", 2, id="strict_prefix"),
    ],
)
def test_known_round_counts(name: str, expected: int) -> None:
    assert rounds(NASTY_TREES[name](np.random.default_rng(0))).num_rounds == expected


def test_chain_and_binary_tree_round_counts() -> None:
    assert rounds([list(range(100))]).num_rounds == 1
    assert rounds([[1, 2, 3], [1, 2, 3]]).num_rounds == 1  # duplicates only
    for levels in (1, 2, 3, 4):
        assert rounds(binary_tree(levels)).num_rounds == levels + 1


@pytest.mark.parametrize("seed", range(12))
def test_round_count_is_minimal(seed: int) -> None:
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 2, size=int(rng.integers(3, 8))).tolist() for _ in range(10)]  # 2-3 rounds
    forest = RolloutForest.from_sequences(seqs)
    assert rounds_of(TreeBatch.from_forest(forest), 4).num_rounds == brute_force_rounds(forest)


def grid_paths(rs: Rounds) -> list[np.ndarray]:
    """Combined token sequence each path computes on its grid, by offset."""
    grid = rs.grid
    order = np.lexsort((grid.offset, grid.path))
    return np.split(grid.token[order], np.cumsum(np.bincount(grid.path, minlength=rs.num_paths))[:-1])


@pytest.mark.parametrize("build", nasty_tree_params())
@pytest.mark.parametrize("chunk", [16, 64])
def test_paths_on_the_grid(build, chunk: int) -> None:
    forest = RolloutForest.from_sequences(build(np.random.default_rng(0)))
    batch = TreeBatch.from_forest(forest)
    rs = rounds_of(batch, chunk)
    pos, prev = forest.position, forest.prev
    grid = rs.grid
    for p, seq in enumerate(grid_paths(rs)):
        assert pos[seq[0]] == rs.path_start[p] and rs.path_start[p] % chunk == 0, "paths start on the chunk grid"
        assert (pos[seq] == pos[seq[0]] + np.arange(seq.size)).all() and seq.size == rs.path_length[p]
        assert (prev[seq[1:]] == seq[:-1]).all(), "a path is a root-ward chain"
        assert rs.path_chunks[p] == -(-seq.size // chunk)
        own = grid.own[grid.path == p]
        assert rs.path_replay[p] == (~own).sum() < chunk, "< C replayed tokens, then own ones"
        assert (rs.token_path[seq[rs.path_replay[p] :]] == p).all()
        q = rs.path_parent[p]
        assert (q < 0) == (prev[seq[rs.path_replay[p]]] < 0), "only roots have no parent path"
        if q >= 0:
            assert rs.token_path[prev[seq[rs.path_replay[p]]]] == q and rs.path_round[p] == rs.path_round[q] + 1
    for r in range(rs.num_rounds):  # ranks by chunk count, descending
        paths = np.flatnonzero(rs.path_round == r)
        by_rank = paths[np.argsort(rs.path_rank[paths])]
        assert sorted(rs.path_rank[paths]) == list(range(paths.size))
        assert (np.diff(rs.path_chunks[by_rank]) <= 0).all()
    owned = grid.token[grid.own]
    assert np.array_equal(np.sort(owned), np.arange(forest.num_compact_tokens)), "every token is own exactly once"
    assert rounds_of(batch, chunk) is rs, "derived once per batch"


def test_piece_external_paths() -> None:
    """A piece cut below a chunk boundary: its states come from outside, its replay from context."""
    prefix = list(range(40))
    forest = RolloutForest.from_sequences([prefix + [100 + i, 200 + i] for i in range(3)] + [prefix])
    piece = np.flatnonzero(forest.position >= 35)
    batch = TreeBatch.from_forest(forest, piece)
    rs = rounds_of(batch, 16)
    ext = batch.global_index[rs.external_tokens].numpy()
    np.testing.assert_array_equal(forest.position[ext], [31])  # the state after depth 31 (boundary 32)
    np.testing.assert_array_equal(forest.position[batch.global_index[rs.context_replay].numpy()], [32, 33, 34])
    assert rs.num_rounds == 2 and rs.path_h0[rs.path_round == 0].tolist() == [1]
    trunk = grid_paths(rs)[int(np.flatnonzero(rs.path_round == 0)[0])]
    assert np.array_equal(trunk[:3], rs.context_replay.numpy())
