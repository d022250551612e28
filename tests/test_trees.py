"""``harts_hf.trees`` (the tree-structure floor) against plain per-element walks on random forests:
chains in DFS order (contiguous, as a forest lays them out) and under shuffled indices (not, as in
a piece), root paths as node intervals per query and as a union climbed once."""

from __future__ import annotations

import numpy as np
import pytest

from harts_hf.trees import chains, path_intervals


def _random_parents(rng: np.random.Generator, n: int, chain_prob: float) -> np.ndarray:
    """[n] a random recursive forest in creation order: k continues k - 1 with ``chain_prob`` (long
    chains), else hangs under a uniform earlier element or starts a new root."""
    pick = rng.integers(-1, np.maximum(np.arange(n), 1))
    parent = np.where(rng.random(n) < chain_prob, np.arange(n) - 1, pick)
    parent[0] = -1
    return parent


def _dfs_order(parent: np.ndarray) -> np.ndarray:
    """Element of each DFS pre-order index (children in creation order)."""
    kids = [[] for _ in range(parent.size)]
    for k, p in enumerate(parent):
        if p >= 0:
            kids[p].append(k)
    order, stack = [], [k for k in range(parent.size) if parent[k] < 0][::-1]
    while stack:
        k = stack.pop()
        order.append(k)
        stack.extend(kids[k][::-1])
    return np.array(order, dtype=np.int64)


def _relabel(parent: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The forest with element ``order[i]`` renamed i."""
    name = np.empty_like(order)
    name[order] = np.arange(order.size)
    return np.where(parent[order] >= 0, name[np.maximum(parent[order], 0)], -1)


def _chains_by_walk(prev: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    kids = np.zeros(prev.size, dtype=np.int64)
    for p in prev[prev >= 0]:
        kids[p] += 1
    start = np.array([i for i in range(prev.size) if prev[i] < 0 or kids[prev[i]] != 1], dtype=np.int64)
    number = {int(s): j for j, s in enumerate(start)}
    node_of = np.empty(prev.size, dtype=np.int64)
    for i in range(prev.size):
        x = i
        while x not in number:
            x = prev[x]
        node_of[i] = number[x]
    node_parent = np.array([node_of[prev[s]] if prev[s] >= 0 else -1 for s in start], dtype=np.int64)
    return node_of, start, node_parent


@pytest.mark.parametrize("chain_prob", [0.0, 0.6, 0.95], ids=["bushy", "mixed", "long-chains"])
@pytest.mark.parametrize("layout", ["dfs", "shuffled"])
def test_chains_match_a_walk(rng, chain_prob, layout):
    for n in (1, 2, 63, 64, 65, 400):
        parent = _random_parents(rng, n, chain_prob)
        order = _dfs_order(parent) if layout == "dfs" else rng.permutation(n)
        prev = _relabel(parent, order)
        got, want = chains(prev), _chains_by_walk(prev)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_shuffled_chains_are_not_contiguous(rng):
    """The shuffled layout does reach the pointer-jumping case."""
    prev = _relabel(_random_parents(rng, 400, 0.95), rng.permutation(400))
    node_of, start, _ = chains(prev)
    assert (node_of != np.cumsum(np.isin(np.arange(400), start)) - 1).any()


def _node_forest(rng: np.random.Generator, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(start, length, parent) of m random nodes laid out as token ranges in a random order, and
    the tokens' prev array."""
    parent = _random_parents(rng, m, 0.3)
    length = rng.integers(1, 6, m)
    place = rng.permutation(m)
    start = np.empty(m, dtype=np.int64)
    start[place] = np.concatenate(([0], np.cumsum(length[place])[:-1]))
    prev = np.empty(int(length.sum()), dtype=np.int64)
    for v in range(m):
        toks = np.arange(start[v], start[v] + length[v])
        prev[toks] = toks - 1
        prev[start[v]] = start[parent[v]] + length[parent[v]] - 1 if parent[v] >= 0 else -1
    return start, length, parent, prev


def _walk(prev: np.ndarray, t: int, inclusive: bool) -> set[int]:
    path, x = {t} if inclusive else set(), prev[t]
    while x >= 0:
        path.add(int(x))
        x = prev[x]
    return path


def _queries(rng, start, length, inclusive):
    t = rng.integers(0, int(length.sum()), 200)
    node = np.searchsorted(np.sort(start), t, side="right") - 1
    node = np.argsort(start)[node]
    return t, node, t + inclusive


@pytest.mark.parametrize("inclusive", [False, True], ids=["strict", "inclusive"])
def test_path_intervals_per_query(rng, inclusive):
    """Every query's intervals, in climbing order (own nodes first, one step per node level)."""
    start, length, parent, prev = _node_forest(rng, 120)
    t, node, tip = _queries(rng, start, length, inclusive)
    paths = []
    for v, e in zip(node, tip):
        steps = [(start[v], e)]
        while parent[v] >= 0:
            v = parent[v]
            steps.append((start[v], start[v] + length[v]))
        paths.append(steps)
    want = [(i, *p[s]) for s in range(max(map(len, paths))) for i, p in enumerate(paths) if s < len(p)]
    want = np.array([w for w in want if w[2] > w[1]], dtype=np.int64).reshape(-1, 3)
    got = np.stack(path_intervals(start, length, parent, node, tip), axis=1)
    np.testing.assert_array_equal(got, want)
    for i in range(t.size):
        mine = got[got[:, 0] == i]
        toks = np.concatenate([np.arange(lo, hi) for _, lo, hi in mine] + [np.zeros(0, np.int64)])
        assert sorted(toks.tolist()) == sorted(_walk(prev, t[i], inclusive))


@pytest.mark.parametrize("inclusive", [False, True], ids=["strict", "inclusive"])
def test_path_intervals_once_is_the_union_climbed_once(rng, inclusive):
    start, length, parent, prev = _node_forest(rng, 120)
    t, node, tip = _queries(rng, start, length, inclusive)
    group = rng.integers(0, 3, t.size)
    which, lo, hi = path_intervals(start, length, parent, node, tip, once_per=group)
    for g in range(3):
        mine = group[which] == g
        toks = np.concatenate([np.arange(a, b) for a, b in zip(lo[mine], hi[mine])] + [np.zeros(0, np.int64)])
        assert set(toks.tolist()) == set().union(*(_walk(prev, x, inclusive) for x in t[group == g]))
    whole = np.arange(which.size) >= int((tip > start[node]).sum())  # past the queries' own nodes
    key = group[which[whole]] * (int(length.sum()) + 1) + lo[whole]
    assert np.unique(key).size == whole.sum()  # each ancestor node once per group
    for i, a, b in zip(which, lo, hi):  # climbed by a query whose path holds it
        assert set(range(a, b)) <= _walk(prev, t[i], inclusive)
