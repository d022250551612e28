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
  them, a system prompt and task prompts) run first, once, over k ranks (k is whichever of
  :data:`TOP_SHARES` predicts the lowest step), every (R / k)-th (a holder sends its rows to many
  readers, so its share of the branches shrinks: no group holds two, unless every rank holds a
  span), laid out one of three ways
  (each run through its passes of its own, :func:`_passes`): :func:`_even_tops`, in slot 0, their
  DFS order cut at equal cost, a context-parallel group that every later slot reads;
  :func:`_fanned_tops`, against their fan-out: a top every rank reads costs its senders a message
  to each reader, so at hundreds of ranks the system prompt is spread thin over slot 0 and the task
  prompts, whole, follow in slot 1; or :func:`_chained_tops`, as chains side by side: the system
  prompt in slot 0, then each task's tops (its prompt and the trunks its episodes share) cut over
  ranks of its own in slot 1, so that no task's trunk is one rank's slot;
- the branches are packed over groups of about :data:`GROUP_RANKS` consecutive ranks (largest first
  onto the least loaded group, then moves and swaps off the busiest: :func:`_pack`; a group's tokens
  within its share and :data:`GROUP_ROOM` of the room its ranks' caps leave, so that its ranks can
  even out under their caps), and each group's branches, ordered so that every cut between two
  ranks lands in a branch that both halves of it fit in their slots and, where caps bind, the
  busiest rank is least loaded (DFS order first, then seeded shuffles:
  :func:`~.sequences.ordered_cuts`), are cut into one range per rank at equal cost, each within its
  rank's token cap;
- a rank runs its range as [the head of the branch it shares with the next rank, its whole
  branches, the tail of the branch it shares with the previous one], cut at the same costs into
  slots 1..S on every rank: the head lies in the first slots, the tail that reads it in the last,
  so the read crosses ranks between slots (a handoff, no wait; S is whichever of a few counts from
  the fewest the budget allows predicts the lowest step: the more slots, the longer a head and its
  tail can be and still meet only across slots).
- where the ranks hold more than their graphs can keep (a scale-4 batch: four budgets a rank),
  only the last slot keeps its graph and every earlier one reruns its forward in the backward, so
  the last slot is made as large as the budget allows on its fullest rank (the slots' shares
  follow the room the last cut left in each: :func:`_kept_shares`), and a rank runs its whole
  branches by cost per token, the densest last (the kept slot holds the most cost its bytes allow).

