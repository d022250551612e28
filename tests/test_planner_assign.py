"""The capacity search's take (``assign._take``) against its rule walked branch by branch."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_hf.planner.assign import _Branches, _take


def walked(sizes: list[float], room: float) -> tuple[list[int], float]:
    """The rule as written: the longest prefix that fits (its sum subtracted as numpy sums it from 8
    terms on), then every later branch that still fits, in order."""
    k, prefix = 0, 0.0
    for s in sizes:
        if prefix + s > room:
            break
        prefix += s
        k += 1
    room -= prefix if k < 8 else float(np.sum(sizes[:k]))
    taken = list(range(k))
    for i in range(k, len(sizes)):
        if sizes[i] <= room:
            taken.append(i)
            room -= sizes[i]
    return taken, room


@settings(max_examples=150)
@given(
    st.lists(st.floats(0.0, 10.0) | st.sampled_from([0.1, 0.2, 0.3, 1.0]), min_size=1, max_size=20),
    st.floats(0.0, 60.0),
)
def test_take_is_the_walk(sizes, room):
    """Costs largest first (ties, repeats, zeros, sums of 8 and more): the same positions and the same
    room left, to the bit."""
    sizes = sorted(sizes, reverse=True)
    branches = _Branches.of(list(range(len(sizes))), sizes)
    assert _take(branches, room) == walked(sizes, room)
    left = branches.without([0])
    assert left.ids == list(range(1, len(sizes))) and left.sizes == sizes[1:]
