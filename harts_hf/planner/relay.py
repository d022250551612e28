"""The relay: every token once; a branch cut between two ranks is handed from the first's early slot
to the next's late slot, and the chains above the branches run first, once, as a context-parallel group.

Why: on agentic batches (swe-like: a system prompt, task prompts, ~160 episode segments of 5-50K
tokens at 64 ranks) the rank-wise plan recomputes the task prompts, and the trunks of segments it
splits between ranks, on every rank that reads them (redundancy 0.14), and those extra tokens push
ranks past the graph budget, so their earlier slots rerun in the backward. The DFS cut
(``wavefront.py``) runs every token once but each span of a slot reads the one before it: a
wavefront as deep as the slot has ranks.

Layout, the tops' slots then slots 1..S:
- the *tops* (``assign.find_branches`` with branches of up to one rank's share: the chains above
  them, a system prompt and task prompts) run first, once, over the first k ranks (k is whichever of
  :data:`TOP_SHARES` predicts the lowest step), laid out either way (:func:`_even_tops`, in slot 0:
  their DFS order cut at equal cost, a context-parallel group that every later slot reads; or
  :func:`_fanned_tops`, against their fan-out: a top every rank reads costs its senders a message
  to each reader, so at hundreds of ranks the system prompt is spread thin over slot 0 and the task
  prompts, whole, follow in slot 1);
- the branches are packed over groups of about :data:`GROUP_RANKS` consecutive ranks (largest first
  onto the least loaded group, then moves and swaps off the busiest: :func:`_pack`), and each
  group's branches, ordered so that every cut between two ranks lands in a branch that both halves
  of it fit in their slots (DFS order first, then seeded shuffles: :func:`_ordered`), are cut into one
  range per rank at equal cost, each within its rank's token cap;
- a rank runs its range as [the head of the branch it shares with the next rank, its whole
  branches, the tail of the branch it shares with the previous one], cut at the same costs into
  slots 1..S on every rank: the head lies in the first slots, the tail that reads it in the last,
  so the read crosses ranks between slots (a handoff, no wait).

Pricing: ``crossreads.priced`` (a head that spills into its tail's slot streams: a wavefront).
Every cut lies on the chunk grid where its node reaches it (no replay there). The transfers and
waits priced on each rank (its *extra*), and each rank's excess over the graph budget (its earlier
slots would rerun), go back into the cut: the extra comes off the rank's share (the branches packed
again once, then the ranges cut again with the extra of each pass blended in) and the excess off its
token cap, for up to :data:`PASSES` passes while they predict lower; the lowest is kept.

Legend: R ranks, U branches, G groups, n a group's branches, W its ranks (the widest group's), Q queries
per group, S slots after the tops' slots, K top nodes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..runs import aranges
from . import crossreads
from .assign import BRANCH_RULES, find_branches, group_paths
from .cost import CostModel
from .geometry import Geometry
from .graphs import graph_excess
from .memory import Budget, MemoryModel
from .pieces import Pieces
from .planned import Plan

__all__ = ["relay_cut"]

GROUP_RANKS = 4  # ranks a group of branches is cut over (a group's ranges relay from one rank to the next)
TOP_SHARES = (4, 16)  # the tops' group runs over R / share ranks (at least one)
ORDER_TRIES = 32  # orders of a group's branches tried for cuts that land well (seen at 64 ranks: 8 left 2 spilling)
SLOT_TRIES = 3  # slot counts tried, from the fewest the budget allows, until one fits
PASSES = 4  # cuts re-made with each rank's priced extra and graph excess
LEVELS, LEVEL_ROUNDS = 33, 2  # a group's cost level where a token cap binds: levels tried at once, rounds
REPACK_GAIN = 0.8  # the most of the first pass's step the later passes are taken to win back (seen: 0.85)
EXTRA_BLEND = 0.5  # a later pass's extra: this share of the last pass's priced extra, the rest of the one before
CAP_FILL = 0.97  # a rank's first token cap, of the budget (context and the graph budget's slack aside)


@dataclass(frozen=True, eq=False)
class _Branches:
    """Subtrees run whole on one rank or cut between two: [U] DFS ranges, costs and tokens."""

    lo: np.ndarray
    hi: np.ndarray
    cost: np.ndarray
    tokens: np.ndarray


def _split(geo: Geometry, world_size: int, budget: Budget) -> tuple[_Branches, np.ndarray]:
    """(the branches, the top nodes [K] above them, DFS order): ``find_branches`` with branches of up
    to one rank's share, the largest a range can take whole or cut in two."""
    branch_node, _, group_node = find_branches(geo, world_size, budget.tokens, BRANCH_RULES[1], per_rank=1)
    tops = np.unique(np.concatenate([np.zeros(0, dtype=np.int64), *group_paths(geo, group_node)]))
    lo, hi = geo.start[branch_node], geo.end[branch_node]
    return _Branches(lo, hi, geo.prefix(hi) - geo.prefix(lo), hi - lo), tops


