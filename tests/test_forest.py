"""RolloutForest against a brute-force trie written from the definitions (prefix sets).

Every compact token is a distinct non-empty prefix; DFS pre-order with children sorted by
token equals the lexicographic order of the prefixes. Each property below is checked against
that oracle on random trajectory sets over tiny alphabets (so prefixes are shared), with
1-token trajectories, strict prefixes and duplicates.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_hf.forest import RolloutForest, sorted_unique


@st.composite
def trajectory_sets(draw) -> tuple[list[list[int]], list[np.ndarray]]:
    """Trajectories over a 1-3 letter alphabet with strict prefixes and duplicates, shuffled.

    Either grown by hypothesis (each new trajectory = a prefix of an earlier one + a new word:
    shrinkable, branchy) or drawn by numpy from a hypothesis seed (uniform sizes: hypothesis
    alone favours tiny, flat cases).
    """
    if draw(st.booleans()):
        letters = draw(st.integers(1, 3))
        word = st.lists(st.integers(0, letters - 1), min_size=1, max_size=6)
        seqs = [draw(word)]
        for i, k, w in draw(st.lists(st.tuples(st.integers(0, 15), st.integers(0, 12), word), max_size=12)):
            base = seqs[i % len(seqs)]
            seqs.append(base[: min(k, len(base))] + w)
    else:
        gen = np.random.default_rng(draw(st.integers(0, 2**16)))
        letters, longest = int(gen.choice([1, 2, 2, 3])), int(gen.integers(1, 15))
        lengths = gen.integers(1, longest + 1, gen.integers(1, 17))
        seqs = [gen.integers(0, letters, n).tolist() for n in lengths]
    cuts = draw(st.lists(st.tuples(st.integers(0, len(seqs) - 1), st.integers(1, 14)), max_size=4))
    seqs = seqs + [seqs[i][:k] for i, k in cuts]  # a strict prefix, or a duplicate if k >= len
    scale = draw(st.sampled_from([1, 7, 2**40]))  # large ids too
    seqs = [[x * scale for x in s] for s in draw(st.permutations(seqs))]
    mask_rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    masks = [mask_rng.random(len(s)) < 0.5 for s in seqs]
    return seqs, masks


class Oracle:
    """The prefix trie by definition: prefixes sorted lexicographically = DFS pre-order."""

    def __init__(self, seqs: list[list[int]]):
        self.seqs = [tuple(s) for s in seqs]
        self.prefixes = sorted({s[: d + 1] for s in self.seqs for d in range(len(s))})
        self.index = {p: k for k, p in enumerate(self.prefixes)}
        self.prev = [self.index.get(p[:-1], -1) for p in self.prefixes]
        self.children = np.bincount([q for q in self.prev if q >= 0], minlength=len(self.prefixes))

    def ancestor(self) -> np.ndarray:
        """[N, N] a[k, q]: prefix k is a prefix of prefix q (ancestor-or-self)."""
        p = self.prefixes
        return np.array([[q[: len(k)] == k for q in p] for k in p])

    def through(self, k: int) -> int:
        """Trajectories through compact token k."""
        p = self.prefixes[k]
        return sum(s[: len(p)] == p for s in self.seqs)


@settings(max_examples=400)
@given(trajectory_sets())
def test_forest_matches_prefix_oracle(case):
    seqs, masks = case
    forest = RolloutForest.from_sequences(seqs, masks)
    oracle = Oracle(seqs)
    n = len(oracle.prefixes)

    # Compact tokens = distinct non-empty prefixes, in DFS pre-order.
    assert forest.num_compact_tokens == n
    assert forest.tokens.tolist() == [p[-1] for p in oracle.prefixes]
    assert forest.position.tolist() == [len(p) - 1 for p in oracle.prefixes]
    assert forest.prev.tolist() == oracle.prev
    assert forest.multiplicity.tolist() == [oracle.through(k) for k in range(n)]

    # Trajectories, their restore index and loss masks come back exactly.
    assert forest.num_trajectories == len(seqs)
    assert forest.num_trajectory_tokens == sum(map(len, seqs))
    assert forest.compression == pytest.approx(sum(map(len, seqs)) / n)
    for i, s in enumerate(seqs):
        assert forest.trajectory(i).tolist() == s
        assert forest.trajectory_index(i).tolist() == [oracle.index[tuple(s[: t + 1])] for t in range(len(s))]
        idx = forest.trajectory_index(i)
        assert forest.position[idx].tolist() == list(range(len(s)))
        assert forest.prev[idx].tolist() == [-1] + idx[:-1].tolist()
        lo, hi = forest.traj_offsets[i], forest.traj_offsets[i + 1]
        np.testing.assert_array_equal(forest.loss_mask[lo:hi], masks[i])
    assert [t.tolist() for t in forest.trajectories()] == seqs

    # Ancestor tests: token interval and node interval agree with the prefix relation.
    anc = oracle.ancestor()
    k, q = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    np.testing.assert_array_equal((k <= q) & (q < forest.subtree_end[k]), anc)
    nk, nq = forest.node_of[k], forest.node_of[q]
    node_test = (forest.node_tin[nk] <= nq) & (nq < forest.node_tout[nk]) & (k <= q)
    np.testing.assert_array_equal(node_test, anc)

    # Nodes are maximal chains, contiguous in DFS order.
    starts = [t for t in range(n) if oracle.prev[t] < 0 or oracle.children[oracle.prev[t]] != 1]
    assert forest.node_start.tolist() == starts
    assert forest.node_len.tolist() == np.diff(starts + [n]).tolist()
    assert forest.node_of.tolist() == (np.searchsorted(starts, np.arange(n), side="right") - 1).tolist()
    inner = np.setdiff1d(np.arange(n), starts)
    assert (forest.prev[inner] == inner - 1).all()
    assert (oracle.children[inner - 1] == 1).all()

    # Node parents, levels (node ancestors on the root path), height, leaves.
    m = forest.num_nodes
    parent = [forest.node_of[oracle.prev[s]] if oracle.prev[s] >= 0 else -1 for s in starts]
    assert forest.node_parent.tolist() == parent
    level = [len({forest.node_of[t] for t in range(n) if anc[t, s]}) - 1 for s in starts]
    assert forest.node_level.tolist() == level
    assert forest.height == max(level) + 1
    assert forest.num_leaves == m - len(set(parent) - {-1})
    assert forest.roots.tolist() == [t for t in range(n) if oracle.prev[t] < 0]
    non_roots = np.cumsum([oracle.prev[t] >= 0 for t in range(n)])  # pairs numbered in forest order
    assert forest.pair_number(np.arange(n)).tolist() == (non_roots - 1).tolist()
    assert forest.num_pairs == int(non_roots[-1])

    # Log-prob gather index: row i, column t predicts token t + 1 of trajectory i.
    predictor, target, valid = forest.logprob_index
    width = max(map(len, seqs)) - 1
    assert predictor.shape == target.shape == valid.shape == (len(seqs), width)
    for i, s in enumerate(seqs):
        t = np.arange(width)
        np.testing.assert_array_equal(valid[i], t < len(s) - 1)
        cols = t[: len(s) - 1]
        assert predictor[i, cols].tolist() == [oracle.index[tuple(s[: c + 1])] for c in cols]
        assert target[i, cols].tolist() == s[1:]


@settings(max_examples=100)
@given(trajectory_sets())
def test_unshared_forest_is_trajectory_wise(case):
    """share_prefixes=False: every trajectory is its own root chain (the baseline layout)."""
    seqs, masks = case
    forest = RolloutForest.from_sequences(seqs, masks, share_prefixes=False)
    lengths = list(map(len, seqs))
    assert forest.num_compact_tokens == forest.num_trajectory_tokens == sum(lengths)
    assert forest.roots.size == forest.num_nodes == forest.num_leaves == len(seqs)
    assert forest.height == 1 and (forest.multiplicity == 1).all()
    for i, s in enumerate(seqs):
        assert forest.trajectory(i).tolist() == s
        idx = forest.trajectory_index(i)
        assert forest.position[idx].tolist() == list(range(len(s)))
        assert (forest.subtree_end[idx] == idx[-1] + 1).all()
    np.testing.assert_array_equal(forest.loss_mask, np.concatenate(masks))


@pytest.mark.parametrize(
    "seqs, masks, error, message",
    [
        pytest.param([], None, ValueError, "no sequences", id="no-sequences"),
        pytest.param([[1, 2], [], [3]], None, ValueError, "trajectory 1 is empty", id="empty-sequence"),
        pytest.param([[1, 2], [1.0, 2.5]], None, TypeError, "trajectory 1: token ids must be integers", id="float-ids"),
        pytest.param([[1, 2], [True, False]], None, TypeError, "trajectory 1", id="bool-ids"),
        pytest.param([[1, 2], [3, 4, 5, -1]], None, ValueError, "trajectory 1, position 3: negative", id="negative-id"),
        pytest.param([[1], [[2, 3]]], None, ValueError, "trajectory 1: expected a 1-D", id="nested"),
        pytest.param([[1], [1, [2, 3]]], None, ValueError, "trajectory 1: expected a flat sequence", id="ragged"),
        pytest.param([[1], [2**70]], None, ValueError, "trajectory 1: token id .* does not fit in int64", id="huge-id"),
        pytest.param([1, 2, 3], None, ValueError, "pass a list of trajectories", id="one-flat-trajectory"),
        pytest.param(
            [[1, 2], [3, 4, 5]],
            [[1, 0], [1]],
            ValueError,
            "loss mask 1 .* trajectory 1 has 3",
            id="mask-length",
        ),
        pytest.param([[1, 2], [3, 4, 5]], [[1, 0]], ValueError, "1 loss masks for 2", id="mask-count"),
        pytest.param([[3, 4, 5]], [[-100, -100, 5]], ValueError, "loss mask 0 .* not labels", id="mask-labels"),
        pytest.param([[3, 4, 5]], [[0.5, 0.0, 1.0]], ValueError, "loss mask 0 must hold", id="mask-fractions"),
    ],
)
def test_bad_inputs_name_the_trajectory(seqs, masks, error, message):
    with pytest.raises(error, match=message):
        RolloutForest.from_sequences(seqs, masks)


def test_two_million_tokens_build_and_restore():
    """64 trajectories (~31K tokens each) sharing a binary tree of long prefixes: no timing."""
    rng = np.random.default_rng(0)
    levels, seg, leaf = 6, 4000, 7250  # 6 * 4000 + 7250 = 31,250 tokens per trajectory
    segments = []
    for level in range(levels):
        s = rng.integers(0, 32000, (2**level, seg))
        s[:, 0] = np.arange(2**level)  # siblings start differently: the tree is exact
        segments.append(s)
    leaves = rng.integers(0, 32000, (64, leaf))
    leaves[:, 0] = np.arange(64)
    seqs = [
        np.concatenate([segments[level][i >> (levels - level)] for level in range(levels)] + [leaves[i]])
        for i in range(64)
    ]
    forest = RolloutForest.from_sequences(seqs)
    assert forest.num_trajectory_tokens == 64 * 31_250 == 2_000_000
    assert forest.num_compact_tokens == seg * (2**levels - 1) + 64 * leaf
    assert forest.height == levels + 1
    assert forest.num_leaves == 64
    restored = forest.trajectories()
    assert all(np.array_equal(r, s) for r, s in zip(restored, seqs))


def test_iterables_and_lists_are_taken():
    """A generator of trajectories, and ``padded`` of a plain list, work as their arrays would."""
    forest = RolloutForest.from_sequences(s for s in [[1, 2], [1, 3]])
    assert forest.num_compact_tokens == 3
    np.testing.assert_array_equal(forest.padded([5, 6, 7, 8]), [[5, 6], [7, 8]])
    with pytest.raises(ValueError, match="one value per trajectory token"):
        forest.padded([5, 6])


@pytest.mark.parametrize("x", [[], [3], [0, 2, 5, 9], [5, 2, 2, 9, 0], [1, 1], [4, 3]])
def test_sorted_unique_is_np_unique(x: list[int]) -> None:
    """The fast path (already strictly increasing) and the fallback both give np.unique's answer."""
    np.testing.assert_array_equal(
        sorted_unique(np.asarray(x, dtype=np.int64)), np.unique(np.asarray(x, dtype=np.int64))
    )


@settings(max_examples=50)
@given(trajectory_sets(), st.sampled_from([2**16 - 2, 2**32 - 2]))
def test_trie_keys_of_every_width_order_alike(case, base):
    """Ids shifted across 2**16 or 2**32 (the trie keys take 2, 4 or 8 bytes a token, whichever every id
    fits) build the same forest: the same order, chains and restore index, only the ids shifted."""
    seqs, masks = case
    small = RolloutForest.from_sequences(seqs, masks)
    shifted = RolloutForest.from_sequences([[x + base for x in s] for s in seqs], masks)
    np.testing.assert_array_equal(shifted.tokens, small.tokens + base)
    for name in RolloutForest.__dataclass_fields__:
        if name != "tokens":
            np.testing.assert_array_equal(getattr(shifted, name), getattr(small, name), err_msg=name)
