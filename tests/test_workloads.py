"""Workload generators: determinism, aligned masks, intended shapes, SWE-like statistics."""

from __future__ import annotations

import numpy as np
import pytest

from harts_hf.sources import (
    CPU_SCALE,
    WORKLOADS,
    Workload,
    caterpillar,
    deep_chain,
    get_workload,
    grpo_group,
    random_tree,
    swe_like,
)

SMALL = {  # keyword arguments that keep every generator tiny
    "swe-like": {"scale": CPU_SCALE, "num_tasks": 2, "group_size": 4},
    "grpo-group": {"G": 5},
    "caterpillar": {"turns": 5},
    "random-tree": {"num_nodes": 30},
    "deep-chain": {"levels": 12},
    "long-trajectory": {"tokens": 40},
}


def _same(a: Workload, b: Workload) -> bool:
    return (
        len(a.sequences) == len(b.sequences)
        and all(np.array_equal(x, y) for x, y in zip(a.sequences, b.sequences))
        and all(np.array_equal(x, y) for x, y in zip(a.loss_masks, b.loss_masks))
        and np.array_equal(a.rewards, b.rewards)
        and np.array_equal(a.groups, b.groups)
    )


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_deterministic_per_seed_and_well_formed(name):
    w = get_workload(name, seed=3, **SMALL[name])
    assert _same(w, get_workload(name, seed=3, **SMALL[name]))
    assert not _same(w, get_workload(name, seed=4, **SMALL[name]))
    assert w.name == name
    for seq, mask in zip(w.sequences, w.loss_masks):
        assert seq.dtype == np.int64 and mask.dtype == np.bool_ and seq.shape == mask.shape
        assert seq.size >= 1 and seq.min() >= 0 and seq.max() < 32000
    assert w.rewards.dtype == np.float64 and w.rewards.shape == w.groups.shape == (w.num_trajectories,)
    forest = w.forest()
    for i, seq in enumerate(w.sequences):
        np.testing.assert_array_equal(forest.trajectory(i), seq)
    np.testing.assert_array_equal(forest.loss_mask, np.concatenate(w.loss_masks))


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_vocab_bounds_token_ids(name):
    w = get_workload(name, vocab=97, **SMALL[name])
    assert max(int(s.max()) for s in w.sequences) < 97


