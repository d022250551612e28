"""Small seeded tree shapes for tests: the corner cases tree kernels must get right.

Every shape is a tree of nodes (runs of tokens) whose siblings start with distinct tokens, so
the prefix forest has exactly the intended branching. Trajectories are root-to-node paths;
loss masks are per node. Node lengths are free (not multiples of 64; 1-token nodes allowed).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..checks import require_positive_ints, require_probabilities
from .spans import assemble, node_pool, tree_paths
from .workload import Workload

__all__ = ["caterpillar", "deep_chain", "grpo_group", "long_trajectory", "random_tree"]


def _tree_workload(
    name: str,
    rng: np.random.Generator,
    parent: np.ndarray,
    node_len: np.ndarray,
    trained: np.ndarray,
    ends: np.ndarray,
    vocab: int,
) -> Workload:
    """Trajectory i = the root path of node ``ends[i]``; group = the index of its root."""
    if node_len.min() < 1:
        raise ValueError(f"{name}: every node needs at least one token, got lengths {node_len.tolist()}")
    pool, start = node_pool(rng, parent, node_len, vocab)
    traj, node = tree_paths(parent, ends)
    seqs, masks = assemble(pool, traj, start[node], node_len[node], trained[node], ends.size)
    first = np.flatnonzero(np.r_[True, traj[1:] != traj[:-1]])
    roots = np.flatnonzero(parent < 0)
    groups = np.searchsorted(roots, node[first]).astype(np.int64)
    return Workload(name, seqs, masks, rng.random(ends.size), groups)


def _per_node(value: int | Sequence[int], count: int, what: str) -> np.ndarray:
    arr = np.asarray(value, dtype=np.int64)
    if arr.ndim == 0:
        arr = np.full(count, arr)
    if arr.shape != (count,):
        raise ValueError(f"{what}: want one length or {count} lengths, got shape {arr.shape}")
    return arr


def grpo_group(
    prompt_len: int = 37,
    completion_lens: Sequence[int] | None = None,
    G: int = 4,
    *,
    groups: int = 1,
    max_completion: int = 50,
    seed: int = 0,
    vocab: int = 32000,
) -> Workload:
    """``groups`` prompts (not trained; one tree each) with G completions (trained) each, of random
    lengths in [1, max_completion], or of ``completion_lens`` when given (then G = their number, the
    same lengths in every group): a GRPO batch of ``groups`` x G rows."""
    require_positive_ints(
        "grpo_group", prompt_len=prompt_len, G=G, groups=groups, max_completion=max_completion, vocab=vocab
    )
    rng = np.random.default_rng(seed)
    if completion_lens is None:
        completion_lens = rng.integers(1, max_completion + 1, (groups, G))
    else:
        require_positive_ints("grpo_group", **{"len(completion_lens)": len(completion_lens)})
        require_positive_ints("grpo_group", **{f"completion_lens[{i}]": n for i, n in enumerate(completion_lens)})
    lens = np.broadcast_to(np.asarray(completion_lens, dtype=np.int64), (groups, np.shape(completion_lens)[-1]))
    g = lens.shape[1]
    # nodes: the prompts, then every group's completions
    parent = np.r_[np.full(groups, -1), np.repeat(np.arange(groups), g)]
    node_len = np.r_[np.full(groups, prompt_len), lens.ravel()]
    trained = np.r_[np.zeros(groups, dtype=bool), np.ones(groups * g, dtype=bool)]
    return _tree_workload("grpo-group", rng, parent, node_len, trained, np.arange(groups, groups * (g + 1)), vocab)


def caterpillar(
    turns: int = 6,
    trunk_len: int | Sequence[int] = 23,
    leaf_len: int | Sequence[int] = 9,
    *,
    trees: int = 1,
    seed: int = 0,
    vocab: int = 32000,
) -> Workload:
    """The agentic shape: a trunk of ``turns`` segments with a side leaf (trained) per turn; ``trees``
    of them (the same lengths, their own tokens).

    Trajectory k of a tree = trunk segments 0..k + leaf k. Lengths are one int or one per turn.
    """
    require_positive_ints("caterpillar", turns=turns, trees=trees, vocab=vocab)
    rng = np.random.default_rng(seed)
    trunk = np.tile(_per_node(trunk_len, turns, "trunk_len"), trees)
    leaf = np.tile(_per_node(leaf_len, turns, "leaf_len"), trees)
    segment = np.arange(trees * turns)  # [trees * turns] trunk nodes, then the leaves in the same order
    parent = np.r_[np.where(segment % turns == 0, -1, segment - 1), segment]
    trained = np.r_[np.zeros(segment.size, dtype=bool), np.ones(segment.size, dtype=bool)]
    ends = segment.size + segment
    return _tree_workload("caterpillar", rng, parent, np.r_[trunk, leaf], trained, ends, vocab)


def random_tree(
    num_nodes: int = 24,
    *,
    roots: int = 2,
    max_node_len: int = 70,
    prefix_prob: float = 0.25,
    duplicate_prob: float = 0.1,
    seed: int = 0,
    vocab: int = 32000,
) -> Workload:
    """A random recursive forest: node v >= ``roots`` hangs under a uniform earlier node.

    Trajectories end at every leaf, at internal nodes with probability ``prefix_prob`` (strict
    prefixes of others), and each is repeated with probability ``duplicate_prob``. Node
    lengths are uniform in [1, max_node_len]; loss masks are random per node.
    """
    require_positive_ints("random_tree", num_nodes=num_nodes, roots=roots, max_node_len=max_node_len, vocab=vocab)
    require_probabilities("random_tree", prefix_prob=prefix_prob, duplicate_prob=duplicate_prob)
    if not 1 <= roots <= num_nodes:
        raise ValueError(f"random_tree: need 1 <= roots <= num_nodes, got roots={roots}, num_nodes={num_nodes}")
    rng = np.random.default_rng(seed)
    v = np.arange(num_nodes)
    parent = np.where(v < roots, -1, np.floor(rng.random(num_nodes) * v).astype(np.int64))
    node_len = rng.integers(1, max_node_len + 1, num_nodes)
    trained = rng.random(num_nodes) < 0.5
    is_leaf = np.bincount(parent[parent >= 0], minlength=num_nodes) == 0
    ends = np.flatnonzero(is_leaf | (rng.random(num_nodes) < prefix_prob))
    ends = np.repeat(ends, 1 + (rng.random(ends.size) < duplicate_prob))
    return _tree_workload("random-tree", rng, parent, node_len, trained, ends, vocab)


def deep_chain(
    levels: int = 48,
    *,
    fanout: int = 2,
    node_len: tuple[int, int] = (1, 9),
    seed: int = 0,
    vocab: int = 32000,
) -> Workload:
    """A chain of branches: ``levels`` chain nodes, each with ``fanout`` children (the next chain
    node and leaves; the last chain node has only leaves), so the forest is ``levels + 1`` node
    levels high. Leaves are trained. The last chain node also ends a trajectory (a strict prefix
    of its leaves). Node lengths are uniform in ``node_len`` (inclusive)."""
    require_positive_ints("deep_chain", levels=levels, fanout=fanout, vocab=vocab)
    if fanout < 2:
        raise ValueError(f"deep_chain: need fanout >= 2 (the next chain node and a leaf), got {fanout}")
    if np.shape(node_len) != (2,) or not 1 <= node_len[0] <= node_len[1]:
        raise ValueError(f"deep_chain: node_len must be a (low, high) pair with 1 <= low <= high, got {node_len!r}")
    rng = np.random.default_rng(seed)
    chain_parent = np.arange(-1, levels - 1)
    leaf_parent = np.r_[np.repeat(np.arange(levels), fanout - 1), levels - 1]
    parent = np.r_[chain_parent, leaf_parent]
    lens = rng.integers(node_len[0], node_len[1] + 1, parent.size)
    trained = np.r_[np.zeros(levels, dtype=bool), np.ones(leaf_parent.size, dtype=bool)]
    ends = np.r_[np.arange(levels, parent.size), levels - 1]
    return _tree_workload("deep-chain", rng, parent, lens, trained, ends, vocab)


def long_trajectory(tokens: int = 524_288, *, seed: int = 0, vocab: int = 32000) -> Workload:
    """One trained trajectory of ``tokens`` tokens (one node): longer than the budget, it runs as pieces,
    serially on one rank or as a context-parallel group (``harts_hf.planner.groups``)."""
    require_positive_ints("long_trajectory", tokens=tokens, vocab=vocab)
    rng = np.random.default_rng(seed)
    parent, lens, trained = np.array([-1]), np.array([tokens]), np.array([True])
    return _tree_workload("long-trajectory", rng, parent, lens, trained, np.array([0]), vocab)
