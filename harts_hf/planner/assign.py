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
loops per taken branch; branches are few (a few per rank, by construction).

Legend: M nodes, U branches, G groups, R ranks, I intervals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .geometry import Geometry

__all__ = [
    "BRANCH_RULES",
    "Assignment",
    "RankIntervals",
    "BranchRule",
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


def _levels_down(geo: Geometry) -> list[np.ndarray]:
    """Nodes grouped by level, root level first."""
    order = np.argsort(geo.level, kind="stable")
    bounds = np.searchsorted(geo.level[order], np.arange(geo.level.max() + 2))
    return [order[bounds[k] : bounds[k + 1]] for k in range(bounds.size - 1)]


def find_branches(
    geo: Geometry, world_size: int, max_tokens: int, rule: BranchRule = BRANCH_RULES[0]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(branch root nodes [U], group of each branch [U], group top node [G], -1 for whole trees).

    A node is split (becomes a top) when its subtree costs more than a branch may, splitting pays
    (its chain plus the largest part its children can be cut into, ``h``, is at most
    ``1 - rule.min_gain`` of its subtree, or below it for a gain of 0: at a gain of a quarter a
    caterpillar's trunk never pays, every rank taking a leaf would recompute the trunk), its tree
    does not fit one microbatch unless ``rule.divide_fitting``, and its parent is split.
    ``h(v) = min(sub(v), own(v) + max over children h(c))``, bottom-up, one step per level.
    """
    m = geo.num_nodes
    sub = geo.prefix(geo.end) - geo.cum[:-1]  # [M] subtree cost
    own = geo.node_cost
    levels = _levels_down(geo)
    h = sub.copy()
    child_h = np.zeros(m)  # largest h among each node's children
    for ch in levels[:0:-1]:
        np.maximum.at(child_h, geo.parent[ch], h[ch])
        par = np.unique(geo.parent[ch])
        h[par] = np.minimum(sub[par], own[par] + child_h[par])
    has_child = np.bincount(geo.parent[geo.parent >= 0], minlength=m) > 0
    part = own + child_h
    pays = part <= (1 - rule.min_gain) * sub if rule.min_gain > 0 else part < sub
    big = (sub > geo.total_cost / (BRANCHES_PER_RANK * world_size)) & has_child & pays & (world_size > 1)
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


def group_paths(geo: Geometry, group_node: np.ndarray) -> list[np.ndarray]:
    """Top nodes from the root down to each group node (empty for the whole-tree group)."""
    paths = []
    chain = group_node.copy()
    steps = [chain]
    while (chain >= 0).any():
        chain = np.where(chain >= 0, geo.parent[np.maximum(chain, 0)], -1)
        steps.append(chain)
    table = np.stack(steps[::-1], axis=1)  # [G, levels], root first, -1 padded on the left
    for row in table:
        paths.append(row[row >= 0])
    return paths


def _fill(
    capacity: float,
    order: list[np.ndarray],
    cost: np.ndarray,
    paths: list[np.ndarray],
    node_cost: np.ndarray,
    world_size: int,
) -> np.ndarray | None:
    """Ranks of the branches at this capacity (see module docstring), or None if they do not fit.

    ``order[g]``: branches of group g, largest first.
    """
    rank = np.full(cost.size, -1, dtype=np.int64)
    left = [u.copy() for u in order]
    first = 0
    for r in range(world_size):
        load, held, skipped = 0.0, set(), 0
        last = r == world_size - 1
        for g in range(first, len(left)):
            branches = left[g]
            if not branches.size:
                continue
            need = sum(node_cost[n] for n in paths[g] if n not in held)
            cap = capacity - load - need
            sizes = cost[branches]  # descending
            take = np.zeros(branches.size, dtype=bool)
            # Largest-first: the longest prefix that fits, then the largest that fits what is left.
            k = int(np.searchsorted(np.cumsum(sizes), cap, side="right"))
            take[:k] = True
            cap -= sizes[:k].sum()
            while True:
                free = np.flatnonzero(~take & (sizes <= cap))
                if not free.size:
                    break
                take[free[0]] = True
                cap -= sizes[free[0]]
            if take.any():
                rank[branches[take]] = r
                load = capacity - cap
                held.update(paths[g].tolist())
                left[g] = branches[~take]
            if left[g].size and not last:
                skipped += 1
                if skipped > LOOKAHEAD:
                    break  # the next rank starts with this group's leftovers
        while first < len(left) and not left[first].size:
            first += 1
    return rank if first == len(left) else None


def _bundles(branches: np.ndarray, rank: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Single branches (second member -1) or, for size 2, pairs of branches on one rank: (first, second)."""
    if size == 1:
        return branches, np.full(branches.size, -1)
    i, j = np.triu_indices(branches.size, k=1)
    same = rank[branches[i]] == rank[branches[j]]
    return branches[i[same]], branches[j[same]]


def _trade(
    load: np.ndarray,
    count: np.ndarray,
    cost: np.ndarray,
    need: np.ndarray,
    top_cost: np.ndarray,
    a: int,
    give: tuple[np.ndarray, np.ndarray],
    take: tuple[np.ndarray, np.ndarray],
    to: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """New loads of rank ``a`` and of the other rank when ``a`` gives bundle ``give`` [X] and takes
    bundle ``take`` [Y] from rank ``to`` [Y] (``take`` may be empty: -1, -1): ([X, Y], [X, Y]).
    Top chains are counted exactly: a rank pays one while any of its branches needs it."""

    def sums(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c = np.where(first >= 0, cost[first], 0.0) + np.where(second >= 0, cost[second], 0.0)
        n = np.where(first[:, None] >= 0, need[first], 0) + np.where(second[:, None] >= 0, need[second], 0)
        return c, n

    xc, xn = sums(*give)
    yc, yn = sums(*take)
    held_cost = (count > 0) @ top_cost  # [R]
    cnt_a = count[a] - xn[:, None] + yn[None]  # [X, Y, K]
    cnt_b = count[to][None] - yn[None] + xn[:, None]
    new_a = load[a] - held_cost[a] - xc[:, None] + yc[None] + (cnt_a > 0) @ top_cost
    new_b = (load[to] - held_cost[to] - yc)[None] + xc[:, None] + (cnt_b > 0) @ top_cost
    return new_a, new_b


def _refine(
    rank: np.ndarray,
    cost: np.ndarray,
    group: np.ndarray,
    paths: list[np.ndarray],
    node_cost: np.ndarray,
    world_size: int,
) -> np.ndarray:
    """Local search on the largest rank load: apply the trade that lowers it most (rank a gives one
    of its branches, or two, to another rank and takes nothing, one or two of that rank's branches back;
    never two for two), while one does. Trades of one branch each way come first; pairs only when
    those are exhausted. Vectorised over the trades of a step."""
    tops = np.unique(np.concatenate(paths + [np.zeros(0, dtype=np.int64)]))
    on_path = np.zeros((len(paths), tops.size), dtype=np.int64)  # [G, K]
    for g, p in enumerate(paths):
        on_path[g, np.searchsorted(tops, p)] = 1
    top_cost = node_cost[tops]  # [K]
    need = on_path[group]  # [U, K]
    rank = rank.copy()
    for _ in range(4 * rank.size):
        count = np.zeros((world_size, tops.size), dtype=np.int64)  # [R, K] branches needing each top
        np.add.at(count, rank, need)
        load = np.bincount(rank, weights=cost, minlength=world_size) + (count > 0) @ top_cost
        a = int(np.argmax(load))
        mine, other = np.flatnonzero(rank == a), np.flatnonzero(rank != a)
        others = np.delete(np.arange(world_size), a)
        nothing = (np.full(others.size, -1), np.full(others.size, -1))
        best = None
        for sizes in (((1, 0), (1, 1)), ((2, 0), (2, 1), (1, 2))):
            for give_size, take_size in sizes:
                n_give = mine.size**give_size
                n_take = others.size if take_size == 0 else other.size**take_size
                if n_give * n_take * max(tops.size, 1) > 2 * TRADE_LIMIT:  # pairs counted twice here
                    continue
                give = _bundles(mine, rank, give_size)
                take = nothing if take_size == 0 else _bundles(other, rank, take_size)
                to = others if take_size == 0 else rank[take[0]]
                new_a, new_b = _trade(load, count, cost, need, top_cost, a, give, take, to)
                score = np.maximum(new_a, new_b)
                if score.size and (best is None or score.min() < best[0]):
                    i, j = np.unravel_index(np.argmin(score), score.shape)
                    best = (score[i, j], give[0][i], give[1][i], take[0][j], take[1][j], to[j])
            if best is not None and best[0] < load[a] * (1 - 1e-12):
                break
        if best is None or best[0] >= load[a] * (1 - 1e-12):
            return rank
        _, g1, g2, t1, t2, b = best
        rank[[u for u in (g1, g2) if u >= 0]] = b
        rank[[u for u in (t1, t2) if u >= 0]] = a
    return rank


def assign_ranks(geo: Geometry, world_size: int, branches: tuple[np.ndarray, np.ndarray, np.ndarray]) -> Assignment:
    """The rank of every branch of ``branches`` (what :func:`find_branches` returns): binary search on the
    rank capacity, then local search."""
    branch_node, branch_group, group_node = branches
    branch_cost = geo.prefix(geo.end[branch_node]) - geo.cum[branch_node]
    paths = group_paths(geo, group_node)
    node_cost = geo.node_cost
    by_group = np.lexsort((-branch_cost, branch_group))
    bounds = np.searchsorted(branch_group[by_group], np.arange(group_node.size + 1))
    order = [by_group[bounds[g] : bounds[g + 1]] for g in range(group_node.size)]
    if world_size == 1:
        rank = np.zeros(branch_node.size, dtype=np.int64)
    else:
        path_cost = np.array([node_cost[p].sum() for p in paths])
        lo = max(geo.total_cost / world_size, float((branch_cost + path_cost[branch_group]).max()))
        hi = lo
        while (rank := _fill(hi, order, branch_cost, paths, node_cost, world_size)) is None:
            lo, hi = hi, hi * 1.25
        best = rank
        while hi - lo > 1e-5 * hi:
            mid = (lo + hi) / 2
            got = _fill(mid, order, branch_cost, paths, node_cost, world_size)
            if got is None:
                lo = mid
            else:
                hi, best = mid, got
        rank = _refine(best, branch_cost, branch_group, paths, node_cost, world_size)
    return Assignment(branch_node, branch_cost, branch_group, paths, rank)


def rank_intervals(geo: Geometry, asg: Assignment, world_size: int, max_tokens: int) -> RankIntervals:
    """Every rank's top chains and branches as sorted DFS intervals; a top's owner is the lowest
    rank that computes it, the others hold replicas."""
    path_len = np.array([p.size for p in asg.group_path], dtype=np.int64)
    flat = np.concatenate(asg.group_path + [np.zeros(0, dtype=np.int64)])
    off = np.concatenate(([0], np.cumsum(path_len)))
    reps = path_len[asg.branch_group]
    pos = np.repeat(off[asg.branch_group], reps) + np.arange(reps.sum()) - np.repeat(np.cumsum(reps) - reps, reps)
    pairs = np.unique(np.stack([np.repeat(asg.branch_rank, reps), flat[pos]], axis=1), axis=0).reshape(-1, 2)
    top_rank, top_node = pairs[:, 0], pairs[:, 1]
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
