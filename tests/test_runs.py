"""Token runs (``harts_hf.runs``) against Python sets: the union of ranges per group, set
difference, lookup, the segments ranges cover, the first of each group of a sort, and a group's context (the ancestors outside it) and entry tokens against a
walk up ``prev`` token by token."""

from __future__ import annotations

import numpy as np
import pytest

from harts_hf import RolloutForest
from harts_hf.runs import Runs, context_runs, covered, entry_tokens, group_firsts


def _sets(runs: Runs, groups: int) -> list[set[int]]:
    out = [set() for _ in range(groups)]
    for g, lo, hi in zip(runs.group, runs.lo, runs.hi):
        out[g] |= set(range(lo, hi))
    return out


def _random_runs(rng, groups: int, n: int) -> Runs:
    lo = rng.integers(0, n, 40)
    return Runs.of(rng.integers(0, groups, 40), lo, lo + rng.integers(0, 12, 40))


@pytest.mark.parametrize("seed", range(5))
def test_runs_are_sets(seed):
    rng = np.random.default_rng(seed)
    a, b = _random_runs(rng, 3, 60), _random_runs(rng, 3, 60)
    sa, sb = _sets(a, 3), _sets(b, 3)
    order = np.lexsort((a.lo, a.group))
    assert (order == np.arange(order.size)).all() and (a.hi > a.lo).all()
    same = a.group[1:] == a.group[:-1]
    assert (a.lo[1:][same] > a.hi[:-1][same]).all()  # disjoint, touching runs merged
    assert _sets(a.minus(b), 3) == [x - y for x, y in zip(sa, sb)]
    for g in range(3):
        x = np.arange(80)
        found = a.find(np.full(80, g), x)
        assert [int(t) for t in x[found >= 0]] == sorted(t for t in sa[g] if t < 80)
        assert (a.lo[found[found >= 0]] <= x[found >= 0]).all() and (x[found >= 0] < a.hi[found[found >= 0]]).all()
        mine = a.select(a.group == g)
        assert (
            mine.tokens().tolist()
            == sorted(sa[g])
            == Runs.of_tokens(np.array(sorted(sa[g]), dtype=np.int64)).tokens().tolist()
        )
    assert a.counts(3).tolist() == [len(s) for s in sa]


@pytest.mark.parametrize("seed", range(5))
def test_context_and_entries_follow_prev(seed):
    rng = np.random.default_rng(seed)
    seqs = [list(rng.integers(0, 9, rng.integers(3, 30)))]
    for _ in range(12):
        base = seqs[rng.integers(len(seqs))]
        seqs.append(base[: rng.integers(0, len(base) + 1)] + list(rng.integers(0, 9, rng.integers(1, 30))))
    forest = RolloutForest.from_sequences(seqs)
    own = _random_runs(rng, 4, forest.num_compact_tokens - 12)
    mine = _sets(own, 4)
    context, (entry, group) = _sets(context_runs(forest, own), 4), entry_tokens(forest, own)
    for g in range(4):
        ancestors = set()
        for t in mine[g]:
            p = forest.prev[t]
            while p >= 0:
                ancestors.add(int(p))
                p = forest.prev[p]
        assert context[g] == ancestors - mine[g]
        assert entry[group == g].tolist() == sorted(
            t for t in mine[g] if forest.prev[t] >= 0 and forest.prev[t] not in mine[g]
        )


@pytest.mark.parametrize("seed", range(5))
def test_segments_and_group_firsts_against_loops(seed):
    rng = np.random.default_rng(seed)
    lo = rng.integers(0, 50, 20)
    hi = lo + rng.integers(0, 10, 20)
    bounds = np.unique(np.r_[lo, hi, rng.integers(0, 60, 5)])
    seg, which = covered(bounds, lo, hi)
    expected = [(s, i) for i in range(lo.size) for s in range(bounds.size - 1) if lo[i] <= bounds[s] < hi[i]]
    assert list(zip(seg.tolist(), which.tolist())) == expected
    a, b, tie = rng.integers(0, 3, 30), rng.integers(0, 3, 30), rng.random(30)
    order = np.lexsort((tie, b, a))
    seen, firsts = set(), []
    for i in order.tolist():  # the first of each (a, b) in the order, by the tie-break
        if (a[i], b[i]) not in seen:
            seen.add((a[i], b[i]))
            firsts.append(i)
    assert group_firsts(order, a, b).tolist() == firsts
    assert group_firsts(order[:0], a, b).size == 0