def _widths(world_size: int) -> np.ndarray:
    """[G] ranks per group: :data:`GROUP_RANKS`, the remainder one group more (a lone rank joins the last)."""
    count, rest = divmod(world_size, GROUP_RANKS)
    widths = [GROUP_RANKS] * count + ([rest] if rest else [])
    if len(widths) > 1 and widths[-1] == 1:
        widths[-2:] = [GROUP_RANKS + 1]
    return np.array(widths, dtype=np.int64)


def _pack(b: _Branches, widths: np.ndarray, extra: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """[U] the group of every branch: largest first onto the group whose load per rank (its
    ``extra`` [G] counted in) stays lowest within its token ``cap`` [G], then single moves and swaps
    off the busiest group while they lower it."""
    load, held = extra.astype(np.float64).copy(), np.zeros(widths.size)
    where = np.empty(b.cost.size, dtype=np.int64)
    for u in np.lexsort((b.lo, -b.cost)).tolist():
        room = held + b.tokens[u] <= cap
        g = int(np.argmin(np.where(room, (load + b.cost[u]) / widths, np.inf))) if room.any() else int(np.argmin(held))
        where[u], load[g], held[g] = g, load[g] + b.cost[u], held[g] + b.tokens[u]
    for _ in range(4 * widths.size):  # each step lowers the busiest group or stops
        per = load / widths
        top = int(np.argmax(per))
        mine, others = np.flatnonzero(where == top), np.flatnonzero(where != top)
        if mine.size == 0:  # its load is its extra alone
            break
        # a move of u to g, or a swap of u with v (v's group gains u - v): the new busier of the two
        delta = b.cost[mine][:, None] - np.r_[np.zeros(widths.size), b.cost[others]][None, :]  # [m, G + o]
        to = np.r_[np.arange(widths.size), where[others]]
        tok = b.tokens[mine][:, None] - np.r_[np.zeros(widths.size), b.tokens[others]][None, :]
        fits = (held[to] + tok <= cap[to]) & (held[top] - tok <= cap[top]) & (to != top) & (delta > 0)
        after = np.maximum(per[top] - delta / widths[top], (load[to] + delta) / widths[to])
        after = np.where(fits, after, np.inf)
        i, j = np.unravel_index(int(np.argmin(after)), after.shape)
        if not after[i, j] < per[top] * (1 - 1e-9):
            break
        u, g = mine[i], to[j]
        load[top], load[g] = load[top] - delta[i, j], load[g] + delta[i, j]
        held[top], held[g] = held[top] - tok[i, j], held[g] + tok[i, j]
        where[u] = g
        if j >= widths.size:
            where[others[j - widths.size]] = top
    return where


@dataclass(frozen=True, eq=False)
class _Runs:
    """Groups' runs side by side: each group's branches end to end in one order, as positions (tokens
    from its run's start). [G, n] arrays, padded past a group's ``count`` branches (positions and
    costs repeat its end there); queries are [G, Q], row g in group g's run. Searches count entries
    instead of bisecting, so each group's arithmetic is what it would be alone."""

    geo: Geometry
    chunk: int
    count: np.ndarray  # [G] branches
    lo: np.ndarray  # [G, n] DFS start of each branch
    hi: np.ndarray
    base: np.ndarray  # [G, n] prefix cost at each branch's start
    at: np.ndarray  # [G, n + 1] first position of each branch
    cum: np.ndarray  # [G, n + 1] the run's cost before each branch

    @classmethod
    def of(cls, geo: Geometry, b: _Branches, orders: list[np.ndarray], chunk: int) -> _Runs:
        """The runs of ``orders`` (one array of branch indices per group)."""
        count = np.array([o.size for o in orders], dtype=np.int64)
        index = np.full((count.size, int(count.max())), -1, dtype=np.int64)
        for g, order in enumerate(orders):
            index[g, : order.size] = order
        real = index >= 0
        pick = lambda v: np.where(real, v[np.maximum(index, 0)], 0)
        lo, first = pick(b.lo), np.zeros((count.size, 1), dtype=np.int64)
        at = np.concatenate((first, np.cumsum(pick(b.tokens), axis=1)), axis=1)
        cum = np.concatenate((first.astype(np.float64), np.cumsum(pick(b.cost), axis=1)), axis=1)
        return cls(geo, chunk, count, lo, pick(b.hi), geo.prefix(lo), at, cum)

    @property
    def end(self) -> np.ndarray:
        """[G] each run's length."""
        return self.at[np.arange(self.count.size), self.count]

    @property
    def total(self) -> np.ndarray:
        """[G] each run's cost."""
        return self.cum[np.arange(self.count.size), self.count]

    def select(self, rows: np.ndarray) -> _Runs:
        """The runs of groups ``rows``."""
        pick = {k: getattr(self, k)[rows] for k in ("count", "lo", "hi", "base", "at", "cum")}
        return _Runs(self.geo, self.chunk, **pick)

    def branch(self, table: np.ndarray, y: np.ndarray, strict: bool = False) -> np.ndarray:
        """[G, Q] the last branch whose ``table`` entry (``at`` or ``cum``) is at most (``strict``:
        below) ``y``, within each group's branches."""
        below = table[:, None, :] < y[..., None] if strict else table[:, None, :] <= y[..., None]
        return np.clip(below.sum(axis=-1) - 1, 0, self.count[:, None] - 1)

    def starts_branch(self, y: np.ndarray) -> np.ndarray:
        """[G, Q] whether each position is a branch's start (or the run's end)."""
        return (self.at[:, None, :] == y[..., None]).any(axis=-1)

    def cost_to(self, y: np.ndarray) -> np.ndarray:
        """[G, Q] each run's cost up to positions ``y``."""
        i = self.branch(self.at, y)
        take = lambda a: np.take_along_axis(a, i, axis=1)
        return take(self.cum) + self.geo.prefix(take(self.lo) + y - take(self.at)) - take(self.base)

    def at_cost(self, x: np.ndarray) -> np.ndarray:
        """[G, Q] the positions where each run's cost reaches ``x``, moved down to the chunk grid
        where their node reaches it (a branch's start is on it)."""
        i = self.branch(self.cum, x)
        take = lambda a: np.take_along_axis(a, i, axis=1)
        lo, hi = take(self.lo), take(self.hi)
        t = np.clip(np.floor(self.geo.token_at(take(self.base) + x - take(self.cum))).astype(np.int64), lo, hi)
        t = np.maximum(np.where(t > lo, self.geo.on_grid(t, self.chunk), t), lo)
        return np.where(x >= self.total[:, None], self.end[:, None], take(self.at) + t - lo)

    def ranges(self, extra: np.ndarray, cap: np.ndarray, width: np.ndarray) -> np.ndarray:
        """[G, W + 1] positions cutting each run into one range per rank of its group (``width`` [G]
        ranks; the cuts past them sit at the run's end), each within its rank's token ``cap``
        [G, W], the most any rank's cost plus ``extra`` [G, W] reaches as low as the caps allow: the
        lowest level that every rank filling up to it covers the run with (searched on a grid of
        levels, :data:`LEVELS` at a time, where a cap binds)."""
        real = np.arange(extra.shape[1]) < width[:, None]
        extra, cap = np.where(real, extra, 0.0), np.where(real, cap, np.inf)
        low = (self.total + extra.sum(axis=1)) / width * (1 + 1e-9)
        reach = np.cumsum(np.where(real, np.maximum(low[:, None] - extra, 0.0), 0.0), axis=1)
        cuts = np.concatenate((np.zeros((width.size, 1), dtype=np.int64), self.at_cost(reach)), axis=1)
        capped = np.flatnonzero(~(np.diff(cuts, axis=1) <= cap).all(axis=1))  # each rank up to the level
        if capped.size:
            runs, high = self.select(capped), np.where(real, extra, -np.inf).max(axis=1)[capped]
            cuts[capped] = runs._capped(extra[capped], cap[capped], width[capped], low[capped], high)
        return np.where(np.arange(cuts.shape[1]) < width[:, None], cuts, self.end[:, None])

    def _capped(
        self, extra: np.ndarray, cap: np.ndarray, width: np.ndarray, low: np.ndarray, most: np.ndarray
    ) -> np.ndarray:
        """:meth:`ranges` where a cap binds (``most`` [G]: each group's largest extra): the cuts at
        the level ``low`` [G], raised where they do not cover the run."""
        cuts = self._fill(extra, cap, low[:, None])[:, :, 0]
        binding = np.flatnonzero(cuts[np.arange(width.size), width] < self.end)
        if not binding.size:
            return cuts
        runs, extra, cap, width = self.select(binding), extra[binding], cap[binding], width[binding]
        low, high = low[binding], self.total[binding] + most[binding]
        searching = np.ones(binding.size, dtype=bool)
        for _ in range(LEVEL_ROUNDS):
            levels = np.stack([np.linspace(a, z, LEVELS) for a, z in zip(low, high)])
            covers = runs._fill(extra, cap, levels)[np.arange(width.size), width] >= runs.end[:, None]
            searching &= covers.any(axis=1)
            k = np.argmax(covers, axis=1)
            low = np.where(searching, levels[np.arange(k.size), np.maximum(k - 1, 0)], low)
            high = np.where(searching, levels[np.arange(k.size), k], high)
        cuts[binding] = runs._fill(extra, cap, high[:, None])[:, :, 0]
        return cuts

    def _fill(self, extra: np.ndarray, cap: np.ndarray, levels: np.ndarray) -> np.ndarray:
        """[G, W + 1, K] cuts with each rank filling its run up to each of ``levels`` [G, K] (its
        extra counted in, within its cap)."""
        cuts = [np.zeros(levels.shape, dtype=np.int64)]
        for e, c in zip(extra.T, cap.T):
            y = self.at_cost(self.cost_to(cuts[-1]) + np.maximum(levels - e[:, None], 0.0))
            room = cuts[-1] + np.minimum(c, self.end)[:, None]
            cuts.append(np.minimum(np.maximum(y, cuts[-1]), room).astype(np.int64))
        return np.stack(cuts, axis=1)

    def inside(self, cuts: np.ndarray) -> np.ndarray:
        """[G] whether a group's ``cuts`` put a rank's range inside one branch (it would both read
        the previous rank's head and hand its own on)."""
        a, z = cuts[:, :-1], cuts[:, 1:]
        within = (self.branch(self.at, a) == self.branch(self.at, z)) & (z > a)
        return (within & ~self.starts_branch(a) & ~self.starts_branch(z)).any(axis=1)

    def spill(self, cuts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """[G] cost of the heads that reach the slot where the next rank's tail starts (they would
        stream), with slots ending where a rank's run reaches the costs ``ends`` [S - 1]: 0 where
        every handed cut crosses between slots."""
        cut = cuts[:, 1:-1]
        handed = ~self.starts_branch(cut)  # cuts inside a branch: a head, then a tail
        i = self.branch(self.at, cut)
        start = np.maximum(np.take_along_axis(self.at, i, axis=1), cuts[:, :-2])  # the head's start
        end = np.minimum(np.take_along_axis(self.at, i + 1, axis=1), cuts[:, 2:])  # the tail's end
        head = self.cost_to(cut) - self.cost_to(start)
        before = self.cost_to(cuts[:, 2:]) - self.cost_to(cut) - (self.cost_to(end) - self.cost_to(cut))
        spilled = np.maximum(head - np.r_[0.0, ends][np.searchsorted(ends, before, side="right")], 0.0)
        return np.where(handed, spilled, 0.0).sum(axis=1)

    def parts(self, cuts: np.ndarray, width: np.ndarray) -> tuple[np.ndarray, ...]:
        """(group, rank in group, lo, hi): every rank's range as DFS ranges, one per branch it
        touches, rank by rank in the order it computes them: the head of the branch it hands to the
        next rank first, its whole branches, the tail of the branch it reads from the previous last."""
        a, z = cuts[:, :-1], cuts[:, 1:]
        first, last = self.branch(self.at, a), self.branch(self.at, z, strict=True)
        count = np.where((np.arange(a.shape[1]) < width[:, None]) & (z > a), last - first + 1, 0)
        group, rank = np.nonzero(count)
        n = count[group, rank]
        k = aranges(np.zeros_like(n), n)
        group, rank, n = (np.repeat(x, n) for x in (group, rank, n))
        i, a, z = first[group, rank] + k, a[group, rank], z[group, rank]
        lo, at, after = self.lo[group, i], self.at[group, i], self.at[group, i + 1]
        tail = (k == 0) & ~self.starts_branch(cuts[:, :-1])[group, rank]
        head = (k == n - 1) & ~self.starts_branch(cuts[:, 1:])[group, rank]
        order = np.lexsort((np.where(head, -1, np.where(tail, n, k)), rank, group))
        parts = group, rank, lo + np.maximum(a - at, 0), lo + np.minimum(z, after) - at
        return tuple(x[order] for x in parts)


def _ordered(
    geo: Geometry,
    b: _Branches,
    members: list[np.ndarray],
    extra: np.ndarray,
    cap: np.ndarray,
    width: np.ndarray,
    ends: np.ndarray,
    chunk: int,
    seeds: list[int],
) -> tuple[_Runs, np.ndarray] | None:
    """The runs and cuts (:meth:`_Runs.ranges`) of each group's branches ``members``, the groups side
    by side: in DFS order, else in the first of :data:`ORDER_TRIES` shuffles (group g's seeded by
    ``seeds[g]``) whose cuts spill nothing, else the least spilling one; None if every order of a
    group puts a range inside a branch."""
    rngs = [np.random.default_rng(seed) for seed in seeds]
    orders, cuts = list(members), np.zeros((len(members), extra.shape[1] + 1), dtype=np.int64)
    least = np.full(len(members), np.inf)  # inf: every order so far puts a range inside a branch
    searching = np.arange(len(members))
    for attempt in range(ORDER_TRIES):
        tried = [members[g] if attempt == 0 else rngs[g].permutation(members[g]) for g in searching.tolist()]
        runs = _Runs.of(geo, b, tried, chunk)
        cut = runs.ranges(extra[searching], cap[searching], width[searching])
        spilled = np.where(runs.inside(cut), np.inf, runs.spill(cut, ends))
        keep = spilled < least[searching]
        for i in np.flatnonzero(keep).tolist():
            orders[searching[i]] = tried[i]
        cuts[searching[keep]], least[searching[keep]] = cut[keep], spilled[keep]
        searching = searching[least[searching] > 0]
        if not searching.size:
            break
    found = np.isfinite(least)
    return (_Runs.of(geo, b, orders, chunk), cuts) if found.all() else None


def _slotted(
    geo: Geometry, rank: np.ndarray, lo: np.ndarray, hi: np.ndarray, ends: np.ndarray, chunk: int
) -> tuple[np.ndarray, ...]:
    """(rank, slot, lo, hi) of every rank's run (its DFS ranges ``lo``, ``hi`` [P], ``rank`` [P]
    ascending, each rank's in run order) cut where the rank's cost reaches each of ``ends``
    [S - 1], cuts moved down to the chunk grid where their node reaches it."""
    row = np.unique(rank, return_inverse=True)[1]
    col = np.arange(rank.size) - np.searchsorted(rank, rank)  # a range's place in its rank's run
    by_rank = lambda x: np.zeros((row.max(initial=0) + 1, col.max(initial=0) + 1), dtype=x.dtype)
    before = lambda table: np.where(col > 0, table[row, np.maximum(col - 1, 0)], 0)  # over the rank's earlier ranges
    cost, top = by_rank(ends), geo.prefix(hi)
    cost[row, col] = top - geo.prefix(lo)
    base = geo.prefix(lo) - before(np.cumsum(cost, axis=1))  # the prefix cost where the rank's run costs 0
    reached = by_rank(rank)
    reached[row, col] = (base[:, None] + ends[None, :] < top[:, None]).sum(axis=1)  # slot ends within
    reached = np.maximum.accumulate(reached, axis=1)
    first, last = before(reached), reached[row, col]  # the slots the range spans: first .. last
    # a range's cuts, one per slot end it passes, between its bounds, never below the one before
    n = last - first
    piece = np.repeat(np.arange(rank.size), n + 2)
    k = aranges(np.zeros_like(n), n + 2)
    inner = np.clip(k - 1, 0, None) + first[piece]
    y = np.floor(geo.token_at(base[piece] + ends[np.minimum(inner, ends.size - 1)]))
    y = np.maximum(geo.on_grid(np.clip(y, lo[piece], hi[piece]).astype(np.int64), chunk), lo[piece])
    y = np.where(k == 0, lo[piece], np.where(k == n[piece] + 1, hi[piece], y))
    stride = int(hi.max(initial=0)) + 1
    bound = np.maximum.accumulate(piece * stride + y) - piece * stride
    step = np.flatnonzero(k < n[piece] + 1)  # bound -> the next bound of its range
    keep = step[bound[step + 1] > bound[step]]
    return rank[piece[keep]], first[piece[keep]] + k[keep], bound[keep], bound[keep + 1]


Rows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # (rank, slot, lo, hi, branch) [P]
Tops = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # (rank, slot, lo, hi) of the tops' pieces
TopLayout = Callable[[Geometry, np.ndarray, int, int, int, CostModel], Tops]


def _cut_tops(
    geo: Geometry, tops: np.ndarray, ranks: int, chunk: int, send: np.ndarray, whole: np.ndarray
) -> np.ndarray:
    """[ranks - 1] tokens cutting the DFS order of ``tops`` [K] at equal weight (a token's cost plus
    its node's ``send`` [K] seconds per token) into ``ranks`` spans, on the chunk grid where its node
    reaches it; where a cut lands in a node of ``whole`` [K] (bool), it moves to that node's nearer end."""
    start, length = geo.start[tops], geo.length[tops]
    weight = geo.node_cost[tops] + send * length
    cum = np.r_[0.0, np.cumsum(weight)]
    target = cum[-1] * np.arange(1, ranks) / ranks
    i = np.clip(np.searchsorted(cum, target, side="right") - 1, 0, tops.size - 1)
    rem = np.maximum(target - cum[i], 0.0)
    beta = geo.a + send[i] + geo.b * (geo.depth[tops[i]] + 0.5)  # weight of k tokens: b/2 k^2 + beta k
    k = 2 * rem / (beta + np.sqrt(beta * beta + 2 * geo.b * rem))
    t = np.floor(start[i] + np.minimum(k, length[i])).astype(np.int64)
    t = np.clip(geo.on_grid(np.clip(t, start[i], start[i] + length[i] - 1), chunk), start[i], None)
    return np.where(whole[i], np.where(rem > cum[i + 1] - target, start[i] + length[i], start[i]), t)


def _spans(geo: Geometry, tops: np.ndarray, cuts: np.ndarray) -> tuple[np.ndarray, ...]:
    """(rank, lo, hi) of ``tops``' tokens cut at ``cuts``: span j on rank j."""
    start, length = geo.start[tops], geo.length[tops]
    starts = np.unique(np.r_[start[0], cuts])
    bounds = np.unique(np.r_[start, start + length, starts])
    lo, hi = bounds[:-1], bounds[1:]
    held = np.isin(geo.node_of(lo), tops)
    lo, hi = lo[held], hi[held]
    return np.searchsorted(starts, lo, side="right") - 1, lo, hi


def _even_tops(geo: Geometry, tops: np.ndarray, ranks: int, chunk: int, world_size: int, cost: CostModel) -> Tops:
    """(rank, slot, lo, hi) of the tops' DFS order cut at equal cost into ``ranks`` spans in slot 0,
    span j on rank j."""
    none = np.zeros(tops.size)
    rank, lo, hi = _spans(geo, tops, _cut_tops(geo, tops, ranks, chunk, none, none.astype(bool)))
    return rank, np.zeros_like(rank), lo, hi


def _fanned_tops(geo: Geometry, tops: np.ndarray, ranks: int, chunk: int, world_size: int, cost: CostModel) -> Tops:
    """(rank, slot, lo, hi) of the tops laid out against their fan-out: a top read by many ranks
    (a system prompt every rank reads) costs its senders a message and its rows to each reader,
    so each token weighs its cost plus its sends (readers: the ranks its subtree's share of the
    work covers, plus one), and the tops' DFS order is cut at equal weight over ``ranks`` ranks.
    A top weighing more than a span runs in slot 0 with its ancestors, split (its spans stream to
    each other); the others run in slot 1, reading slot 0 as handoffs (a message a pair, not one a
    layer), each whole on one span's rank unless it too weighs more than a span there (a cut never
    chains two of them: each waits only for its own ancestors)."""
    start, length = geo.start[tops], geo.length[tops]
    work = geo.prefix(geo.end[tops]) - geo.prefix(start)
    readers = np.minimum(world_size, np.ceil(work / (geo.total_cost / world_size)) + 1)
    send = readers * float(cost.transfer(1, 0, 0))
    weight = geo.node_cost[tops] + send * length
    split = weight > weight.sum() / ranks
    with_ancestors = np.concatenate([np.zeros(0, dtype=np.int64), *group_paths(geo, tops[split])])
    first = np.isin(tops, with_ancestors)
    out = []
    for slot, mine in enumerate(m for m in (first, ~first) if m.any()):
        cuts = _cut_tops(geo, tops[mine], ranks, chunk, send[mine], weight[mine] <= weight[mine].sum() / ranks)
        rank, lo, hi = _spans(geo, tops[mine], cuts)
        out.append((rank, np.full(rank.size, slot), lo, hi))
    return tuple(np.concatenate(col) for col in zip(*out))


def _branch_rows(
    geo: Geometry,
    b: _Branches,
    widths: np.ndarray,
    where: np.ndarray,
    extra: np.ndarray,
    cap: np.ndarray,
    shares: np.ndarray,
    chunk: int,
) -> Rows | None:
    """The branches' pieces, slots from 0: every group's ranges cut into slots of ``shares`` of a mean
    rank's run at the same costs on every rank (a rank's ``extra`` [R] counted in its share, so the
    last slots even out); None if a group's branches leave a range inside one of them."""
    ends = (b.cost.sum() + extra.sum()) / widths.sum() * np.cumsum(shares)[:-1]  # [S - 1] in a mean rank's run
    groups = np.unique(where)
    begin, width = np.r_[0, np.cumsum(widths)[:-1]][groups], widths[groups]
    ranks = np.minimum(
        begin[:, None] + np.arange(width.max()), widths.sum() - 1
    )  # [G, W], past a group's width: unused
    members = [np.flatnonzero(where == g) for g in groups.tolist()]
    chosen = _ordered(geo, b, members, extra[ranks], cap[ranks], width, ends, chunk, groups.tolist())
    if chosen is None:
        return None
    runs, cuts = chosen
    group, rank, lo, hi = runs.parts(cuts, width)
    rank, slot, lo, hi = _slotted(geo, begin[group] + rank, lo, hi, ends, chunk)
    return rank, slot, lo, hi, np.searchsorted(b.lo, lo, side="right") - 1


def _pieces(geo: Geometry, rows: Rows, tops: Tops, slots: int) -> Pieces:
    """The relay's pieces: the tops (rank, slot, lo, hi) in their slots, if any, the branches' ``rows`` after them."""
    first = int(tops[1].max()) + 1 if tops[1].size else 0
    rank, slot, lo, hi, branch = (
        np.concatenate((np.asarray(t, dtype=np.int64), r)).astype(np.int64)
        for t, r in zip((*tops, np.full(tops[0].size, -1)), (rows[0], rows[1] + first, *rows[2:]))
    )
    order = np.lexsort((branch, hi, lo, slot, rank))
    rank, slot, lo, hi, branch = (x[order] for x in (rank, slot, lo, hi, branch))
    if not np.array_equal(np.sort(lo), np.r_[0, np.sort(hi)[:-1]]) or hi.max() != geo.num_tokens:
        raise AssertionError("the relay's pieces do not cover every token once: a planner bug")
    return Pieces(rank, slot, lo, hi, branch, np.zeros(lo.size, dtype=bool), first + slots)


def _passes(
    geo: Geometry,
    b: _Branches,
    tops: list[Tops],
    widths: np.ndarray,
    shares: np.ndarray,
    budget: Budget,
    memory: MemoryModel,
    chunk: int,
    build: Callable[[Pieces], Plan],
    layers: int,
    beat: float,
) -> Plan | None:
    """The lowest predicted of :data:`PASSES` relays with slots of ``shares`` of a rank's run after the
    tops': packed as they come (the tops laid out as each of ``tops``, the lowest kept), then packed
    again with the extra seconds that pass priced on every rank, then on that packing cut again, each
    rank's extra blended (:data:`EXTRA_BLEND`) with the last pass's and its token cap lowered by its
    graph excess (its context's memory counted: the cap keeps every slot's graph), while a pass
    predicts lower or a rank exceeds it; None if none fits and streams, or none can predict a step
    below ``beat``: the first, unpriced (its cross-rank reads only add), does not, or, priced, its
    mean rank, a rank's extra alone or :data:`REPACK_GAIN` of its step does not."""
    world_size = int(widths.sum())
    fill = budget.tokens * CAP_FILL  # no cap where a rank's share is past it: some of its slots rerun anyway
    extra, cap = np.zeros(world_size), np.full(world_size, fill if b.tokens.sum() <= fill * world_size else np.inf)
    group = lambda v: np.add.reduceat(v, np.r_[0, np.cumsum(widths)[:-1]])  # [R] -> [G] sums
    best = where = None
    for attempt in range(PASSES):
        where = _pack(b, widths, group(extra), group(cap)) if attempt < 2 else where
        rows = _branch_rows(geo, b, widths, where, extra, cap, shares, chunk)
        if rows is None:
            break
        relay = made = None
        for layout in tops:
            pieces = _pieces(geo, rows, layout, shares.size)
            built = build(pieces)
            priced = None
            if built.fits_budget and built.step_seconds < beat:
                priced = crossreads.priced(built, geo, pieces, layers)
            if priced is not None and (relay is None or priced.step_seconds < relay.step_seconds):
                relay, made, tops = priced, built, [layout]
        if relay is None:
            break
        lower = best is None or relay.step_seconds < best.step_seconds
        best = relay if lower else best
        over = graph_excess(memory, budget, made.tokens, made.context) / memory.token  # [R] own-token equivalents
        priced_extra = relay.cost.sum(axis=1) - made.cost.sum(axis=1)
        if attempt == 0:
            extra = priced_extra
            if max(relay.cost.sum(axis=1).mean(), extra.max(), REPACK_GAIN * relay.step_seconds) >= beat:
                break
        elif not (lower or (over > 0).any()):
            break
        else:
            extra = EXTRA_BLEND * priced_extra + (1 - EXTRA_BLEND) * extra
        fitted = np.maximum(made.tokens.sum(axis=1) - over - chunk, cap / 2)  # at most halved a pass
        cap = np.where(over > 0, fitted, cap) if attempt == 0 else np.minimum(cap, fitted)
    return best


def relay_cut(
    geo: Geometry,
    budget: Budget,
    memory: MemoryModel,
    world_size: int,
    chunk: int,
    build: Callable[[Pieces], Plan],
    layers: int,
    cost: CostModel,
    beat: float = math.inf,
    layouts: tuple[TopLayout, ...] = (_even_tops, _fanned_tops),
    top_ranks: tuple[int, ...] | None = None,
) -> Plan | None:
    """The relay over ``world_size`` ranks (module docstring): the tops laid out by whichever of
    ``layouts`` over whichever of ``top_ranks`` ranks (default: R / :data:`TOP_SHARES`) predicts the
    lowest step, priced with ``cost``'s links, the branches in the fewest slots whose microbatches
    the budget holds (two at least: a head before its tail; up to :data:`SLOT_TRIES` more where none
    fits); None where a branch costs more than one rank's share (a chain far deeper than the budget:
    the DFS cut's case) or no relay fits and predicts a step below ``beat``."""
    if world_size < 2:
        return None
    b, top_nodes = _split(geo, world_size, budget)
    if b.cost.size == 0 or b.cost.max() > b.cost.sum() / world_size:
        return None
    widths = _widths(world_size)
    fewest = max(2, math.ceil(b.tokens.sum() / world_size / (budget.tokens * CAP_FILL)))
    none = (np.zeros(0, dtype=np.int64),) * 4
    top_ranks = top_ranks or tuple(sorted({max(1, world_size // s) for s in TOP_SHARES}))
    laid = lambda layout, k: layout(geo, top_nodes, k, chunk, world_size, cost)
    tops = [laid(layout, k) for layout in layouts for k in top_ranks] if top_nodes.size else [none]
    for slots in range(fewest, fewest + SLOT_TRIES):  # more only where none fits
        relay = _passes(geo, b, tops, widths, np.full(slots, 1 / slots), budget, memory, chunk, build, layers, beat)
        if relay is not None:
            return relay
    return None
