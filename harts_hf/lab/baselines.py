"""Baseline partitioners, measured side by side with :func:`plan` on the same cost model and budget.

- ``per_trajectory``: no sharing (trajectory-wise training): trajectories spread over ranks by
  LPT on their cost, then packed first-fit-decreasing into microbatches of the budget per rank; a
  trajectory longer than the budget runs in consecutive microbatches, each as long as the budget
  allows beside its context (what any trainer must do to stay within memory).
- ``trie_packing`` (AReaL tree training): trajectories, longest first, first-fit into prefix tries
  of at most the budget; every trie is one microbatch computed from scratch, so a prefix shared by
  two tries is computed twice; tries spread over ranks by LPT (a trajectory longer than the budget, a
  trie alone, in consecutive microbatches as above).
- ``dfs_kcut`` (AReaL-DTA): the DFS order cut into ``world_size`` contiguous ranges by binary
  search on the cost model (each rank recomputes its range's ancestors), each range then cut
  greedily into microbatches of the budget.
- ``exact`` (Tree Training's partitioner): OR-Tools CP-SAT assigns the finest branches :func:`plan`'s
  rules make to ranks minimising the largest rank cost (shared chains counted on every rank that needs them), then the
  same slot cut as :func:`plan`. Small instances only; skipped with a message without ortools.

Every baseline reports a [R, S] microbatch cost table; ranks with fewer microbatches idle (cost 0).

Legend: B trajectories, R ranks, S slots, U branches.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..forest import RolloutForest
from ..planner.assign import BRANCH_RULES, Assignment, RankIntervals, find_branches, group_paths, rank_intervals
from ..planner.balance import rank_imbalance, slot_imbalance, step_seconds
from ..planner.cost import CostModel
from ..planner.geometry import Geometry
from ..planner.memory import Budget, MemoryModel
from ..planner.node_parts import node_parts_of
from ..planner.plan import Plan, build_plan
from ..planner.slots import slot_pieces
from ..planner.split import budget_cuts

__all__ = ["BASELINES", "Baseline", "dfs_kcut", "exact", "per_trajectory", "run_baselines", "trie_packing"]

EXACT_MAX_BRANCHES = 400  # CP-SAT instances beyond this many branches are not "small"
EXACT_SECONDS = 10.0  # CP-SAT time limit
TRIE_MAX_TRAJECTORIES = 8192  # trie packing keeps two [B, B] int32 tables of common prefixes


@dataclass
class Baseline:
    """A baseline's microbatch costs [R, S], redundancy and planning time (or why it was skipped);
    ``plan`` when the baseline's microbatches are a plan of the shared forests (dfs_kcut, exact),
    else ``cost_model``, whose forward share and seconds outside the model calls (at as many ranks
    as ``cost`` has rows) its step is priced with, as ours is (``Plan.step_seconds``)."""

    cost: np.ndarray | None
    redundancy: float | None
    plan_seconds: float | None
    extra: dict = field(default_factory=dict)
    plan: Plan | None = None
    cost_model: CostModel | None = None

    @property
    def step_seconds(self) -> float:
        if self.plan is not None:
            return self.plan.step_seconds
        return step_seconds(self.cost, share=self.cost_model.forward_share) + self.cost_model.outside(
            self.cost.shape[0]
        )

    def record(self) -> dict:
        if self.cost is None:
            return {"imbalance": None, "redundancy": None, "step_seconds": None, "plan_seconds": None, **self.extra}
        return {
            "imbalance": {"slot": slot_imbalance(self.cost), "rank": rank_imbalance(self.cost)},
            "redundancy": self.redundancy,
            "step_seconds": self.step_seconds,
            "plan_seconds": self.plan_seconds,
            **self.extra,
        }


def _lpt(cost: np.ndarray, world_size: int) -> np.ndarray:
    """Rank of every item: largest first onto the least loaded rank (one step per item)."""
    rank = np.empty(cost.size, dtype=np.int64)
    load = np.zeros(world_size)
    for i in np.argsort(-cost, kind="stable"):
        r = int(np.argmin(load))
        rank[i] = r
        load[r] += cost[i]
    return rank


def _table(rank: np.ndarray, cost: np.ndarray, world_size: int) -> np.ndarray:
    """[R, S] microbatch costs, each rank's microbatches largest first, zero-padded."""
    order = np.lexsort((-cost, rank))
    count = np.bincount(rank, minlength=world_size)
    slot = np.arange(rank.size) - np.repeat(np.cumsum(count) - count, count)
    table = np.zeros((world_size, max(int(count.max()), 1)))
    table[rank[order], slot] = cost[order]
    return table


