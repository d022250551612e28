"""The relay's cuts (``relay.py``): groups' branches end to end as *sequences*, each cut into one
range per rank of its group and every rank's range into slots at the same costs.

Every group is cut side by side (:class:`Sequences`: [G, n] arrays, each row bisected on its own), so a
1,024-rank relay's groups cost one vectorised pass per order tried, not a loop over groups; each
group's arithmetic is what it would be alone.

Legend: U branches, G groups, n a group's branches, W its ranks (the widest group's), Q queries per
group, P a rank's DFS ranges, S slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runs import aranges
from .geometry import Geometry
from .memory import Budget
from .planners import ALONE, Planners

__all__ = ["Branches", "Sequences", "ordered_cuts", "slotted"]

ORDER_TRIES = 64  # orders of a group's branches cut for the best (swe-like at 64 ranks: 32 left 1.3% more)
ORDER_MARGIN = 0.001  # a group's last order is kept unless another loads its busiest rank this share less
LEVELS, LEVEL_ROUNDS = 33, 2  # a group's cost level where a token cap binds: levels tried at once, rounds


@dataclass(frozen=True, eq=False)
class Branches:
    """Subtrees run whole on one rank or cut between two: [U] DFS ranges, costs and tokens."""

    lo: np.ndarray
    hi: np.ndarray
    cost: np.ndarray
    tokens: np.ndarray


@dataclass(frozen=True, eq=False)
class Sequences:
    """Groups' sequences side by side: each group's branches end to end in one order, as positions
    (tokens from its sequence's start). [G, n] arrays, padded past a group's ``count`` branches
    (positions and costs repeat its end there); queries are [G, Q], row g in group g's, and every
    row is searched on its own (:func:`_count_up_to`), so each group's arithmetic is what it would
    be alone."""

    geo: Geometry
    chunk: int
    count: np.ndarray  # [G] branches
    lo: np.ndarray  # [G, n] DFS start of each branch
    hi: np.ndarray
    base: np.ndarray  # [G, n] prefix cost at each branch's start
    at: np.ndarray  # [G, n + 1] first position of each branch
    cum: np.ndarray  # [G, n + 1] the sequence's cost before each branch

    @classmethod
    def of(cls, geo: Geometry, b: Branches, orders: list[np.ndarray], chunk: int) -> Sequences:
        """The sequences of ``orders`` (one array of branch indices per group)."""
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
        """[G] each sequence's length."""
        return self.at[np.arange(self.count.size), self.count]

    @property
    def total(self) -> np.ndarray:
        """[G] each sequence's cost."""
        return self.cum[np.arange(self.count.size), self.count]

    def select(self, rows: np.ndarray) -> Sequences:
        """The sequences of groups ``rows``."""
        pick = {k: getattr(self, k)[rows] for k in ("count", "lo", "hi", "base", "at", "cum")}
        return Sequences(self.geo, self.chunk, **pick)

    def branch(self, table: np.ndarray, y: np.ndarray, strict: bool = False) -> np.ndarray:
        """[G, Q] the last branch whose ``table`` entry (``at`` or ``cum``) is at most (``strict``:
        below) ``y``, within each group's branches."""
        return np.clip(_count_up_to(table, y, strict) - 1, 0, self.count[:, None] - 1)

    def starts_branch(self, y: np.ndarray) -> np.ndarray:
        """[G, Q] whether each position is a branch's start (or the sequence's end)."""
        last = np.maximum(_count_up_to(self.at, y, False) - 1, 0)
        return np.take_along_axis(self.at, last, axis=1) == y

    def cost_to(self, y: np.ndarray) -> np.ndarray:
        """[G, Q] each sequence's cost up to positions ``y``."""
        i = self.branch(self.at, y)
        take = lambda a: np.take_along_axis(a, i, axis=1)
        return take(self.cum) + self.geo.prefix(take(self.lo) + y - take(self.at)) - take(self.base)

    def at_cost(self, x: np.ndarray) -> np.ndarray:
        """[G, Q] the positions where each sequence's cost reaches ``x``, moved down to the chunk grid
        where their node reaches it (a branch's start is on it)."""
        i = self.branch(self.cum, x)
        take = lambda a: np.take_along_axis(a, i, axis=1)
        lo, hi = take(self.lo), take(self.hi)
        t = np.clip(np.floor(self.geo.token_at(take(self.base) + x - take(self.cum))).astype(np.int64), lo, hi)
        t = np.maximum(np.where(t > lo, self.geo.on_grid(t, self.chunk), t), lo)
        return np.where(x >= self.total[:, None], self.end[:, None], take(self.at) + t - lo)

    def ranges(self, extra: np.ndarray, cap: np.ndarray, width: np.ndarray) -> np.ndarray:
        """[G, W + 1] positions cutting each sequence into one range per rank of its group (``width`` [G]
        ranks; the cuts past them sit at its end), each within its rank's token ``cap``
        [G, W], the most any rank's cost plus ``extra`` [G, W] reaches as low as the caps allow: the
        lowest level that every rank filling up to it covers the sequence with (searched on a grid of
        levels, :data:`LEVELS` at a time, where a cap binds)."""
        real = np.arange(extra.shape[1]) < width[:, None]
        extra, cap = np.where(real, extra, 0.0), np.where(real, cap, np.inf)
        low = (self.total + extra.sum(axis=1)) / width * (1 + 1e-9)
        reach = np.cumsum(np.where(real, np.maximum(low[:, None] - extra, 0.0), 0.0), axis=1)
        cuts = np.concatenate((np.zeros((width.size, 1), dtype=np.int64), self.at_cost(reach)), axis=1)
        capped = np.flatnonzero(~(np.diff(cuts, axis=1) <= cap).all(axis=1))  # each rank up to the level
        if capped.size:
            part, high = self.select(capped), np.where(real, extra, -np.inf).max(axis=1)[capped]
            cuts[capped] = part._capped(extra[capped], cap[capped], width[capped], low[capped], high)
        return np.where(np.arange(cuts.shape[1]) < width[:, None], cuts, self.end[:, None])

    def _capped(
        self, extra: np.ndarray, cap: np.ndarray, width: np.ndarray, low: np.ndarray, most: np.ndarray
    ) -> np.ndarray:
        """:meth:`ranges` where a cap binds (``most`` [G]: each group's largest extra): the cuts at
        the level ``low`` [G], raised where they do not cover the sequence."""
        cuts = self._fill(extra, cap, low[:, None])[:, :, 0]
        binding = np.flatnonzero(cuts[np.arange(width.size), width] < self.end)
        if not binding.size:
            return cuts
        part, extra, cap, width = self.select(binding), extra[binding], cap[binding], width[binding]
        low, high = low[binding], self.total[binding] + most[binding]
        searching = np.ones(binding.size, dtype=bool)
        for _ in range(LEVEL_ROUNDS):
            levels = np.linspace(low, high, LEVELS, axis=1)
            covers = part._fill(extra, cap, levels)[np.arange(width.size), width] >= part.end[:, None]
            searching &= covers.any(axis=1)
            k = np.argmax(covers, axis=1)
            low = np.where(searching, levels[np.arange(k.size), np.maximum(k - 1, 0)], low)
            high = np.where(searching, levels[np.arange(k.size), k], high)
        cuts[binding] = part._fill(extra, cap, high[:, None])[:, :, 0]
        return cuts

    def _fill(self, extra: np.ndarray, cap: np.ndarray, levels: np.ndarray) -> np.ndarray:
        """[G, W + 1, K] cuts with each rank filling its range up to each of ``levels`` [G, K] (its
        extra counted in, within its cap)."""
        cuts = [np.zeros(levels.shape, dtype=np.int64)]
        for e, c in zip(extra.T, cap.T):
            y = self.at_cost(self.cost_to(cuts[-1]) + np.maximum(levels - e[:, None], 0.0))
            room = cuts[-1] + np.minimum(c, self.end)[:, None]
            cuts.append(np.minimum(np.maximum(y, cuts[-1]), room).astype(np.int64))
        return np.stack(cuts, axis=1)

    def load(self, cuts: np.ndarray, extra: np.ndarray, width: np.ndarray) -> np.ndarray:
        """[G] the most any rank's range of ``cuts`` costs, its ``extra`` counted in."""
        cost = np.diff(self.cost_to(cuts), axis=1) + extra
        return np.where(np.arange(cost.shape[1]) < width[:, None], cost, -np.inf).max(axis=1)

    def kept_footprint(self, cuts: np.ndarray, width: np.ndarray, ends: np.ndarray, budget: Budget) -> np.ndarray:
        """[G] the largest footprint under ``budget`` of a rank's last slot (its own tokens and the
        union of its pieces' root paths, a context its own tokens on them overcount): the rank's run
        of ``cuts``, whole branches densest last (:meth:`parts`), past where it reaches ``ends``'
        last cost. Where only that slot keeps its graph, its fullest rank decides how large the
        slots' shares can make it."""
        group, rank, lo, hi = self.parts(cuts, width, densest_last=True)
        stride = cuts.shape[1] - 1
        run, slot, lo, hi = slotted(self.geo, group * stride + rank, lo, hi, ends[-1:], self.chunk)
        last = slot == 1
        count = self.count.size * stride
        own = np.bincount(run[last], hi[last] - lo[last], minlength=count)
        footprint = budget.footprint(own, self.geo.paths_union(lo[last], run[last], count))
        return footprint.reshape(-1, stride).max(axis=1)

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

    def parts(self, cuts: np.ndarray, width: np.ndarray, densest_last: bool = False) -> tuple[np.ndarray, ...]:
        """(group, rank in group, lo, hi): every rank's range as DFS ranges, one per branch it
        touches, rank by rank in the order it computes them: the head of the branch it hands to the
        next rank first, its whole branches (in sequence order, or ``densest_last``: by cost per
        token, so that a last slot that keeps its graph holds the most cost its bytes allow), the
        tail of the branch it reads from the previous last."""
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
        place = (self.cum[group, i + 1] - self.cum[group, i]) / (after - at) if densest_last else k
        order = np.lexsort((np.where(head, -np.inf, np.where(tail, np.inf, place)), rank, group))
        parts = group, rank, lo + np.maximum(a - at, 0), lo + np.minimum(z, after) - at
        return tuple(x[order] for x in parts)


def _count_up_to(table: np.ndarray, y: np.ndarray, strict: bool) -> np.ndarray:
    """[G, Q] how many entries of each sorted row of ``table`` [G, m] are at most (``strict``:
    below) ``y`` [G, Q]: a bisection of every row at once, log m steps of [G, Q] (no [G, Q, m])."""
    rows = np.arange(table.shape[0])[:, None]
    lo, hi = np.zeros(y.shape, dtype=np.int64), np.full(y.shape, table.shape[1], dtype=np.int64)
    while (open_ := lo < hi).any():
        mid = (lo + hi) // 2
        value = table[rows, np.minimum(mid, table.shape[1] - 1)]
        up_to = (value < y if strict else value <= y) & open_
        lo, hi = np.where(up_to, mid + 1, lo), np.where(open_ & ~up_to, mid, hi)
    return lo


def ordered_cuts(
    geo: Geometry,
    b: Branches,
    members: list[np.ndarray],
    extra: np.ndarray,
    cap: np.ndarray,
    width: np.ndarray,
    ends: np.ndarray,
    chunk: int,
    seeds: list[int],
    last: list[np.ndarray | None] | None = None,
    kept_last: Budget | None = None,
    planners: Planners = ALONE,
) -> tuple[Sequences, np.ndarray, list[np.ndarray]] | None:
    """The sequences, cuts (:meth:`Sequences.ranges`) and orders of each group's branches ``members``:
    of its DFS order and :data:`ORDER_TRIES` - 1 shuffles (group g's seeded by ``seeds[g]``), all cut
    side by side, the one that spills least, then loads its busiest rank least (where token caps
    bind, the order decides how far the others fill; or, where only the last slot keeps its graph
    under the budget ``kept_last``, fills its fullest rank's last slot least: no cap binds, and
    the slots' shares grow the last slot until one rank's is full), then comes first; None if every
    order of a group puts a range inside a branch. A group's ``last`` order (None: none), where it
    holds the same branches, is tried first and kept unless another spills less or loads (or
    fills) :data:`ORDER_MARGIN` less: the ``extra`` of its ranks was priced for that order, so
    another order's smaller edge is noise. ``planners``: each cuts its share of the orders, and all
    choose from the gathered cuts and prices (``planners.py``)."""
    last = last or [None] * len(members)
    same = np.array([o is not None and np.array_equal(np.sort(o), np.sort(m)) for o, m in zip(last, members)])
    tries = []
    for m, rng, before, kept in zip(members, map(np.random.default_rng, seeds), last, same):
        orders = [m, *m[rng.random((ORDER_TRIES - 1, m.size)).argsort(axis=1)]]
        tries.append([before, *orders[:-1]] if kept else orders)
    groups = np.arange(len(members))
    mine = planners.share(ORDER_TRIES)
    row = np.repeat(groups, len(mine))  # [G T'] the group of each order this planner cuts
    spilled = load = np.zeros((groups.size, 0))
    cut = np.zeros((groups.size, 0, extra.shape[1] + 1), dtype=np.int64)
    if mine:
        sequences = Sequences.of(geo, b, [group[k] for group in tries for k in mine], chunk)
        cut = sequences.ranges(extra[row], cap[row], width[row])
        spilled = np.where(sequences.inside(cut), np.inf, sequences.spill(cut, ends))
        if kept_last is None:
            load = sequences.load(cut, extra[row], width[row])
        else:
            load = sequences.kept_footprint(cut, width[row], ends, kept_last)
        spilled, load, cut = (x.reshape(groups.size, len(mine), *x.shape[1:]) for x in (spilled, load, cut))
    if planners.count > 1:  # [G, T] every planner's orders
        spilled, load, cut = (np.concatenate(part, axis=1) for part in zip(*planners.gather((spilled, load, cut))))
    if not np.isfinite(spilled).any(axis=1).all():
        return None
    first = np.broadcast_to(np.arange(ORDER_TRIES), load.shape)
    best = np.lexsort((first, load, spilled))[:, 0]
    held = same & (spilled[:, 0] <= spilled[groups, best]) & (load[:, 0] <= load[groups, best] * (1 + ORDER_MARGIN))
    best = np.where(held, 0, best)
    orders = [tries[g][k] for g, k in enumerate(best.tolist())]
    return Sequences.of(geo, b, orders, chunk), cut[groups, best], orders


def slotted(
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
