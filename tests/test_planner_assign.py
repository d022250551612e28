"""The capacity search's take (``assign._take``) against its rule walked branch by branch; on a deep chain,
what the search reads per group and each rank's top chains against the paths walked node by node."""

from __future__ import annotations

import dataclasses
import math
from itertools import accumulate

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_hf.planner import DEFAULT_COST_MODEL
from harts_hf.planner.assign import (
    BRANCH_RULES,
    _Branches,
    _groups,
    _path_costs,
    _path_nodes,
    _rank_tops,
    _take,
    assign_ranks,
    find_branches,
    group_paths,
)
from harts_hf.planner.geometry import Geometry
from harts_hf.sources import deep_chain


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


def _deep_chain(world: int) -> tuple[Geometry, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A 60-level chain of branches cut by the rule that splits most: a group under nearly every level."""
    geo = Geometry.of([deep_chain(60, fanout=3, seed=world).forest()], DEFAULT_COST_MODEL)
    return geo, find_branches(geo, world, max_tokens=64, rule=BRANCH_RULES[-1])


def test_groups_on_a_deep_chain_are_their_paths_summed_root_first():
    """What the capacity search reads (``_groups``) against each group's path walked node by node:
    its reach summed root first to the bit (paths sharing a prefix share its sums, so a rank's held
    reach is any of them), the chains it shares with the next group and their reach, its path's cost
    as numpy sums it (where the search starts). What a rank pays to take a branch, its reach less the
    held reach, is the path's tail to rounding."""
    geo, (_, branch_group, group_node) = _deep_chain(4)
    node, length = _path_nodes(geo, group_node)
    paths = group_paths(geo, group_node)
    assert len(paths) > 40 and max(p.size for p in paths) > 40
    cost = geo.node_cost.tolist()
    sizes = np.ones(branch_group.size)
    got = _groups(geo, group_node, (node, length), sizes, branch_group)
    path_cost = _path_costs(node, length, geo.node_cost)
    for g, path in enumerate(paths):
        sums = [0.0, *accumulate(cost[v] for v in path)]
        after = paths[g + 1] if g + 1 < len(paths) else []
        shared = next((i for i, (a, b) in enumerate(zip(path, after)) if a != b), min(len(path), len(after)))
        assert (got.depth[g], got.reach[g]) == (path.size, sums[-1])
        assert (got.shared[g], got.shared_reach[g]) == (shared, sums[shared])
        assert path_cost[g] == geo.node_cost[path].sum()
        for held in range(path.size + 1):
            assert got.reach[g] - sums[held] == pytest.approx(math.fsum(cost[v] for v in path[held:]), rel=1e-12, abs=0)


@pytest.mark.parametrize("world", [2, 5])
def test_rank_tops_on_a_deep_chain_are_the_union_of_branch_paths(world):
    """Each rank's top chains (``_rank_tops``) are the nodes of its branches' group paths, each once: on
    the search's ranks and on ranks drawn at random (groups of a rank far apart)."""
    geo, branches = _deep_chain(world)
    asg = assign_ranks(geo, world, branches)
    drawn = dataclasses.replace(asg, branch_rank=np.random.default_rng(world).integers(0, world, asg.branch_rank.size))
    for a in (asg, drawn):
        rank, node = _rank_tops(a)
        got = list(zip(rank.tolist(), node.tolist()))
        want = {(r, v) for u, r in enumerate(a.branch_rank.tolist()) for v in a.group_path[a.branch_group[u]].tolist()}
        assert len(got) == len(set(got)) and set(got) == want


def test_groups_out_of_dfs_order_are_refused():
    """The shared tops of neighbour groups are read off the levels between their nodes in DFS order: any
    other order is refused, not planned on wrong sums."""
    geo, (branch_node, branch_group, group_node) = _deep_chain(4)
    last = group_node.size - 1 - (group_node[-1] < 0)  # the deepest top; whole trees stay last
    swap = np.arange(group_node.size)
    swap[[0, last]] = swap[[last, 0]]
    with pytest.raises(ValueError, match="DFS order"):
        assign_ranks(geo, 4, (branch_node, swap[branch_group], group_node[swap]))
