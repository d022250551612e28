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

Legend: R ranks, U branches, G groups, S slots after the tops' slots, K top nodes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

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
ORDER_TRIES = 8  # orders of a group's branches tried for cuts that land well
ORDER_PATIENCE = 4  # shuffles in a row that spill no less end the search
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


class _Run:
    """A group's branches end to end in one order, as positions (tokens from the run's start)."""

    def __init__(self, geo: Geometry, b: _Branches, order: np.ndarray, chunk: int):
        self.geo, self.chunk = geo, chunk
        self.lo, self.hi = b.lo[order], b.hi[order]
        self.base = geo.prefix(self.lo)  # [n] prefix cost at each branch's start
        self.at = np.r_[0, np.cumsum(b.tokens[order])]  # [n + 1] first position of each branch
        self.cum = np.r_[0.0, np.cumsum(b.cost[order])]

    def cost_to(self, y: np.ndarray) -> np.ndarray:
        """The run's cost up to positions ``y``."""
        i = np.minimum(np.searchsorted(self.at, y, side="right") - 1, self.lo.size - 1)
        return self.cum[i] + self.geo.prefix(self.lo[i] + y - self.at[i]) - self.base[i]

    def at_cost(self, x: np.ndarray) -> np.ndarray:
        """The positions where the run's cost reaches ``x``, moved down to the chunk grid where their
        node reaches it (a branch's start is on it)."""
        i = np.clip(np.searchsorted(self.cum, x, side="right") - 1, 0, self.lo.size - 1)
        t = np.clip(
            np.floor(self.geo.token_at(self.base[i] + x - self.cum[i])).astype(np.int64), self.lo[i], self.hi[i]
        )
        t = np.maximum(np.where(t > self.lo[i], self.geo.on_grid(t, self.chunk), t), self.lo[i])
        return np.where(x >= self.cum[-1], self.at[-1], self.at[i] + t - self.lo[i])

    def ranges(self, extra: np.ndarray, cap: np.ndarray) -> np.ndarray:
        """[w + 1] positions cutting the run into one range per rank, each within its rank's token
        ``cap`` [w], the most any rank's cost plus ``extra`` [w] reaches as low as the caps allow: the
        lowest level that every rank filling up to it covers the run with (searched on a grid of
        levels, :data:`LEVELS` at a time, where a cap binds)."""

        def cut(levels: np.ndarray) -> np.ndarray:  # [w + 1, K] cuts at each level
            cuts = [np.zeros(levels.size, dtype=np.int64)]
            for e, c in zip(extra.tolist(), cap.tolist()):
                y = self.at_cost(self.cost_to(cuts[-1]) + np.maximum(levels - e, 0.0))
                cuts.append(np.minimum(np.maximum(y, cuts[-1]), cuts[-1] + min(c, self.at[-1])).astype(np.int64))
            return np.stack(cuts)

        end = int(self.at[-1])
        low = (self.cum[-1] + extra.sum()) / extra.size * (1 + 1e-9)
        cuts = np.r_[0, self.at_cost(np.cumsum(np.maximum(low - extra, 0.0)))]  # each rank up to the level
        if (np.diff(cuts) <= cap).all():
            return np.r_[cuts[:-1], end]
        cuts = cut(np.array([low]))[:, 0]
        if cuts[-1] < end:  # a cap binds: raise the level
            high = float(self.cum[-1] + extra.max())
            for _ in range(LEVEL_ROUNDS):
                levels = np.linspace(low, high, LEVELS)
                covers = cut(levels)[-1] >= end
                if not covers.any():
                    break
                k = int(np.argmax(covers))
                low, high = levels[max(k - 1, 0)], levels[k]
            cuts = cut(np.array([high]))[:, 0]
        return np.r_[cuts[:-1], end]

    def pieces(self, a: int, b: int) -> list[tuple[int, int]]:
        """The DFS ranges of positions [a, b): one per branch they touch."""
        first = int(np.searchsorted(self.at, a, side="right")) - 1
        out = []
        for i in range(first, self.lo.size):
            if self.at[i] >= b:
                break
            out.append(
                (int(self.lo[i] + max(a - self.at[i], 0)), int(self.lo[i] + min(b, self.at[i + 1]) - self.at[i]))
            )
        return out

    def starts_branch(self, y: int) -> bool:
        return bool(self.at[min(int(np.searchsorted(self.at, y)), self.at.size - 1)] == y)


@dataclass(frozen=True)
class _Range:
    """One rank's range of a run, as DFS ranges: the head of the branch it hands to the next rank
    (None: its range ends on a branch's end), its whole branches, the tail of the branch it reads
    from the previous rank (None: it starts on a branch's start)."""

    head: tuple[int, int] | None
    whole: list[tuple[int, int]]
    tail: tuple[int, int] | None

    def run(self) -> list[tuple[int, int]]:
        """The order the rank computes them in: head first, tail last."""
        return [*([self.head] if self.head else []), *self.whole, *([self.tail] if self.tail else [])]


