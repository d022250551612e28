"""The context tokens ``plan`` prices per microbatch (``Geometry.paths_union`` of its entries) against
the union of its entries' root paths, token by token, and its own tokens on those paths
(``plan._own_on_paths``), which its call computes rather than reads."""

from __future__ import annotations

import numpy as np
import pytest

from harts_hf.planner import DEFAULT_COST_MODEL
from harts_hf.planner.geometry import Geometry
from harts_hf.planner.node_parts import node_parts_of
from harts_hf.planner.plan import _own_on_paths
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
        assert geo.paths_union(entry, mb, 6).tolist() == [len(w) for w in want]


@pytest.mark.parametrize("shape", ["deep_chain", "random_tree"])
def test_own_tokens_on_entry_paths(shape):
    """Microbatches of random disjoint pieces (a context-parallel span may land beside an ancestor of
    it): each microbatch's count of its own tokens on its entries' root paths is the set of its tokens
    that are strict ancestors of one of its entries, and the context plus it is the union of the paths;
    the union of the pieces' first tokens' paths, its own tokens aside, is that context too."""
    make = {"deep_chain": lambda s: deep_chain(40, fanout=3, seed=s), "random_tree": lambda s: random_tree(60, seed=s)}
    geo = Geometry.of([make[shape](0).forest(), make[shape](1).forest()], DEFAULT_COST_MODEL)
    rng = np.random.default_rng(0)
    for trial in range(10):
        bounds = np.unique(np.r_[0, rng.integers(1, geo.num_tokens, 40), geo.num_tokens])
        lo, hi = bounds[:-1], bounds[1:]
        mb = rng.integers(0, 5 if trial else 1, lo.size)  # microbatch 5 of 6 gets none; first, one holds all
        parts = node_parts_of(geo, mb, lo, hi, 6)
        ext = parts.external
        entry, entry_mb = parts.lo[ext], parts.mb[ext]
        which, a, b = geo.path_intervals(entry)
        paths = [set() for _ in range(6)]
        for i, x, y in zip(which.tolist(), a.tolist(), b.tolist()):
            paths[entry_mb[i]].update(range(x, y))
        own = [set() for _ in range(6)]
        for m, x, y in zip(mb.tolist(), lo.tolist(), hi.tolist()):
            own[m].update(range(x, y))
        assert _own_on_paths(geo, parts, 6).tolist() == [len(p & o) for p, o in zip(paths, own)]
        assert geo.paths_union(entry, entry_mb, 6).tolist() == [len(p) for p in paths]
        # the pieces' first tokens' paths hold every ancestor outside them: the same context
        which, a, b = geo.path_intervals(lo)
        firsts = [set() for _ in range(6)]
        for i, x, y in zip(which.tolist(), a.tolist(), b.tolist()):
            firsts[mb[i]].update(range(x, y))
        assert [len(f - o) for f, o in zip(firsts, own)] == [len(p - o) for p, o in zip(paths, own)]
