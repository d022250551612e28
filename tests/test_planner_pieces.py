"""Finding pieces by token (``harts_hf/planner/pieces.py``): ``locate`` (a given rank's piece) and
``lowest_holder`` (the lowest rank's piece holding a token, how the replay count finds a parent
another rank computes), against a scan of every piece, on random layouts where ranks overlap."""

from __future__ import annotations

import numpy as np
import pytest

from harts_hf.planner.pieces import Pieces


def _random_pieces(rng: np.random.Generator, world_size: int, tokens: int) -> Pieces:
    """Each rank: disjoint ranges over [0, tokens) (cut at random points, some dropped), so ranks
    hold the same tokens, or none, at random."""
    rank, lo, hi = [], [], []
    for r in range(world_size):
        cuts = np.unique(np.r_[0, rng.integers(0, tokens, rng.integers(1, 8)), tokens])
        keep = rng.random(cuts.size - 1) < 0.5
        rank += [r] * int(keep.sum())
        lo += cuts[:-1][keep].tolist()
        hi += cuts[1:][keep].tolist()
    order = rng.permutation(len(lo))
    rank, lo, hi = (np.array(x, dtype=np.int64)[order] for x in (rank, lo, hi))
    return Pieces(rank, np.zeros_like(rank), lo, hi, np.zeros_like(rank), np.zeros(rank.size, dtype=bool), 1)


@pytest.mark.parametrize("seed", range(20))
def test_pieces_are_found_by_token(seed):
    rng = np.random.default_rng(seed)
    world, tokens = int(rng.integers(1, 6)), int(rng.integers(1, 60))
    pieces = _random_pieces(rng, world, tokens)
    token = np.arange(-1, tokens + 1)
    holds = (pieces.lo[None, :] <= token[:, None]) & (token[:, None] < pieces.hi[None, :])  # [t, P]
    for r in range(world):
        mine = holds & (pieces.rank == r)[None, :]
        assert np.array_equal(pieces.locate(np.full(token.size, r), token), np.where(mine.any(1), mine.argmax(1), -1))
    rank = np.where(holds, pieces.rank[None, :], world)
    lowest = rank.min(axis=1, initial=world)
    expected = np.where(lowest < world, np.argmax(holds & (rank == lowest[:, None]), axis=1), -1)
    assert np.array_equal(pieces.lowest_holder(token), expected)