def _ranges(run: _Run, cuts: np.ndarray) -> list[_Range] | None:
    """Each rank's :class:`_Range` of ``run`` cut at ``cuts``; None if one lies inside a branch (it
    would both read the previous rank's head and hand its own on)."""
    out = []
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        parts = run.pieces(a, b) if b > a else []
        tail = parts[0] if parts and not run.starts_branch(a) else None
        head = parts[-1] if parts and not run.starts_branch(b) else None
        if head is not None and head == tail:
            return None
        out.append(_Range(head, [p for p in parts if p != head and p != tail], tail))
    return out


def _spill(run: _Run, cuts: np.ndarray, ends: np.ndarray) -> float:
    """Cost of the heads that reach the slot where the next rank's tail starts (they would stream),
    for ``run`` cut at ``cuts`` [w + 1] and slots ending where a rank's run reaches the costs ``ends``
    [S - 1]: 0 when every handed cut crosses between slots."""
    at = run.at
    handed = np.flatnonzero(~np.isin(cuts[1:-1], at)) + 1  # cuts inside a branch: a head, then a tail
    if handed.size == 0:
        return 0.0
    cut = cuts[handed]
    start = np.maximum(at[np.searchsorted(at, cut, side="right") - 1], cuts[handed - 1])  # the head's start
    end = np.minimum(at[np.searchsorted(at, cut, side="right")], cuts[handed + 1])  # the tail's end
    head = run.cost_to(cut) - run.cost_to(start)
    before = run.cost_to(cuts[handed + 1]) - run.cost_to(cuts[handed]) - (run.cost_to(end) - run.cost_to(cut))
    starts = np.r_[0.0, ends]  # [S] where each slot starts in a run's cost
    return float(np.maximum(head - starts[np.searchsorted(ends, before, side="right")], 0.0).sum())


def _ordered(
    geo: Geometry,
    b: _Branches,
    members: np.ndarray,
    extra: np.ndarray,
    cap: np.ndarray,
    ends: np.ndarray,
    chunk: int,
    seed: int,
) -> list[_Range] | None:
    """The ranges of one group's branches ``members``: in DFS order, else in the first of
    :data:`ORDER_TRIES` seeded shuffles whose cuts spill nothing (else the least spilling one, the
    search ending after :data:`ORDER_PATIENCE` without less); None if every order puts a range
    inside a branch."""
    rng = np.random.default_rng(seed)
    best, least, stale = None, math.inf, 0
    for attempt in range(ORDER_TRIES):
        run = _Run(geo, b, members if attempt == 0 else rng.permutation(members), chunk)
        cuts = run.ranges(extra, cap)
        ranges = _ranges(run, cuts)
        spilled = math.inf if ranges is None else _spill(run, cuts, ends)
        stale = 0 if spilled < least else stale + 1
        if ranges is not None and (best is None or spilled < least):
            best, least = ranges, spilled
        if least == 0 or (best is not None and stale == ORDER_PATIENCE):
            break
    return best


def _slotted(geo: Geometry, run: list[tuple[int, int]], ends: np.ndarray, chunk: int) -> list[tuple[int, int, int]]:
    """(slot, lo, hi) of a rank's ``run`` cut where its cost reaches each of ``ends`` [S - 1], cuts
    moved down to the chunk grid where their node reaches it."""
    out, done, slot = [], 0.0, 0
    for a, z in run:
        last, base = a, float(geo.prefix(a)) - done  # the prefix cost where the run's cost is 0
        while slot < ends.size and base + ends[slot] < float(geo.prefix(z)):
            y = int(np.clip(np.floor(geo.token_at(base + ends[slot])), last, z))
            y = max(int(geo.on_grid(np.array([y]), chunk)[0]), last)
            if y > last:
                out.append((slot, last, y))
            last, slot = y, slot + 1
        if z > last:
            out.append((slot, last, z))
        done += float(geo.prefix(z) - geo.prefix(a))
    return out


Rows = list[tuple[int, int, int, int, int]]  # (rank, slot, lo, hi, branch)
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
    rows = []
    for g, begin in enumerate(np.r_[0, np.cumsum(widths)[:-1]].tolist()):
        ranks, members = np.arange(begin, begin + widths[g]), np.flatnonzero(where == g)
        if members.size == 0:
            continue
        ranges = _ordered(geo, b, members, extra[ranks], cap[ranks], ends, chunk, seed=g)
        if ranges is None:
            return None
        for r, mine in zip(ranks.tolist(), ranges):
            for slot, lo, hi in _slotted(geo, mine.run(), ends, chunk):
                rows.append((r, slot, lo, hi, int(np.searchsorted(b.lo, lo, side="right")) - 1))
    return rows


def _pieces(geo: Geometry, rows: Rows, tops: Tops, slots: int) -> Pieces:
    """The relay's pieces: the tops (rank, slot, lo, hi) in their slots, if any, the branches' ``rows`` after them."""
    first = int(tops[1].max()) + 1 if tops[1].size else 0
    rows = [(int(r), int(s), int(lo), int(hi), -1) for r, s, lo, hi in zip(*tops)] + [
        (r, first + s, lo, hi, u) for r, s, lo, hi, u in rows
    ]
    rank, slot, lo, hi, branch = (np.array(col, dtype=np.int64) for col in zip(*sorted(rows)))
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
