"""TRL's padded rows <-> forests (``harts_hf.trainers.rows``): columns by hand, shapes checked; equal row
shares of a plan (``arrange.equal_shares``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts_hf.trainers.arrange import equal_shares
from harts_hf.trainers.rows import rows_forest, to_completion_layout

# Two rows: left-padded prompts (widths 2 and 1 of 2), right-padded completions (3 and 2 of 3).
IDS = torch.tensor([[5, 6, 7, 8, 9], [0, 5, 7, 8, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]])


def test_rows_become_trajectories_and_come_back_in_completion_layout():
    forest = rows_forest(IDS, MASK)
    assert [t.tolist() for t in forest.trajectories()] == [[5, 6, 7, 8, 9], [5, 7, 8]]
    values = torch.tensor([[10.0, 11, 12, 13], [20, 21, 0, 0]])  # column t scores token t + 1
    # Completion column c of row i scores completion token c: trajectory column p_i - 1 + c.
    expected = torch.tensor([[11.0, 12, 13], [20, 21, 0]])
    torch.testing.assert_close(to_completion_layout(values, MASK, 3), expected)


@pytest.mark.parametrize(
    "ids, mask", [pytest.param(IDS, MASK[:1], id="fewer-mask-rows"), pytest.param(IDS, MASK[:, :4], id="narrower")]
)
def test_mismatched_rows_are_refused(ids, mask):
    with pytest.raises(ValueError, match="must be one"):
        rows_forest(ids, mask)


@pytest.mark.parametrize(
    "rows, keep", [pytest.param(3, 3, id="more-value-rows"), pytest.param(2, 9, id="keep-too-wide")]
)
def test_completion_layout_refuses_what_does_not_fit(rows, keep):
    with pytest.raises(ValueError, match="do not fit"):
        to_completion_layout(torch.zeros(rows, 4), MASK, keep)


@pytest.mark.parametrize(
    "owner, world",
    [
        pytest.param([0, 0, 1, 1, 1, 1, 0, 0], 2, id="equal-kept"),
        pytest.param([1, 1, 1, 1, 1, 0, 0, 0], 2, id="one-moves"),
        pytest.param([0] * 12, 3, id="all-on-one"),
        pytest.param([2, 2, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1], 3, id="three-ranks"),
    ],
)
def test_equal_shares_keep_the_plan_grouping_with_equal_row_counts(owner, world):
    owner = np.asarray(owner)
    got = equal_shares(owner, world)
    n = owner.size // world
    assert (np.bincount(got, minlength=world) == n).all()
    counts = np.bincount(owner, minlength=world)
    if (counts == n).all():
        assert (got == owner).all()
    # every rank's rows are one run of the plan's order (ranks by first row, rows in trie order), and
    # rows move only where the run boundaries shift from the plan's
    first = [np.flatnonzero(owner == r).min() if (owner == r).any() else owner.size for r in range(world)]
    ranks = np.argsort(first, kind="stable")
    order = np.lexsort((np.arange(owner.size), np.argsort(ranks)[owner]))
    assert all(np.unique(got[order[k * n : (k + 1) * n]]).size == 1 for k in range(world))
    shift = np.abs(np.cumsum(counts[ranks])[:-1] - n * np.arange(1, world)).sum()
    assert (got != owner).sum() <= shift