def test_registry_errors_list_the_names():
    with pytest.raises(ValueError, match="caterpillar, deep-chain, grpo-group, long-trajectory, random-tree, swe-like"):
        get_workload("swe_like")
    with pytest.raises(TypeError, match="'grpo-group' takes no scale"):
        get_workload("grpo-group", scale=0.5)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("swe-like", {"scale": 0.005, "num_tasks": 0}, "num_tasks must be a positive integer"),
        ("swe-like", {"scale": 0.005, "fork_prob": 1.5}, "fork_prob must be a probability"),
        ("grpo-group", {"completion_lens": []}, "len\\(completion_lens\\) must be a positive integer"),
        ("grpo-group", {"completion_lens": [2.7, 3]}, "completion_lens\\[0\\] must be a positive integer"),
        ("caterpillar", {"turns": 0}, "turns must be a positive integer"),
        ("random-tree", {"prefix_prob": 2.0}, "prefix_prob must be a probability"),
        ("deep-chain", {"node_len": (5, 2)}, "node_len must be a \\(low, high\\) pair"),
        ("deep-chain", {"node_len": 3}, "node_len must be a \\(low, high\\) pair"),
    ],
)
def test_bad_arguments_are_named(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        get_workload(name, **kwargs)


def test_workload_rejects_misaligned_masks():
    with pytest.raises(ValueError, match="trajectory 1"):
        Workload(
            "x",
            [np.zeros(3, np.int64)] * 2,
            [np.zeros(3, bool), np.zeros(2, bool)],
            np.zeros(2),
            np.zeros(2, np.int64),
        )


def test_grpo_group_wide_fanout():
    w = grpo_group(prompt_len=5, completion_lens=[1] * 40 + [3] * 30)
    f = w.forest()
    assert f.num_trajectories == f.num_leaves == 70 and f.height == 2
    assert f.num_compact_tokens == 5 + 40 + 90
    assert all(not m[:5].any() and m[5:].all() for m in w.loss_masks)


@pytest.mark.parametrize("trunk", [pytest.param([63, 64, 65, 1], id="chunk-edges"), pytest.param(7, id="uniform")])
def test_caterpillar_shape(trunk):
    w = caterpillar(turns=4, trunk_len=trunk, leaf_len=[1, 2, 3, 4])
    f = w.forest()
    trunk = np.broadcast_to(trunk, 4)
    assert [s.size for s in w.sequences] == [int(trunk[: k + 1].sum()) + k + 1 for k in range(4)]
    assert f.num_compact_tokens == trunk.sum() + 10
    assert f.height == 4  # the last trunk segment and its leaf form one node
    assert [int(m.sum()) for m in w.loss_masks] == [1, 2, 3, 4]


def test_many_groups_and_caterpillars_are_one_tree_each():
    """The scale study's batches: ``groups`` GRPO prompts x G completions, ``trees`` caterpillars; each
    its own tree, one advantage group per tree, the same per-tree shape as one alone."""
    w = grpo_group(prompt_len=6, G=3, groups=4, max_completion=5)
    f = w.forest()
    assert f.roots.size == 4 and f.num_trajectories == 12 and f.num_leaves == 12
    assert w.groups.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    one, many = caterpillar(turns=5), caterpillar(turns=5, trees=3)
    assert many.forest().roots.size == 3 and many.groups.tolist() == [0] * 5 + [1] * 5 + [2] * 5
    assert [s.size for s in many.sequences] == [s.size for s in one.sequences] * 3
    assert many.forest().num_nodes == 3 * one.forest().num_nodes


def test_deep_chain_levels():
    w = deep_chain(levels=45, fanout=3)
    f = w.forest()
    assert f.height == 46
    assert f.num_trajectories == 45 * 2 + 1 + 1
    assert f.num_leaves == 45 * 2 + 1


def test_random_tree_has_prefixes_duplicates_and_one_token_nodes():
    seen = {"duplicate": False, "prefix": False}
    for seed in range(5):
        w = random_tree(num_nodes=40, max_node_len=3, seed=seed)
        seqs = [tuple(s) for s in w.sequences]
        seen["duplicate"] |= len(set(seqs)) < len(seqs)
        seen["prefix"] |= any(a != b and b[: len(a)] == a for a in seqs for b in seqs)
        assert len(np.unique(w.groups)) == 2  # two roots
    assert all(seen.values())
    assert min(random_tree(max_node_len=1).forest().node_len) == 1


def test_swe_like_statistics_at_cpu_scale():
    w = swe_like(CPU_SCALE)
    f = w.forest()
    assert 700 <= f.num_trajectories <= 1400
    assert 3_000 <= f.num_compact_tokens <= 30_000
    assert 4.5 <= f.compression <= 7.0
    assert f.roots.size == 1  # one shared system prompt
    assert np.array_equal(np.unique(w.groups), np.arange(5))
    assert set(np.unique(w.rewards)) <= {0.0, 1.0}
    for m in w.loss_masks:
        assert not m[:50].any() and m[-1]  # system prompt untrained; the sample ends with its call
    assert len({s.tobytes() for s in w.sequences}) == w.num_trajectories  # forks add no copies


@pytest.mark.parametrize("seed", [0, 1])
def test_swe_like_compression_band_across_scales(seed):
    small, mid = swe_like(CPU_SCALE, seed), swe_like(0.05, seed)
    assert 4.5 <= small.forest().compression <= 7.0
    assert 4.5 <= mid.forest().compression <= 7.0
    # The structure is drawn at scale 1: shape, rewards and groups do not depend on the scale.
    assert small.num_trajectories == mid.num_trajectories
    np.testing.assert_array_equal(small.rewards, mid.rewards)
    np.testing.assert_array_equal(small.groups, mid.groups)


def test_swe_like_fork_branches_a_sample_in_two():
    """One block per episode (no resets): siblings share system + task; a fork shares more."""
    one_block = {"scale": 0.01, "num_tasks": 1, "sample_prob": 0.0, "max_context": 10**9}
    siblings = swe_like(**one_block, group_size=2, fork_prob=0.0).sequences
    forked = swe_like(**one_block, group_size=1, fork_prob=1.0).sequences
    assert len(siblings) == len(forked) == 2

    def lcp(a: np.ndarray, b: np.ndarray) -> int:
        n = min(a.size, b.size)
        return int(np.flatnonzero(a[:n] != b[:n])[0])

    assert lcp(*forked) > lcp(*siblings) > 100  # the system prompt alone is 100 tokens here