def _first_fit(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """Bin of every item, first fit in the given order (one step per item)."""
    free: list[int] = []
    out = np.empty(sizes.size, dtype=np.int64)
    for i, s in enumerate(sizes.tolist()):
        j = next((k for k, f in enumerate(free) if f >= s), len(free))
        if j == len(free):
            free.append(capacity)
        free[j] -= s
        out[i] = j
    return out


def _ends(geo: Geometry, forests: Sequence[RolloutForest]) -> np.ndarray:
    """[B] global last token of every trajectory."""
    return np.concatenate([f.restore[f.traj_offsets[1:] - 1] + geo.forest_tokens[i] for i, f in enumerate(forests)])


def _path_cost(cost: CostModel, depth: np.ndarray) -> np.ndarray:
    """Token cost of the first ``depth`` tokens of one path (a token at depth p reads p + 1 keys)."""
    d = np.asarray(depth, dtype=np.float64)
    return cost.token * d + cost.pair * d * (d + 1) / 2


def _over_budget(length: np.ndarray, budget: Budget, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """Paths longer than the budget (a trajectory; a trie of one) as consecutive microbatches, each
    as long as the budget allows beside its context (``Budget.room``), as ``plan`` and the DFS K-cut
    must: ``(index of its path, microbatch seconds)`` of every microbatch, path by path in order."""
    item, lo, hi = [], [], []
    start = np.zeros(length.size, dtype=np.int64)
    while (live := np.flatnonzero(start < length)).size:
        end = np.minimum(start[live] + np.maximum(budget.room(start[live]), 1), length[live])
        item.append(live)
        lo.append(start[live])
        hi.append(end)
        start[live] = end
    item, lo, hi = (np.concatenate(x + [np.zeros(0, dtype=np.int64)]) for x in (item, lo, hi))
    order = np.lexsort((lo, item))
    seconds = _path_cost(cost, hi) - _path_cost(cost, lo) + cost.round + cost.microbatch
    return item[order], seconds[order]


def per_trajectory(forests: Sequence[RolloutForest], world_size: int, budget: Budget, cost: CostModel) -> Baseline:
    began = time.perf_counter()
    length = np.concatenate([f.lengths for f in forests]).astype(np.int64)
    traj_cost = _path_cost(cost, length)
    rank = _lpt(traj_cost, world_size)
    long = np.flatnonzero(length > budget.tokens)  # computed in pieces, each its own microbatch
    part, part_cost = _over_budget(length[long], budget, cost)
    mb_rank, mb_cost = [rank[long[part]]], [part_cost]
    for r in range(world_size):
        mine = np.flatnonzero((rank == r) & (length <= budget.tokens))
        mine = mine[np.argsort(-length[mine], kind="stable")]
        bins = _first_fit(length[mine], budget.tokens)
        n = int(bins.max()) + 1 if bins.size else 0
        mb_rank.append(np.full(n, r))
        mb_cost.append(np.bincount(bins, weights=traj_cost[mine], minlength=n) + cost.round + cost.microbatch)
    table = _table(np.concatenate(mb_rank), np.concatenate(mb_cost), world_size)
    compact = sum(f.num_compact_tokens for f in forests)
    return Baseline(table, float(length.sum() / compact - 1), time.perf_counter() - began, cost_model=cost)


def trie_packing(forests: Sequence[RolloutForest], world_size: int, budget: Budget, cost: CostModel) -> Baseline:
    began = time.perf_counter()
    geo = Geometry.of(forests, cost)
    ends = _ends(geo, forests)
    b = ends.size
    if b > TRIE_MAX_TRAJECTORIES:
        return Baseline(None, None, None, {"skipped": f"{b} trajectories > {TRIE_MAX_TRAJECTORIES}"})
    length = geo.token_depth(ends) + 1
    dfs = np.argsort(ends, kind="stable")  # lexicographic order of the trajectories
    pos = np.empty(b, dtype=np.int64)
    pos[dfs] = np.arange(b)
    adj = geo.common_prefix(ends[dfs[:-1]], ends[dfs[1:]]).astype(np.int32)  # [B - 1]
    lcp = np.zeros((b, b), dtype=np.int32)  # LCP of sorted trajectories i, k: min of adj between them
    for i in range(b - 1):
        lcp[i, i + 1 :] = np.minimum.accumulate(adj[i:])
    lcp = np.maximum(lcp, lcp.T)
    np.fill_diagonal(lcp, length[dfs])
    shared = np.zeros((b, b), dtype=np.int32)  # [sorted trajectory, trie] longest prefix in the trie
    size = np.zeros(b, dtype=np.int64)
    trie = np.empty(b, dtype=np.int64)
    used = 0
    for i in np.argsort(-length, kind="stable"):
        p = pos[i]
        new = length[i] - shared[p, :used]
        fit = np.flatnonzero(size[:used] + new <= budget.tokens)
        m = int(fit[0]) if fit.size else used
        used = max(used, m + 1)
        size[m] += length[i] - shared[p, m]
        shared[:, m] = np.maximum(shared[:, m], lcp[p])
        trie[i] = m
    which, lo, hi = geo.path_intervals(ends, inclusive=True)
    stride = geo.num_tokens + 1
    key, inv = np.unique(trie[which] * stride + lo, return_inverse=True)  # one interval per (trie, node)
    top = np.zeros(key.size, dtype=np.int64)
    np.maximum.at(top, inv, hi)
    t_id, t_lo = key // stride, key % stride
    rounds = node_parts_of(geo, t_id, t_lo, top, used).rounds
    token_cost = np.bincount(t_id, weights=geo.prefix(top) - geo.prefix(t_lo), minlength=used)
    trie_cost = token_cost + cost.round * rounds + cost.microbatch
    trie_rank = _lpt(trie_cost, world_size)
    long = np.flatnonzero(size[:used] > budget.tokens)  # a trajectory past the budget alone: in pieces
    part, part_cost = _over_budget(size[long], budget, cost)
    fits = np.flatnonzero(size[:used] <= budget.tokens)
    table = _table(
        np.concatenate((trie_rank[fits], trie_rank[long[part]])),
        np.concatenate((trie_cost[fits], part_cost)),
        world_size,
    )
    return Baseline(table, float(size[:used].sum() / geo.num_tokens - 1), time.perf_counter() - began, cost_model=cost)


def dfs_kcut(
    forests: Sequence[RolloutForest], world_size: int, budget: Budget, cost: CostModel, chunk: int, memory: MemoryModel
) -> Baseline:
    began = time.perf_counter()
    geo = Geometry.of(forests, cost)
    n = geo.num_tokens

    def cut(capacity: float) -> np.ndarray | None:
        starts, lo = [], 0
        for _ in range(world_size):
            starts.append(lo)
            room = capacity - geo.path_cost(geo.token_depth(np.array([lo])))[0]
            lo = min(n, max(lo + 1, int(geo.token_at(geo.prefix(np.array([lo]))[0] + room))))
            if lo >= n:
                return np.array(starts)
        return None

    lo_c, hi_c = geo.total_cost / world_size, geo.total_cost
    starts = cut(hi_c)
    while hi_c - lo_c > 1e-5 * hi_c:
        mid = (lo_c + hi_c) / 2
        if (got := cut(mid)) is None:
            lo_c = mid
        else:
            hi_c, starts = mid, got
    which, a_lo, a_hi = geo.path_intervals(starts)  # each rank recomputes its range's ancestors
    bounds = np.unique(np.concatenate((starts, geo.start[geo.parent < 0], [n])))  # ranges split at trees
    own = np.searchsorted(starts, bounds[:-1], side="right") - 1
    rank = np.concatenate((which, own))
    lo = np.concatenate((a_lo, bounds[:-1]))
    hi = np.concatenate((a_hi, bounds[1:]))
    replica = np.concatenate((np.ones(which.size, dtype=bool), np.zeros(own.size, dtype=bool)))
    order = np.lexsort((lo, rank))
    iv = RankIntervals(
        rank[order],
        lo[order],
        hi[order],
        np.where(replica, -1, rank)[order],
        replica[order],
        np.zeros(rank.size, dtype=bool),
    )
    pieces = budget_cuts(geo, iv, world_size, budget)
    p = build_plan(geo, list(forests), pieces, cost, budget, memory, chunk, began, world_size)
    return Baseline(p.cost, p.redundancy, p.plan_seconds, plan=p)


def exact(
    forests: Sequence[RolloutForest],
    world_size: int,
    budget: Budget,
    cost: CostModel,
    chunk: int,
    memory: MemoryModel,
    seconds: float = EXACT_SECONDS,
) -> Baseline:
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        return Baseline(None, None, None, {"skipped": "ortools is not installed (pip install ortools)"})
    began = time.perf_counter()
    geo = Geometry.of(forests, cost)
    # the finest branches any rule of the planner makes: the solver's optimum bounds every rule's plan
    branch_node, branch_group, group_node = find_branches(geo, world_size, budget.tokens, BRANCH_RULES[-1])
    if branch_node.size > EXACT_MAX_BRANCHES:
        too_big = f"{branch_node.size} branches > {EXACT_MAX_BRANCHES}: not a small instance"
        return Baseline(None, None, None, {"skipped": too_big})
    branch_cost = geo.prefix(geo.end[branch_node]) - geo.cum[branch_node]
    paths = group_paths(geo, group_node)
    tops = np.unique(np.concatenate(paths + [np.zeros(0, dtype=np.int64)]))
    scale = 1e7 / geo.total_cost
    c_branch = np.rint(branch_cost * scale).astype(int).tolist()
    c_top = np.rint(geo.node_cost[tops] * scale).astype(int).tolist()
    top_index = {int(k): i for i, k in enumerate(tops)}

    model = cp_model.CpModel()
    x = [[model.NewBoolVar(f"x{u}_{r}") for r in range(world_size)] for u in range(branch_node.size)]
    y = [[model.NewBoolVar(f"y{k}_{r}") for r in range(world_size)] for k in range(tops.size)]
    z = model.NewIntVar(0, sum(c_branch) + sum(c_top), "z")
    for u in range(branch_node.size):
        model.AddExactlyOne(x[u])
        for k in paths[branch_group[u]].tolist():
            for r in range(world_size):
                model.AddImplication(x[u][r], y[top_index[k]][r])
    for r in range(world_size):
        load = sum(c * x[u][r] for u, c in enumerate(c_branch)) + sum(c * y[k][r] for k, c in enumerate(c_top))
        model.Add(load <= z)
    model.Add(x[0][0] == 1)  # ranks are interchangeable
    model.Minimize(z)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.random_seed = 0
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = seconds
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Baseline(None, None, None, {"skipped": f"CP-SAT found no solution in {seconds:g} s"})
    branch_rank = np.array([[solver.Value(v) for v in row].index(1) for row in x], dtype=np.int64)
    asg = Assignment(branch_node, branch_cost, branch_group, paths, branch_rank)
    iv = rank_intervals(geo, asg, world_size, budget.tokens)
    pieces = slot_pieces(geo, iv, world_size, budget, chunk, cost, memory)
    p = build_plan(geo, list(forests), pieces, cost, budget, memory, chunk, began, world_size)
    extra = {"optimal": status == cp_model.OPTIMAL, "rank_cost_bound": solver.BestObjectiveBound() / scale}
    return Baseline(p.cost, p.redundancy, p.plan_seconds, extra, p)


BASELINES = ("per_trajectory", "trie_packing", "dfs_kcut", "exact")


def run_baselines(
    forests: Sequence[RolloutForest], ours: Plan, exact_seconds: float = EXACT_SECONDS
) -> dict[str, dict]:
    """Every baseline's record on ``ours``'s forests, world size, budget and cost model; the exact
    solver's entry adds ``gap``: our largest rank token cost over its proven lower bound, minus 1,
    where that bound binds us: not once our plan exchanges between ranks (handoffs, CP groups), which
    the solver's model of whole branches per rank does not have."""
    args = (list(forests), ours.world_size, ours.budget, ours.cost_model)
    runs = {
        "per_trajectory": per_trajectory(*args),
        "trie_packing": trie_packing(*args),
        "dfs_kcut": dfs_kcut(*args, ours.chunk_size, ours.memory_model),
        "exact": exact(*args, ours.chunk_size, ours.memory_model, exact_seconds),
    }
    out = {name: run.record() for name, run in runs.items()}
    bound = out["exact"].get("rank_cost_bound")
    if bound and (ours.handoffs or ours.groups):
        out["exact"]["gap_skipped"] = "harts exchanges between ranks, which the exact solver's bound does not model"
    elif bound:
        cm = ours.cost_model
        token_cost = ours.cost - cm.round * ours.rounds - cm.microbatch * (ours.tokens > 0)
        out["exact"]["gap"] = float(token_cost.sum(axis=1).max() / bound - 1)
    return out
