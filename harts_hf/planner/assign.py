"""Data-parallel rank assignment: whole subtrees ("branches") to ranks, shared tops replicated.

Ranks exchange nothing but gradients (DESIGN: accelerate's gradient sync does the rest), so a
rank computes every ancestor its tokens need. The planner therefore gives each rank whole
subtrees (*branches*) and lets each rank recompute the shared chains above them (*tops*: the system
prompt, a task prompt); the copies are the plan's redundancy, and keeping a rank's branches under few
tops keeps them small.

Branches: a tree whose cost is at most ``total / (4 * world_size)`` is one branch; a larger node whose
split pays (``find_branches``, by a :class:`BranchRule`) is a top and its children are considered in
turn. Branches that share a parent top form a *group*. The planner tries every rule of
:data:`BRANCH_RULES` (keep trees that fit one microbatch whole, or divide them; split only where it
shrinks the largest indivisible part by a quarter, or by anything) and keeps the plan with the
lowest predicted step time: the cost model decides whether a shared prefix recomputed on another
rank beats an idle rank.

Assignment: binary search on the rank capacity; for a capacity, ranks are filled one after
another, each walking the groups in DFS order and taking, largest first, the branches that still fit
(paying the group's top chains the rank does not hold yet). Siblings under one top can go in any
order, which lets small branches fill what the large ones leave. A local search then trades one or
two branches between the largest rank and another while that lowers it (``_refine``). The fill
is one scalar walk over the groups (a rank starts from the leftovers of the ranks before it, so it
cannot run ranks side by side); what it reads is built once per search (``_Groups``), and the top
chains a rank holds follow from the DFS order of the groups, not from a set.

Legend: M nodes, U branches, G groups, R ranks, I intervals, K top chains, S nodes of the groups' paths
(their lengths' sum), L the longest path.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import accumulate, pairwise
from operator import neg

import numpy as np

from ..trees import by_level
from .geometry import Geometry

__all__ = [
    "BRANCH_RULES",
    "Assignment",
    "BranchRule",
    "RankIntervals",
    "assign_ranks",
    "find_branches",
    "group_paths",
    "rank_intervals",
]

BRANCHES_PER_RANK = 4  # a branch costs at most 1 / (BRANCHES_PER_RANK * R) of the forests
MIN_GAIN = 0.25  # splitting a node must shrink its largest indivisible part by this fraction
TRADE_LIMIT = 2_000_000  # trades x top chains the local search evaluates per kind and step
LOOKAHEAD = 1  # groups with leftovers a rank walks past to fill its last gap


@dataclass(frozen=True)
class BranchRule:
    """When a node is split into branches of its children (see :func:`find_branches`).

    Args:
        divide_fitting: a tree that fits one microbatch may be divided between ranks (its shared
            chains then run on every rank that takes a part of it).
        min_gain: splitting must shrink the node's largest indivisible part by this fraction of its
            subtree (0: by anything).
    """

    divide_fitting: bool
    min_gain: float


BRANCH_RULES = (BranchRule(False, MIN_GAIN), BranchRule(True, MIN_GAIN), BranchRule(True, 0.0))
"""The rules ``plan`` tries, in order; the first is the only one for a single rank."""


@dataclass(frozen=True, eq=False)
class Assignment:
    """Branches and their ranks.

    Args:
        branch_node: [U] root node of each branch (its subtree is the branch), DFS order.
        branch_cost: [U] cost of each branch's subtree.
        branch_group: [U] group of each branch.
        group_path: [G] list of top nodes (root first) above each group's branches.
        branch_rank: [U] rank computing each branch.
    """

    branch_node: np.ndarray
    branch_cost: np.ndarray
    branch_group: np.ndarray
    group_path: list[np.ndarray]
    branch_rank: np.ndarray


@dataclass(frozen=True, eq=False)
class RankIntervals:
    """Each rank's tokens as global DFS intervals, sorted by (rank, lo): the rank's *sequence*.

    Every interval is one top chain (``branch == -1``) or one branch's subtree; the sequence of a rank
    is a DFS pre-order of the tokens it computes (its closure under ancestors).

    Args:
        rank, lo, hi, branch: [I]. replica: [I] bool, tokens another rank owns (recomputed here).
        atomic: [I] bool, a whole tree that fits one microbatch: kept whole where balance allows
            (``pack.py``).
    """

    rank: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    branch: np.ndarray
    replica: np.ndarray
    atomic: np.ndarray


def find_branches(
    geo: Geometry,
    world_size: int,
    max_tokens: int,
    rule: BranchRule = BRANCH_RULES[0],
    per_rank: float = BRANCHES_PER_RANK,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(branch root nodes [U], group of each branch [U], group top node [G], -1 for whole trees).

    A node is split (becomes a top) when its subtree costs more than a branch may (``1 / per_rank``
    of a rank's share: a rank takes several, or, where branches are cut between ranks, one), splitting pays
    (its chain plus the largest part its children can be cut into, ``h``, is at most
    ``1 - rule.min_gain`` of its subtree, or below it for a gain of 0: at a gain of a quarter a
    caterpillar's trunk never pays, every rank taking a leaf would recompute the trunk), its tree
    does not fit one microbatch unless ``rule.divide_fitting``, and its parent is split.
    ``h(v) = min(sub(v), own(v) + max over children h(c))``, bottom-up, one step per level.
    """
    m = geo.num_nodes
    sub = geo.prefix(geo.end) - geo.cum[:-1]  # [M] subtree cost
    own = geo.node_cost
    levels = by_level(geo.level)  # root level first
    h = sub.copy()
    child_h = np.zeros(m)  # largest h among each node's children
    for ch in levels[:0:-1]:
        np.maximum.at(child_h, geo.parent[ch], h[ch])
        par = np.unique(geo.parent[ch])
        h[par] = np.minimum(sub[par], own[par] + child_h[par])
    has_child = np.bincount(geo.parent[geo.parent >= 0], minlength=m) > 0
    part = own + child_h
    pays = part <= (1 - rule.min_gain) * sub if rule.min_gain > 0 else part < sub
    big = (sub > geo.total_cost / (per_rank * world_size)) & has_child & pays & (world_size > 1)
    top = big if rule.divide_fitting else big & (geo.end - geo.start > max_tokens)[geo.root]
    for ch in levels[1:]:
        top[ch] &= top[geo.parent[ch]]
    parent_top = np.where(geo.parent >= 0, top[np.maximum(geo.parent, 0)], True)
    branch_node = np.flatnonzero(~top & parent_top)
    parent = geo.parent[branch_node]
    # Groups in DFS order of their top; whole trees (no top) last, as gap fillers.
    key = np.where(parent >= 0, parent, m)
    group_key, branch_group = np.unique(key, return_inverse=True)
    group_node = np.where(group_key < m, group_key, -1)
    return branch_node, branch_group, group_node