Pricing: ``crossreads.priced`` (a head that spills into its tail's slot streams: a wavefront).
Every cut lies on the chunk grid where its node reaches it (no replay there). The transfers and
waits priced on each rank (its *extra*), and each rank's excess over the graph budget (its earlier
slots would rerun), go back into the cut: the extra comes off the rank's share (the ranges cut again
with the extra of each pass blended in, on the last packing and on one packed afresh with it, the
lower kept; a group's order kept unless another is clearly better, since its extra was priced for
that order) and the excess off its token cap (or, where every earlier slot reruns anyway, into
the slots' shares), for :data:`PASSES` passes; the lowest is kept.

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
from .planners import ALONE, Planners
from .sequences import Branches, ordered_cuts, slotted

__all__ = ["relay_cut"]

GROUP_RANKS = 4  # ranks a group of branches is cut over (a group's ranges relay from one rank to the next)
TOP_SHARES = (1, 4, 16)  # the tops' group runs over R / share ranks (at least one)
SLOT_TRIES = 3  # slot counts tried side by side, from the fewest the budget allows
PASSES = 6  # cuts re-made with each rank's priced extra and graph excess
REPACK_GAIN = 0.8  # the most of the first pass's step the later passes are taken to win back (seen: 0.85)
EXTRA_BLEND = 0.5  # a later pass's extra: this share of the last pass's priced extra, the rest of the one before
LAYOUT_MARGIN = 0.01  # a tops layout priced within this share of a pass's lowest is tried again
GROUP_ROOM = 0.25  # a group's token cap: its share of the tokens and this share of the room its ranks' caps leave
CAP_FILL = 0.97  # a rank's first token cap, of the budget (context and the graph budget's slack aside)


def _split(geo: Geometry, world_size: int, budget: Budget) -> tuple[Branches, np.ndarray]:
    """(the branches, the top nodes [K] above them, DFS order): ``find_branches`` with branches of up
    to one rank's share, the largest a range can take whole or cut in two."""
    branch_node, _, group_node = find_branches(geo, world_size, budget.tokens, BRANCH_RULES[1], per_rank=1)
    tops = np.unique(np.concatenate([np.zeros(0, dtype=np.int64), *group_paths(geo, group_node)]))
    lo, hi = geo.start[branch_node], geo.end[branch_node]
    return Branches(lo, hi, geo.prefix(hi) - geo.prefix(lo), hi - lo), tops


def _widths(world_size: int) -> np.ndarray:
    """[G] ranks per group: :data:`GROUP_RANKS`, the remainder one group more (a lone rank joins the last)."""
    count, rest = divmod(world_size, GROUP_RANKS)
    widths = [GROUP_RANKS] * count + ([rest] if rest else [])
    if len(widths) > 1 and widths[-1] == 1:
        widths[-2:] = [GROUP_RANKS + 1]
    return np.array(widths, dtype=np.int64)


def _pack(b: Branches, widths: np.ndarray, extra: np.ndarray, cap: np.ndarray) -> np.ndarray:
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


Rows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # (rank, slot, lo, hi, branch) [P]
Tops = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # (rank, slot, lo, hi) of the tops' pieces
# (geometry, top nodes, ranks, chunk, R, cost model, decoder layers) -> the tops' pieces
TopLayout = Callable[[Geometry, np.ndarray, int, int, int, CostModel, int], Tops]


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


def _fan_out(geo: Geometry, tops: np.ndarray, world_size: int, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """(send, weight) [K] of ``tops``: the seconds a token of each costs its holder in sends (to its
    readers: the ranks its subtree's share of the work covers, plus one), and its cost plus those."""
    work = geo.prefix(geo.end[tops]) - geo.prefix(geo.start[tops])
    readers = np.minimum(world_size, np.ceil(work / (geo.total_cost / world_size)) + 1)
    send = readers * float(cost.transfer(1, 0, 0))
    return send, geo.node_cost[tops] + send * geo.length[tops]


def _even_tops(
    geo: Geometry, tops: np.ndarray, ranks: int, chunk: int, world_size: int, cost: CostModel, layers: int
) -> Tops:
    """(rank, slot, lo, hi) of the tops' DFS order cut at equal cost into ``ranks`` spans in slot 0,
    span j on rank j."""
    none = np.zeros(tops.size)
    rank, lo, hi = _spans(geo, tops, _cut_tops(geo, tops, ranks, chunk, none, none.astype(bool)))
    return rank, np.zeros_like(rank), lo, hi


def _fanned_tops(
    geo: Geometry, tops: np.ndarray, ranks: int, chunk: int, world_size: int, cost: CostModel, layers: int
) -> Tops:
    """(rank, slot, lo, hi) of the tops laid out against their fan-out: a top read by many ranks
    (a system prompt every rank reads) costs its senders a message and its rows to each reader,
    so each token weighs its cost plus its sends (readers: the ranks its subtree's share of the
    work covers, plus one), and the tops' DFS order is cut at equal weight over ``ranks`` ranks.
    A top weighing more than a span runs in slot 0 with its ancestors, split (its spans stream to
    each other); the others run in slot 1, reading slot 0 as handoffs (a message a pair, not one a
    layer), each whole on one span's rank unless it too weighs more than a span there (a cut never
    chains two of them: each waits only for its own ancestors)."""
    send, weight = _fan_out(geo, tops, world_size, cost)
    split = weight > weight.sum() / ranks
    with_ancestors = np.concatenate([np.zeros(0, dtype=np.int64), *group_paths(geo, tops[split])])
    first = np.isin(tops, with_ancestors)
    out = []
    for slot, mine in enumerate(m for m in (first, ~first) if m.any()):
        cuts = _cut_tops(geo, tops[mine], ranks, chunk, send[mine], weight[mine] <= weight[mine].sum() / ranks)
        rank, lo, hi = _spans(geo, tops[mine], cuts)
        out.append((rank, np.full(rank.size, slot), lo, hi))
    return tuple(np.concatenate(col) for col in zip(*out))


def _chained_tops(
    geo: Geometry, tops: np.ndarray, ranks: int, chunk: int, world_size: int, cost: CostModel, layers: int
) -> Tops:
    """(rank, slot, lo, hi) of the tops as chains side by side: the chain above every other top (a
    system prompt) cut at equal cost in slot 0 over as many spans as the model has ``layers`` (a
    wavefront of n spans takes (n + L - 1) / (n L) of the chain: past L spans there is little to
    win, and every span's holder sends its rows to every rank), then each subtree of the tops below
    it (a task's prompt and the trunks its episodes share), in slot 1, cut in its DFS order at
    equal weight (:func:`_fan_out`) over ranks of its own, one each and the rest by weight, largest
    remainders first (where there are more subtrees than ranks, each whole on the rank with the
    least weight). A subtree's wavefront runs only through its own spans: the even layout's runs
    through every top, and the fanned layout leaves each task's tops whole on one rank (at 1,024
    ranks, a task's shared trunk is the slot)."""
    start = geo.start[tops]
    above = (start <= start.min()) & (geo.end[tops] >= (start + geo.length[tops]).max())  # every top below it
    send, weight = _fan_out(geo, tops, world_size, cost)
    out = []
    if above.any():
        spans = min(ranks, layers)
        none = np.zeros(int(above.sum()))
        rank, lo, hi = _spans(geo, tops[above], _cut_tops(geo, tops[above], spans, chunk, none, none.astype(bool)))
        out.append((rank, np.zeros_like(rank), lo, hi))
    rest, send, weight = tops[~above], send[~above], weight[~above]
    heads = rest[~np.isin(geo.parent[rest], rest)]  # each subtree's highest top
    which = np.searchsorted(geo.start[heads], geo.start[rest], side="right") - 1  # [K'] its subtree
    total = np.bincount(which, weight, minlength=heads.size)
    slot = int(above.any())
    if heads.size > ranks:
        load, on = np.zeros(ranks), np.empty(heads.size, dtype=np.int64)
        for g in np.argsort(-total, kind="stable").tolist():
            on[g] = int(np.argmin(load))
            load[on[g]] += total[g]
        out.append((on[which], np.full(rest.size, slot), geo.start[rest], geo.start[rest] + geo.length[rest]))
    elif heads.size:
        quota = total / total.sum() * (ranks - heads.size)  # the ranks past one each, by weight
        share = 1 + np.floor(quota).astype(np.int64)
        share[np.argsort(np.floor(quota) - quota, kind="stable")[: ranks - int(share.sum())]] += 1  # largest remainders
        for g, first in enumerate(np.r_[0, np.cumsum(share)[:-1]].tolist()):
            mine = which == g
            cuts = _cut_tops(geo, rest[mine], int(share[g]), chunk, send[mine], np.zeros(int(mine.sum()), dtype=bool))
            rank, lo, hi = _spans(geo, rest[mine], cuts)
            out.append((rank + first, np.full(rank.size, slot), lo, hi))
    return tuple(np.concatenate(col) for col in zip(*out))


TOP_LAYOUTS: tuple[TopLayout, ...] = (_even_tops, _fanned_tops, _chained_tops)  # tried side by side


def _branch_rows(
    geo: Geometry,
    b: Branches,
    widths: np.ndarray,
    where: np.ndarray,
    extra: np.ndarray,
    cap: np.ndarray,
    shares: np.ndarray,
    chunk: int,
    last: dict[int, np.ndarray],
    kept_last: Budget | None,
    redo: np.ndarray | None = None,
    planners: Planners = ALONE,
) -> tuple[Rows, dict[int, np.ndarray]] | None:
    """The branches' pieces, slots from 0, and each group's order (by group index), of the groups
    ``redo`` [G] (bool; None: all): every group's ranges cut into slots of ``shares`` of a mean
    rank's run at the same costs on every rank (a rank's ``extra`` [R] counted in its share, so
    the last slots even out; a group's ``last`` order kept where no other is clearly better:
    ``ordered_cuts``; where only the last slot keeps its graph under the budget ``kept_last``, the
    order that fills it least, and a rank's whole branches densest last: ``Sequences.parts``); None
    if a group's branches leave a range inside one of them. A group's pieces depend on its own
    branches, ranks and order alone. ``planners`` cut the orders tried between them."""
    ends = (b.cost.sum() + extra.sum()) / widths.sum() * np.cumsum(shares)[:-1]  # [S - 1] in a mean rank's run
    groups = np.unique(where)
    if redo is not None:
        groups = groups[redo[groups]]
    begin, width = np.r_[0, np.cumsum(widths)[:-1]][groups], widths[groups]
    ranks = np.minimum(
        begin[:, None] + np.arange(width.max()), widths.sum() - 1
    )  # [G, W], past a group's width: unused
    members = [np.flatnonzero(where == g) for g in groups.tolist()]
    seeds = groups.tolist()
    lasts = [last.get(g) for g in seeds]
    chosen = ordered_cuts(
        geo, b, members, extra[ranks], cap[ranks], width, ends, chunk, seeds, lasts, kept_last, planners
    )
    if chosen is None:
        return None
    sequences, cuts, orders = chosen
    group, rank, lo, hi = sequences.parts(cuts, width, densest_last=kept_last is not None)
    rank, slot, lo, hi = slotted(geo, begin[group] + rank, lo, hi, ends, chunk)
    return (rank, slot, lo, hi, np.searchsorted(b.lo, lo, side="right") - 1), dict(zip(seeds, orders))


def _top_slots(tops: Tops) -> int:
    """How many slots the tops' pieces take before the branches'."""
    return int(tops[1].max()) + 1 if tops[1].size else 0


def _kept_shares(made: Plan, shares: np.ndarray, first: int) -> np.ndarray:
    """[S] shares of a mean rank's run for the branch slots (from slot ``first``) of a relay whose
    ranks keep only their last slot's graph (every earlier slot reruns in the backward): the last
    slot as large as the budget allows on the rank it fills most (its context as ``made``, cut with
    ``shares``, left it), the rest of the run over the other slots by the room each leaves on its
    fullest rank. Every second the last slot gains is a forward less to rerun."""
    own = made.tokens[:, first:]
    room = made.budget.room(made.context[:, first:])  # [R, S] own tokens each slot could hold
    capacity = np.minimum(shares * np.where(own > 0, room / np.maximum(own, 1), np.inf).min(axis=0), 1.0)
    last = capacity[-1]
    return np.r_[capacity[:-1] / capacity[:-1].sum() * (1 - last), last]


def _pieces(geo: Geometry, rows: Rows, tops: Tops, slots: int) -> Pieces:
    """The relay's pieces: the tops (rank, slot, lo, hi) in their slots, if any, the branches' ``rows`` after them."""
    first = _top_slots(tops)
    columns = zip((*tops, np.full(tops[0].size, -1)), (rows[0], rows[1] + first, *rows[2:]))
    rank, slot, lo, hi, branch = (np.concatenate(pair) for pair in columns)
    order = np.lexsort((branch, hi, lo, slot, rank))
    rank, slot, lo, hi, branch = (x[order] for x in (rank, slot, lo, hi, branch))
    if not np.array_equal(np.sort(lo), np.r_[0, np.sort(hi)[:-1]]) or hi.max() != geo.num_tokens:
        raise AssertionError("the relay's pieces do not cover every token once: a planner bug")
    return Pieces(rank, slot, lo, hi, branch, np.zeros(lo.size, dtype=bool), first + slots)


@dataclass(frozen=True)
class _Cut:
    """One cut of the branches under one tops layout, priced: the relay and its unpriced build, and
    what it was cut with and left (packing, each rank's extra and cap, each group's order, each
    rank's graph excess in own tokens, the branch slots' shares)."""

    relay: Plan
    made: Plan
    rows: Rows
    where: np.ndarray
    extra: np.ndarray
    cap: np.ndarray
    orders: dict[int, np.ndarray]
    over: np.ndarray
    shares: np.ndarray

    @property
    def step(self) -> float:
        return self.relay.step_seconds

    @property
    def priced_extra(self) -> np.ndarray:
        """[R] the seconds its pricing added to each rank: transfers and waits."""
        return self.relay.cost.sum(axis=1) - self.made.cost.sum(axis=1)

    @property
    def fitted(self) -> np.ndarray:
        """[R] each rank's token cap less its graph excess (at most halved)."""
        return np.maximum(self.made.tokens.sum(axis=1) - self.over - self.made.chunk_size, self.cap / 2)


def _passes(
    geo: Geometry,
    b: Branches,
    tops: list[Tops],
    widths: np.ndarray,
    counts: range,
    budget: Budget,
    memory: MemoryModel,
    chunk: int,
    build: Callable[[Pieces], Plan],
    layers: int,
    beat: float,
    planners: Planners,
) -> Plan | None:
    """The lowest predicted relay with any of ``counts`` branch slots after the tops': the first
    pass packs and cuts the branches as they come into each count of slots of equal cost and prices
    them under each tops layout of ``tops`` (at more slots than the fewest that fit, only those
    within :data:`LAYOUT_MARGIN` there: the layout and the count are near independent choices); then
    each layout and count runs :data:`PASSES` - 1 passes of its own (the extra a pass prices depends
    on which ranks hold the tops and send their rows), while it comes within :data:`LAYOUT_MARGIN`
    of the lowest (after the first pass by the step it would predict with its branch slots evened
    out around its extra, which that pass cut without; then by its lowest). A pass packs the
    branches afresh with the extra priced so far and also (from the third) keeps the last packing,
    the lower kept; each rank's extra blended (:data:`EXTRA_BLEND`) with the last pass's, each
    group's order kept where no other is clearly better (the extra was priced for it), and each
    rank's token cap lowered by its graph excess (its context's memory counted: the cap keeps every
    slot's graph; a cut that leaves ranks past it is cut again once with their caps lowered, their
    context having moved with their ranges), or, where the ranks hold more than their graphs keep,
    the slots' shares made to fill the last slot (:func:`_kept_shares`; the last cut's shares where
    that cut does not fit). None if none fits and streams, or none can predict a step below
    ``beat``: the first, unpriced (its cross-rank reads only add), does not, or, priced, its mean
    rank, a rank's extra alone or :data:`REPACK_GAIN` of its step does not."""
    world_size = int(widths.sum())
    fill = budget.tokens * CAP_FILL
    keeps_all = bool(b.tokens.sum() <= fill * world_size)  # else slots rerun anyway: no cap, the last kept
    cap = np.full(world_size, fill if keeps_all else np.inf)
    group = lambda v: np.add.reduceat(v, np.r_[0, np.cumsum(widths)[:-1]])  # [R] -> [G] sums
    even = widths * b.tokens.sum() / world_size  # [G] each group's share of the tokens
    pack = lambda extra, cap: _pack(
        b, widths, group(extra), np.minimum(group(cap), even + GROUP_ROOM * (group(cap) - even))
    )

    group_of = np.repeat(np.arange(widths.size), widths)  # [R] each rank's group

    def cut(where, extra, cap, orders, layouts: list[Tops], shares: np.ndarray, like: _Cut | None = None):
        """[len(layouts)] cuts, each priced (None: it does not fit or stream); ``like``: a cut of the
        same packing, extra, orders and shares whose groups with the same caps are kept as cut."""
        redo = None if like is None else np.bincount(group_of, cap != like.cap, minlength=widths.size) > 0
        kept_last = None if keeps_all else budget
        got = _branch_rows(geo, b, widths, where, extra, cap, shares, chunk, orders, kept_last, redo, planners)
        if got is None:
            return [None] * len(layouts)
        rows, orders = got
        if like is not None:
            same = ~redo[group_of[like.rows[0]]]
            rows = tuple(np.r_[old[same], new] for old, new in zip(like.rows, rows))
            orders = {**{g: o for g, o in like.orders.items() if not redo[g]}, **orders}
        out = []
        for layout in layouts:
            pieces = _pieces(geo, rows, layout, shares.size)
            built = build(pieces)
            priced = None
            if built.fits_budget and built.step_seconds < beat:
                priced = crossreads.priced(built, geo, pieces, layers)
            if priced is None:
                out.append(None)
                continue
            over = graph_excess(memory, budget, built.tokens, built.context) / memory.token  # [R] own tokens
            out.append(_Cut(priced, built, rows, where, extra, cap, orders, over, shares))
        return out

    def repaired(c: _Cut | None, layout: Tops) -> _Cut | None:
        if c is None or not (c.over > 0).any():
            return c
        cap = np.where(c.over > 0, c.fitted, c.cap)
        if np.array_equal(cap, c.cap):  # no cap to lower (every slot but the last reruns): the same cut
            return c
        (again,) = cut(c.where, c.extra, cap, c.orders, [layout], c.shares, like=c)
        return again if again is not None and again.step < c.step else c

    @dataclass
    class Run:
        """One tops layout's passes at one slot count: its lowest cut, its last, the extra and caps
        it cuts next with (and the shares: where the last slot alone keeps its graph, as large as
        the budget allows, else as its last cut's where that does not fit)."""

        layout: Tops
        best: _Cut
        last: _Cut
        extra: np.ndarray
        cap: np.ndarray
        score: float  # what it is compared by: after the first pass its even step, then its lowest

        def advance(self, attempt: int) -> None:
            packings = [self.last.where] if attempt >= 2 else []
            packings.append(pack(self.extra, self.cap))
            tries = [self.last.shares]
            if not keeps_all:  # the last slot as large as the budget allows, else as the last cut's
                tries.insert(0, _kept_shares(self.last.made, self.last.shares, _top_slots(self.layout)))
            for slot_shares in tries:
                cuts = [cut(w, self.extra, self.cap, self.last.orders, [self.layout], slot_shares)[0] for w in packings]
                cuts = [c for c in (repaired(c, self.layout) for c in cuts) if c is not None]
                if cuts:
                    break
            if cuts:
                self.last = min(cuts, key=lambda c: c.step)
                self.best = min(self.best, self.last, key=lambda c: c.step)
                self.extra = EXTRA_BLEND * self.last.priced_extra + (1 - EXTRA_BLEND) * self.extra
                self.cap = np.minimum(self.last.cap, self.last.fitted)
            self.score = self.best.step

    def even_step(c: _Cut, layout: Tops) -> float:
        """The step ``c`` predicts once its branch slots even out around their extra: the tops'
        slots as priced, then the mean rank's (the first pass prices its extra, cut without it)."""
        first = _top_slots(layout)
        return float(c.relay.cost[:, :first].max(axis=0).sum() + c.relay.cost[:, first:].sum(axis=1).mean())

    zero, firsts, layouts = np.zeros(world_size), [], tops
    for slots in counts:  # every layout at the fewest slots that fit, then those within the margin there
        made = cut(pack(zero, cap), zero, cap, {}, layouts, np.full(slots, 1 / slots))
        firsts += [(repaired(c, layout), layout) for c, layout in zip(made, layouts)]
        if layouts is tops and (scores := [(even_step(c, layout), layout) for c, layout in firsts if c is not None]):
            lowest = min(score for score, _ in scores)
            layouts = [layout for score, layout in scores if score <= lowest * (1 + LAYOUT_MARGIN)]

    runs = [
        Run(layout, c, c, c.priced_extra, np.where(c.over > 0, c.fitted, c.cap), even_step(c, layout))
        for c, layout in firsts
        if c is not None and max(c.relay.cost.sum(axis=1).mean(), c.priced_extra.max(), REPACK_GAIN * c.step) < beat
    ]
    for attempt in range(1, PASSES):
        lowest = min((run.score for run in runs), default=math.inf)
        runs = [run for run in runs if run.score <= lowest * (1 + LAYOUT_MARGIN)]
        for run in runs:
            run.advance(attempt)
    chosen = [run.best for run in runs] or [c for c, _ in firsts if c is not None]
    return min(chosen, key=lambda c: c.step).relay if chosen else None


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
    layouts: tuple[TopLayout, ...] | None = None,
    top_ranks: tuple[int, ...] | None = None,
    planners: Planners = ALONE,
) -> Plan | None:
    """The relay over ``world_size`` ranks (module docstring): the tops laid out by whichever of
    ``layouts`` (default :data:`TOP_LAYOUTS`) over whichever of ``top_ranks`` ranks (default:
    R / :data:`TOP_SHARES`) predicts the lowest step, priced with ``cost``'s links, the branches in
    whichever of :data:`SLOT_TRIES` slot counts does, from the fewest whose microbatches the budget
    holds (two at least: a head before its tail; more slots let more of the branches cut between
    two ranks hand their heads on between slots, where fewer would stream them within one: at
    1,024 ranks three, not two); None where a branch costs more than one rank's share (a chain far
    deeper than the budget: the DFS cut's case) or no relay fits and predicts a step below
    ``beat``. ``planners``: the processes making it together (``planners.py``), each ending with
    the same relay."""
    if world_size < 2:
        return None
    b, top_nodes = _split(geo, world_size, budget)
    if b.cost.size == 0 or b.cost.max() > b.cost.sum() / world_size:
        return None
    widths = _widths(world_size)
    fewest = max(2, math.ceil(b.tokens.sum() / world_size / (budget.tokens * CAP_FILL)))
    none = (np.zeros(0, dtype=np.int64),) * 4
    top_ranks = top_ranks or tuple(sorted({max(1, world_size // s) for s in TOP_SHARES}))

    def laid(layout: TopLayout, k: int) -> Tops:
        """``layout``'s tops on every (R / k)-th rank: no group of branches holds two of them
        unless k is R."""
        rank, *rest = layout(geo, top_nodes, k, chunk, world_size, cost, layers)
        return rank * (world_size // k), *rest

    layouts = layouts or TOP_LAYOUTS
    tops = [laid(layout, k) for layout in layouts for k in top_ranks] if top_nodes.size else [none]
    counts = range(fewest, fewest + SLOT_TRIES)
    return _passes(geo, b, tops, widths, counts, budget, memory, chunk, build, layers, beat, planners)
