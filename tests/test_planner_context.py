"""The context tokens ``plan`` prices per microbatch (``plan._context_tokens``) against the union of
its entries' root paths, token by token."""

from __future__ import annotations

import numpy as np
import pytest

from harts_hf.planner import DEFAULT_COST_MODEL
from harts_hf.planner.geometry import Geometry
from harts_hf.planner.plan import _context_tokens
from harts_hf.sources import deep_chain, random_tree


@pytest.mark.parametrize("shape", ["deep_chain", "random_tree"])
def test_context_is_the_union_of_entry_paths(shape):
    """Entries drawn anywhere (repeats, ancestors of one another, two forests, an empty microbatch):
    each microbatch's count is the set of tokens on its entries' root paths, the entries excluded."""
    make = {"deep_chain": lambda s: deep_chain(40, fanout=3, seed=s), "random_tree": lambda s: random_tree(60, seed=s)}
    geo = Geometry.of([make[shape](0).forest(), make[shape](1).forest()], DEFAULT_COST_MODEL)
    rng = np.random.default_rng(0)
    for _ in range(10):
        entry = rng.integers(0, geo.num_tokens, 60)
        entry = np.concatenate((entry, entry[:5]))
        mb = rng.integers(0, 5, entry.size)  # microbatch 5 of 6 gets none
        which, lo, hi = geo.path_intervals(entry)
        want = [set() for _ in range(6)]
        for i, a, b in zip(which.tolist(), lo.tolist(), hi.tolist()):
            want[mb[i]].update(range(a, b))
        assert _context_tokens(geo, entry, mb, 6).tolist() == [len(w) for w in want]
