"""TRL's padded rows <-> forests (``harts_hf.trainers.rows``): columns by hand, shapes checked; the
HARTS step's blocks (``step.block_length``)."""

from __future__ import annotations

import pytest
import torch

from harts_hf.trainers.rows import rows_forest, to_completion_layout
from harts_hf.trainers.step import block_length

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
    "accumulation, per_generation, expected",
    [
        pytest.param(4, 4, [4, 3, 2, 1, 4], id="one-generation-per-step"),
        pytest.param(2, 4, [2, 1, 2, 1, 2], id="a-generation-over-two-steps"),
        pytest.param(4, 2, [2, 1, 2, 1, 2], id="a-step-over-two-generations"),
        pytest.param(3, 2, [2, 1, 1, 1, 2, 1], id="blocks-end-at-both-edges"),
    ],
)
def test_a_block_ends_with_its_optimizer_step_or_its_generation(accumulation, per_generation, expected):
    assert [block_length(s, accumulation, per_generation) for s in range(len(expected))] == expected