def _path_nodes(geo: Geometry, group_node: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(node [S], length [G]): the top nodes from the root down to each group node, packed group after
    group (none for the whole-tree group). Climbed one level a step, a group only while it has a parent:
    the work is S, where a [G, L] table is G times the deepest path (the square of a deep chain)."""
    length = np.where(group_node >= 0, geo.level[np.maximum(group_node, 0)] + 1, 0)
    real = group_node >= 0
    node = np.empty(int(length.sum()), dtype=np.int64)
    at, v = (np.cumsum(length) - 1)[real], group_node[real]
    while v.size:
        node[at] = v
        up = geo.parent[v] >= 0
        at, v = at[up] - 1, geo.parent[v[up]]
    return node, length


def _paths(node: np.ndarray, length: np.ndarray) -> list[np.ndarray]:
    """Each group's path, unpacked."""
    return np.split(node, np.cumsum(length)[:-1])


def group_paths(geo: Geometry, group_node: np.ndarray) -> list[np.ndarray]:
    """Top nodes from the root down to each group node (empty for the whole-tree group)."""
    return _paths(*_path_nodes(geo, group_node))


def _path_costs(node: np.ndarray, length: np.ndarray, node_cost: np.ndarray) -> np.ndarray:
    """[G] cost of each group's top chains, one numpy sum per path length: the sums round as
    ``node_cost[path].sum()`` does, so the capacity search starts where it always did."""
    start = np.cumsum(length) - length
    order = np.argsort(length, kind="stable")
    bounds = np.flatnonzero(np.diff(length[order], prepend=-1, append=-1))
    out = np.zeros(length.size)
    for a, b in pairwise(bounds.tolist()):
        rows = order[a:b]
        out[rows] = node_cost[node[start[rows, None] + np.arange(length[rows[0]])]].sum(axis=1)
    return out


@dataclass(slots=True)
class _Branches:
    """The branches of a group not taken yet, largest first, with their running sums ``acc`` (left to
    right, as a rank adds them up), which ``_take`` bisects instead of walking them. Few objects a
    group (slots, a one-branch group's sums are its costs): the search makes one per group, and
    every container it allocates brings the interpreter's next full garbage collection nearer, which
    walks every object of the process (0.2 s in a process that has imported torch)."""

    ids: list[int]
    sizes: list[float]
    acc: list[float]

    @classmethod
    def of(cls, ids: list[int], sizes: list[float]) -> _Branches:
        return cls(ids, sizes, sizes if len(sizes) == 1 else list(accumulate(sizes)))

    def without(self, taken: list[int]) -> _Branches:
        """The leftovers once ``taken`` (positions, increasing) are gone."""
        gone = set(taken)
        keep = [i for i in range(len(self.ids)) if i not in gone]
        return _Branches.of([self.ids[i] for i in keep], [self.sizes[i] for i in keep])


@dataclass(frozen=True)
class _Groups:
    """What every fill of the capacity search reads, built once per assignment. Python lists: the
    fill walks them one group at a time (each rank starts from the leftovers of the ranks before
    it, so the walk is sequential), and scalar steps cost a fraction of numpy calls on a few
    branches.

    Args:
        members: [G] branches of each group (ids and costs, largest first).
        depth: [G] top chains above each group's branches.
        reach: [G] cost of those top chains, summed root first: a rank holding the first d of them
            (their own reach: ``shared_reach`` or a group's ``reach``) pays the difference to take a
            branch of the group. One number a group, where a table of what each d leaves to pay grows
            with the square of a deep chain.
        shared: [G] top chains group g shares with group g + 1. Groups are in DFS order of their
            top, so the chains a rank holds on reaching group g are those it shares with the last
            group it took from: the smallest ``shared`` on the way.
        shared_reach: [G] reach of the ``shared[g]`` chains (0 for none).
    """

    members: list[_Branches | None]
    num_branches: int
    depth: list[int]
    reach: list[float]
    shared: list[int]
    shared_reach: list[float]


def _groups(
    geo: Geometry,
    group_node: np.ndarray,
    paths: tuple[np.ndarray, np.ndarray],
    branch_cost: np.ndarray,
    branch_group: np.ndarray,
) -> _Groups:
    """``group_node`` [G] in DFS order (-1, the whole-tree group, last); ``paths``: ``_path_nodes``."""
    node, depth = paths
    num_groups = group_node.size
    by_group = np.lexsort((-branch_cost, branch_group))
    bounds = np.searchsorted(branch_group[by_group], np.arange(num_groups + 1)).tolist()
    ids, sizes = by_group.tolist(), branch_cost[by_group].tolist()
    # reach of every top, root first, a level a step (the first: its cost, as a sum starts)
    tops, node_cost = np.flatnonzero(np.bincount(node, minlength=geo.num_nodes)), geo.node_cost
    reach = np.zeros(geo.num_nodes + 1)  # [M + 1]: the last, 0, for no node
    for k, at in enumerate(by_level(geo.level[tops])):
        v = tops[at]
        reach[v] = node_cost[v] if k == 0 else reach[geo.parent[v]] + node_cost[v]
    # Two group nodes u < v (DFS order) share as many tops as the shallowest node after u up to v has
    # above it (its level): its parent is their deepest common top (u itself when u is above v); across
    # trees that node is a root, level 0.
    real = group_node[group_node >= 0]
    if np.any(np.diff(real) <= 0) or np.any(group_node[real.size :] >= 0):
        raise ValueError("assign_ranks: groups must be in DFS order of their tops, whole trees last (find_branches)")
    shared, common = np.zeros(num_groups, dtype=np.int64), np.full(num_groups, -1)
    if real.size > 1:
        key = geo.level[: real[-1] + 1].astype(np.int64) * geo.num_nodes + np.arange(real[-1] + 1)  # level, node
        low = np.minimum.reduceat(key, real[:-1] + 1)  # [G' - 1] over (u, v]
        shared[: real.size - 1] = low // geo.num_nodes
        common[: real.size - 1] = geo.parent[low % geo.num_nodes]
    return _Groups(
        members=[_Branches.of(ids[a:b], sizes[a:b]) if b > a else None for a, b in pairwise(bounds)],
        num_branches=branch_cost.size,
        depth=depth.tolist(),
        reach=reach[group_node].tolist(),
        shared=shared.tolist(),
        shared_reach=reach[common].tolist(),
    )


def _take(branches: _Branches, room: float) -> tuple[list[int], float]:
    """Positions of the branches a rank with ``room`` left takes, and the room left then: the longest
    prefix that fits, then each branch that still fits, in order (found by bisection: the costs
    decrease, so the next one that fits is the first not above the room)."""
    acc, sizes = branches.acc, branches.sizes
    k = bisect_right(acc, room)
    if k:
        room -= acc[k - 1] if k < 8 else float(np.sum(sizes[:k]))  # numpy sums 8 terms and more pairwise
    taken = list(range(k))
    i = bisect_left(sizes, -room, k, key=neg)
    while i < len(sizes):
        taken.append(i)
        room -= sizes[i]
        i = bisect_left(sizes, -room, i + 1, key=neg)
    return taken, room


def _fill(capacity: float, groups: _Groups, world_size: int) -> np.ndarray | None:
    """Ranks of the branches at this capacity (see module docstring), or None if they do not fit."""
    members = list(groups.members)  # leftovers: entries replaced, never mutated
    depth, reach, shared, shared_reach = groups.depth, groups.reach, groups.shared, groups.shared_reach
    end = len(members)
    rank = [-1] * groups.num_branches
    first = 0
    for r in range(world_size):
        load, held, held_reach, skipped, last = 0.0, 0, 0.0, 0, r == world_size - 1
        for g in range(first, end):
            if g > first and shared[g - 1] < held:
                held, held_reach = shared[g - 1], shared_reach[g - 1]
            branches = members[g]
            if branches is None:
                continue
            room = capacity - load - (reach[g] - held_reach)
            whole = branches.acc[-1]
            if whole <= room and len(branches.ids) < 8:  # the whole group fits (most hold one branch)
                for i in branches.ids:
                    rank[i] = r
                load = capacity - (room - whole)  # as ``_take`` leaves it
                held, held_reach = depth[g], reach[g]
                members[g] = branches = None
            elif branches.sizes[-1] <= room:  # the smallest fits: something is taken
                taken, room = _take(branches, room)
                ids = branches.ids
                for i in taken:
                    rank[ids[i]] = r
                load = capacity - room
                held, held_reach = depth[g], reach[g]
                members[g] = branches = None if len(taken) == len(ids) else branches.without(taken)
            if branches is not None and not last:
                skipped += 1
                if skipped > LOOKAHEAD:
                    break  # the next rank starts with this group's leftovers
        while first < end and members[first] is None:
            first += 1
    return np.array(rank, dtype=np.int64) if first == end else None


def _bundles(branches: np.ndarray, rank: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Single branches (second member -1) or, for size 2, pairs of branches on one rank: (first, second)."""
    if size == 1:
        return branches, np.full(branches.size, -1)
    i, j = np.triu_indices(branches.size, k=1)
    same = rank[branches[i]] == rank[branches[j]]
    return branches[i[same]], branches[j[same]]


@dataclass(frozen=True, eq=False)
class _Tops:
    """The top chains each branch needs, kept sparse (K tops, S nodes of the groups' paths): a dense
    [U, K] table grows with the square of the forest at large world sizes, a [G, L] one with the square
    of a deep chain.

    Args:
        cost: [K] cost of each top chain, in node order. index: [S] the groups' paths (``_path_nodes``)
            as indices into ``cost``; start, length: [G] each group's run of it. group: [U] group of each
            branch.
    """

    cost: np.ndarray
    index: np.ndarray
    start: np.ndarray
    length: np.ndarray
    group: np.ndarray

    @classmethod
    def of(cls, node: np.ndarray, length: np.ndarray, node_cost: np.ndarray, group: np.ndarray) -> _Tops:
        held = np.bincount(node, minlength=node_cost.size) > 0
        index = np.cumsum(held)[node] - 1
        return cls(node_cost[held], index, np.cumsum(length) - length, length, group)

    def pairs(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(i, top) [P]: branch u[i] (-1: none) needs top."""
        g = self.group[np.maximum(u, 0)]
        n = np.where(u >= 0, self.length[g], 0)
        i = np.repeat(np.arange(u.size), n)
        return i, self.index[np.repeat(self.start[g] - np.cumsum(n) + n, n) + np.arange(i.size)]

    def rows(self, u: np.ndarray) -> np.ndarray:
        """[n, K] 1 where branch u (-1: none) needs a top."""
        i, top = self.pairs(u)
        out = np.zeros((u.size, self.cost.size), dtype=np.int64)
        out[i, top] = 1
        return out

    def count(self, rank: np.ndarray, world_size: int) -> np.ndarray:
        """[R, K] branches of each rank needing each top."""
        k = self.cost.size
        branch, top = self.pairs(np.arange(self.group.size))
        return np.bincount(rank[branch] * k + top, minlength=world_size * k).reshape(world_size, k)


def _trade(
    load: np.ndarray,
    count: np.ndarray,
    held_cost: np.ndarray,
    cost: np.ndarray,
    tops: _Tops,
    a: int,
    give: tuple[np.ndarray, np.ndarray],
    take: tuple[np.ndarray, np.ndarray],
    to: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """New loads of rank ``a`` and of the other rank when ``a`` gives bundle ``give`` [X] and takes
    bundle ``take`` [Y] from rank ``to`` [Y] (``take`` may be empty: -1, -1): ([X, Y], [X, Y]).
    Top chains are counted exactly: a rank pays one while any of its branches needs it (``count``
    [R, K]; ``held_cost`` [R]: what each rank pays for its tops now)."""

    def sums(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c = np.where(first >= 0, cost[first], 0.0) + np.where(second >= 0, cost[second], 0.0)
        return c, tops.rows(first) + tops.rows(second)

    xc, xn = sums(*give)
    yc, yn = sums(*take)
    # a rank holds a top while its count stays positive; compared on [Y, K] sums, the only [X, Y, K]
    # arrays are the two masks
    held_a = (count[a] + yn)[None] > xn[:, None]  # [X, Y, K]
    held_b = xn[:, None] > (yn - count[to])[None]
    new_a = load[a] - held_cost[a] - xc[:, None] + yc[None] + held_a @ tops.cost
    new_b = (load[to] - held_cost[to] - yc)[None] + xc[:, None] + held_b @ tops.cost
    return new_a, new_b


def _refine(rank: np.ndarray, cost: np.ndarray, tops: _Tops, world_size: int) -> np.ndarray:
    """Local search on the largest rank load: apply the trade that lowers it most (rank a gives one
    of its branches, or two, to another rank and takes nothing, one or two of that rank's branches back;
    never two for two), while one does. Trades of one branch each way come first; pairs only when
    those are exhausted. Vectorised over the trades of a step; the counts of tops follow the trades."""
    rank = rank.copy()
    count = tops.count(rank, world_size)
    for _ in range(4 * rank.size):
        held_cost = (count > 0) @ tops.cost  # [R], once a step: every trade of the step reads it
        load = np.bincount(rank, weights=cost, minlength=world_size) + held_cost
        a = int(np.argmax(load))
        mine, other = np.flatnonzero(rank == a), np.flatnonzero(rank != a)
        others = np.delete(np.arange(world_size), a)
        nothing = (np.full(others.size, -1), np.full(others.size, -1))
        best = None
        for sizes in (((1, 0), (1, 1)), ((2, 0), (2, 1), (1, 2))):
            for give_size, take_size in sizes:
                n_give = mine.size**give_size
                n_take = others.size if take_size == 0 else other.size**take_size
                if n_give * n_take * max(tops.cost.size, 1) > 2 * TRADE_LIMIT:  # pairs counted twice here
                    continue
                give = _bundles(mine, rank, give_size)
                take = nothing if take_size == 0 else _bundles(other, rank, take_size)
                to = others if take_size == 0 else rank[take[0]]
                new_a, new_b = _trade(load, count, held_cost, cost, tops, a, give, take, to)
                score = np.maximum(new_a, new_b)
                if score.size and (best is None or score.min() < best[0]):
                    i, j = np.unravel_index(np.argmin(score), score.shape)
                    best = (score[i, j], give[0][i], give[1][i], take[0][j], take[1][j], to[j])
            if best is not None and best[0] < load[a] * (1 - 1e-12):
                break
        if best is None or best[0] >= load[a] * (1 - 1e-12):
            return rank
        _, g1, g2, t1, t2, b = best
        given, taken = np.array([g1, g2]), np.array([t1, t2])
        rank[given[given >= 0]] = b
        rank[taken[taken >= 0]] = a
        moved = tops.rows(given).sum(axis=0) - tops.rows(taken).sum(axis=0)  # [K]
        count[a] -= moved
        count[b] += moved
    return rank


def assign_ranks(
    geo: Geometry,
    world_size: int,
    branches: tuple[np.ndarray, np.ndarray, np.ndarray],
    node_extra: np.ndarray | None = None,
) -> Assignment:
    """The rank of every branch of ``branches`` (what :func:`find_branches` returns): binary search on the
    rank capacity, then local search. ``node_extra`` [M]: a cost charged to a branch rooted at each
    node besides its tokens (``plan``'s round-charged candidate: its linear-attention rounds)."""
    branch_node, branch_group, group_node = branches
    branch_cost = geo.prefix(geo.end[branch_node]) - geo.cum[branch_node]
    if node_extra is not None:
        branch_cost = branch_cost + node_extra[branch_node]
    node, length = _path_nodes(geo, group_node)
    node_cost = geo.node_cost
    if world_size == 1:
        rank = np.zeros(branch_node.size, dtype=np.int64)
    else:
        groups = _groups(geo, group_node, (node, length), branch_cost, branch_group)
        path_cost = _path_costs(node, length, node_cost)
        lo = max(geo.total_cost / world_size, float((branch_cost + path_cost[branch_group]).max()))
        hi = lo
        while (rank := _fill(hi, groups, world_size)) is None:
            lo, hi = hi, hi * 1.25
        best = rank
        while hi - lo > 1e-5 * hi:
            mid = (lo + hi) / 2
            got = _fill(mid, groups, world_size)
            if got is None:
                lo = mid
            else:
                hi, best = mid, got
        rank = _refine(best, branch_cost, _Tops.of(node, length, node_cost, branch_group), world_size)
    return Assignment(branch_node, branch_cost, branch_group, _paths(node, length), rank)


def _rank_tops(asg: Assignment) -> tuple[np.ndarray, np.ndarray]:
    """(rank, node) [T] of every top chain each rank computes, once each: the union of the paths of the
    groups it takes branches from. A rank's groups walked in DFS order of their tops, a path adds what
    lies below its common prefix with the previous one (two root paths part once and never meet
    again), so the pairs come without a sort of every (branch, top) pair, which grows with the square
    of a deep chain."""
    path_len = np.array([p.size for p in asg.group_path], dtype=np.int64)
    flat = np.concatenate(asg.group_path + [np.zeros(0, dtype=np.int64)])
    off = np.cumsum(path_len) - path_len
    top = np.full(path_len.size, -1)  # [G] group top, -1 for whole trees
    top[path_len > 0] = flat[(off + path_len - 1)[path_len > 0]]
    num_groups = path_len.size
    taken = np.unique(asg.branch_rank * num_groups + asg.branch_group)  # (rank, group) pairs
    rank, group = taken // num_groups, taken % num_groups
    order = np.lexsort((top[group], rank))
    rank, group = rank[order], group[order]
    prev = np.r_[group[:1], group[:-1]]  # the previous pair's group
    after = np.r_[False, rank[1:] == rank[:-1]]  # a pair after another of its rank
    overlap = np.where(after, np.minimum(path_len[group], path_len[prev]), 0)  # [n]
    pair = np.repeat(np.arange(group.size), overlap)
    col = np.arange(pair.size) - np.repeat(np.cumsum(overlap) - overlap, overlap)
    same = flat[off[group[pair]] + col] == flat[off[prev[pair]] + col]
    common = np.bincount(pair[same], minlength=group.size)
    new = path_len[group] - common
    at = np.repeat(off[group] + common - np.cumsum(new) + new, new) + np.arange(new.sum())
    return np.repeat(rank, new), flat[at]


def rank_intervals(geo: Geometry, asg: Assignment, world_size: int, max_tokens: int) -> RankIntervals:
    """Every rank's top chains and branches as sorted DFS intervals; a top's owner is the lowest
    rank that computes it, the others hold replicas."""
    top_rank, top_node = _rank_tops(asg)
    owner = np.full(geo.num_nodes, world_size, dtype=np.int64)
    np.minimum.at(owner, top_node, top_rank)

    u = asg.branch_node
    whole_fit = (geo.parent[u] < 0) & (geo.end[u] - geo.start[u] <= max_tokens)
    rank = np.concatenate((top_rank, asg.branch_rank))
    lo = np.concatenate((geo.start[top_node], geo.start[u]))
    hi = np.concatenate((geo.start[top_node] + geo.length[top_node], geo.end[u]))
    branch = np.concatenate((np.full(top_node.size, -1), np.arange(u.size)))
    replica = np.concatenate((top_rank != owner[top_node], np.zeros(u.size, dtype=bool)))
    atomic = np.concatenate((np.zeros(top_node.size, dtype=bool), whole_fit))
    order = np.lexsort((lo, rank))
    return RankIntervals(rank[order], lo[order], hi[order], branch[order], replica[order], atomic[order])
