"""Nasty rollout-tree shapes shared by the tree-op tests.

Every builder takes a ``numpy.random.Generator`` and returns the trajectories as
``list[list[int]]`` (token ids), ready for ``RolloutForest.from_sequences``. Shapes stay small
(a few hundred compact tokens) so per-trajectory oracles run fast on CPU; the ones named after
63/64/65 put a branch point at the edge of a 64-token chunk grid.

Use ``@pytest.mark.parametrize("build", nasty_tree_params())`` and ``build(rng)`` in a test.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

__all__ = ["NASTY_TREES", "nasty_tree_params"]

VOCAB = 1 << 20  # large enough that random segments never share a prefix by accident


def _seg(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n).tolist()


def grpo_group(rng: np.random.Generator) -> list[list[int]]:
    """One shared prompt, G = 8 completions of mixed lengths (1 token included)."""
    prompt = _seg(rng, 40)
    return [prompt + _seg(rng, n) for n in (1, 3, 17, 30, 8, 25, 2, 12)]


def caterpillar(rng: np.random.Generator) -> list[list[int]]:
    """A trunk of 12 turns with a side leaf per turn (per-turn samples), plus the full trunk."""
    trunk: list[int] = []
    seqs = []
    for _ in range(12):
        trunk = trunk + _seg(rng, int(rng.integers(3, 12)))
        seqs.append(trunk + _seg(rng, int(rng.integers(1, 6))))
    seqs.append(trunk)
    return seqs


def _branch_at(depth: int) -> Callable[[np.random.Generator], list[list[int]]]:
    def build(rng: np.random.Generator) -> list[list[int]]:
        """Children start at position ``depth``: the shared prefix holds ``depth`` tokens."""
        prefix = _seg(rng, depth)
        return [prefix + _seg(rng, n) for n in (1, 5, 70)]

    build.__name__ = f"branch_at_{depth}"
    return build


def one_token_nodes(rng: np.random.Generator) -> list[list[int]]:
    """Random strings over a 2-letter alphabet: nearly every node is a single token."""
    return [rng.integers(0, 2, size=int(rng.integers(1, 12))).tolist() for _ in range(40)]


def strict_prefix(rng: np.random.Generator) -> list[list[int]]:
    """A trajectory that ends inside another one's chain (and a shorter one inside that)."""
    long = _seg(rng, 30)
    return [long, long[:17], long[:5] + _seg(rng, 4)]


def duplicates(rng: np.random.Generator) -> list[list[int]]:
    """The same trajectory several times, next to a distinct sibling."""
    a = _seg(rng, 20)
    b = a[:8] + _seg(rng, 9)
    return [a, b, a, a, b]


def many_roots(rng: np.random.Generator) -> list[list[int]]:
    """20 unrelated trees (context resets / sub-agents), every other one branching in two."""
    seqs = []
    for i in range(20):
        root = _seg(rng, int(rng.integers(1, 9)))
        seqs.append(root)
        if i % 2:
            seqs += [root + _seg(rng, int(rng.integers(1, 5))) for _ in range(2)]
    return seqs


def deep_chain(rng: np.random.Generator) -> list[list[int]]:
    """45 branch levels: every step of a trunk of 1-3 token segments sheds a 1-2 token leaf."""
    trunk: list[int] = []
    seqs = []
    for _ in range(45):
        trunk = trunk + _seg(rng, int(rng.integers(1, 4)))
        seqs.append(trunk + _seg(rng, int(rng.integers(1, 3))))
    seqs.append(trunk)
    return seqs


def wide_fanout(rng: np.random.Generator) -> list[list[int]]:
    """One node with 70 children (more than 64), each 1-4 tokens long."""
    prefix = _seg(rng, 10)
    return [prefix + _seg(rng, int(rng.integers(1, 5))) for _ in range(70)]


NASTY_TREES: dict[str, Callable[[np.random.Generator], list[list[int]]]] = {
    "grpo_group": grpo_group,
    "caterpillar": caterpillar,
    "branch_at_63": _branch_at(63),
    "branch_at_64": _branch_at(64),
    "branch_at_65": _branch_at(65),
    "one_token_nodes": one_token_nodes,
    "strict_prefix": strict_prefix,
    "duplicates": duplicates,
    "many_roots": many_roots,
    "deep_chain": deep_chain,
    "wide_fanout": wide_fanout,
}


def nasty_tree_params() -> list:
    """``pytest.param(builder, id=name)`` for every nasty tree."""
    return [pytest.param(build, id=name) for name, build in NASTY_TREES.items()]
