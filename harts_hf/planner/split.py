"""Cut every rank's sequence into microbatch slots: connected DFS ranges, chunk-aligned cuts.

A rank's sequence (its intervals, in DFS order) is a pre-order of the tokens it computes, so any
contiguous range of it is a valid microbatch whose context is exactly the root path of its first
token: footprint = tokens + the weighted depth of the first token (``memory.Budget``). Later ranges only depend on earlier ones,
so slot order is dependency order.

:func:`equal_cost_cuts` puts the cuts of every rank at the quantiles ``k / S`` of the rank's cost
(slot-level balance: slot s costs total_r / S on rank r), then moves each cut to the nearest
candidate: a chunk-aligned token (depth % C == 0: the dependant's paths start on the chunk grid
and replay nothing) or a node boundary (a branch point, where a path starts anyway), charging a
boundary its possible replay. Whole trees that fit one microbatch are packed into the slots first
(``pack.py``); the quantiles of the rest then fill every slot to its share.
:func:`budget_cuts` fills each microbatch greedily up to the budget (the DFS-order baseline).

Legend: I intervals, R ranks, S slots, K cuts, P pieces, C chunk size.
"""

from __future__ import annotations

import numpy as np

from ..trees import replay_length
from .assign import RankIntervals
from .geometry import Geometry
from .memory import Budget
from .pieces import Pieces, pieces_of, sequence

__all__ = ["budget_cuts", "capped_cuts", "equal_cost_cuts"]


def _snap(geo: Geometry, x: np.ndarray, lo: np.ndarray, hi: np.ndarray, atomic: np.ndarray, chunk: int) -> np.ndarray:
    """The cut nearest the fractional token x within [lo, hi]: an aligned token or a node boundary,
    scored by distance plus the replay a boundary may cost; whole trees snap to their nearer end."""
    t = np.clip(np.floor(x).astype(np.int64), lo, np.maximum(hi - 1, lo))
    v = geo.node_of(t)
    ns = np.maximum(geo.start[v], lo)
    ne = np.minimum(geo.start[v] + geo.length[v], hi)
    down = t - replay_length(geo.depth[v] + t - geo.start[v], chunk)  # the aligned token at or before t
    cand = np.stack([down, down + chunk, ns, ne], axis=1)  # [K, 4]
    ok = (cand >= ns[:, None]) & (cand <= ne[:, None])
    safe = np.minimum(cand, geo.num_tokens - 1)
    replay = np.where(cand < geo.num_tokens, replay_length(geo.token_depth(safe), chunk), 0)
    score = np.where(ok, np.abs(cand - x[:, None]) + replay, np.inf)
    best = cand[np.arange(x.size), np.argmin(score, axis=1)]
    return np.where(atomic, np.where(x - lo < hi - x, lo, hi), best)


def equal_cost_cuts(
    geo: Geometry, iv: RankIntervals, world_size: int, num_slots: int, chunk: int, overhead: np.ndarray | None = None
) -> Pieces:
    """Cuts at the cost quantiles of every rank, snapped (module docstring). ``overhead`` [R, S]
    (per-microbatch costs beyond the tokens: rounds, launches) shifts the quantiles so that token
    cost plus overhead is the same in every slot of a rank."""
    cost = geo.prefix(iv.hi) - geo.prefix(iv.lo)  # [I]
    cum = np.concatenate(([0.0], np.cumsum(cost)))
    first = np.searchsorted(iv.rank, np.arange(world_size + 1))
    has = first[1:] > first[:-1]
    ranks = np.flatnonzero(has)
    base, total = cum[first[:-1][has]], cum[first[1:][has]] - cum[first[:-1][has]]
    extra = np.zeros((ranks.size, num_slots)) if overhead is None else overhead[ranks]
    share = (total + extra.sum(axis=1)) / num_slots  # [R'] cost of every slot
    target = base[:, None] + np.cumsum(share[:, None] - extra, axis=1)[:, :-1]  # [R', S - 1]
    cut_rank = np.repeat(ranks, num_slots - 1)
    target = target.ravel()
    i = np.clip(np.searchsorted(cum, target, side="right") - 1, first[cut_rank], first[cut_rank + 1] - 1)
    x = np.clip(geo.token_at(geo.prefix(iv.lo[i]) + target - cum[i]), iv.lo[i], iv.hi[i])
    c = _snap(geo, x, iv.lo[i], iv.hi[i], iv.atomic[i], chunk)
    iv_start, _ = sequence(iv, world_size)
    pos = np.maximum.accumulate(iv_start[i] + c - iv.lo[i])  # snapping never reorders cuts of one rank
    return pieces_of(iv, world_size, pos, cut_rank, num_slots)


def capped_cuts(
    geo: Geometry, iv: RankIntervals, world_size: int, num_slots: int, chunk: int, budget: Budget
) -> Pieces:
    """Quantile cuts, one slot at a time, each moved back to the last candidate the budget allows
    from the previous cut (a mid-chunk cut when none fits): where depth drops sharply, a
    microbatch running from a deep chain into a shallow sibling pays the deep context, which pure
    quantile cuts ignore. Only the last slot can overflow; the caller then adds a slot."""
    cost = geo.prefix(iv.hi) - geo.prefix(iv.lo)
    cum = np.concatenate(([0.0], np.cumsum(cost)))
    first = np.searchsorted(iv.rank, np.arange(world_size + 1))
    ranks = np.flatnonzero(first[1:] > first[:-1])
    lo_r, hi_r = first[ranks], first[ranks + 1] - 1
    base, total = cum[lo_r], cum[hi_r + 1] - cum[lo_r]
    iv_start, rank_start = sequence(iv, world_size)
    start = rank_start[ranks].copy()  # sequence position of each rank's current slot start
    cuts = np.zeros((ranks.size, num_slots - 1), dtype=np.int64)
    for k in range(num_slots - 1):  # one vectorised step per slot
        target = base + total * (k + 1) / num_slots
        i = np.clip(np.searchsorted(cum, target, side="right") - 1, lo_r, hi_r)
        x = np.clip(geo.token_at(geo.prefix(iv.lo[i]) + target - cum[i]), iv.lo[i], iv.hi[i])
        want = iv_start[i] + _snap(geo, x, iv.lo[i], iv.hi[i], iv.atomic[i], chunk) - iv.lo[i]
        j = np.searchsorted(iv_start, start, side="right") - 1
        room = budget.room(geo.token_depth(np.minimum(iv.lo[j] + start - iv_start[j], geo.num_tokens - 1)))
        cap = np.minimum(start + room, rank_start[ranks + 1])
        over = want > cap
        c = np.where(over, _last_fit(geo, iv, iv_start, cap, start, chunk), np.maximum(want, start))
        cuts[:, k] = c
        start = c
    return pieces_of(iv, world_size, cuts.ravel(), np.repeat(ranks, num_slots - 1), num_slots)


def _last_fit(
    geo: Geometry, iv: RankIntervals, iv_start: np.ndarray, cap: np.ndarray, start: np.ndarray, chunk: int
) -> np.ndarray:
    """The last cut candidate in (start, cap] (sequence positions): the aligned token or node start
    at or before cap, the start of a whole tree holding cap; cap itself when none is after start."""
    j = np.searchsorted(iv_start, cap, side="right") - 1
    j = np.maximum(np.where(cap == iv_start[j], j - 1, j), 0)  # the interval cap ends or falls in
    t = np.minimum(iv.lo[j] + cap - iv_start[j], iv.hi[j])
    inner = np.minimum(t, iv.hi[j] - 1)
    v = geo.node_of(inner)
    down = t - replay_length(geo.depth[v] + t - geo.start[v], chunk)  # the aligned token at or before t
    best = np.where(iv.atomic[j] & (t < iv.hi[j]), iv.lo[j], np.maximum(np.maximum(down, geo.start[v]), iv.lo[j]))
    best = np.where(t == iv.hi[j], t, best)
    pos = iv_start[j] + best - iv.lo[j]
    return np.where(pos > start, pos, cap)


def budget_cuts(geo: Geometry, iv: RankIntervals, world_size: int, budget: Budget) -> Pieces:
    """Greedy microbatches: each takes as many tokens as its budget allows (at least one: tokens +
    weighted depth of the first token <= budget.tokens), ranks padded with empty slots to the
    largest count."""
    iv_start, rank_start = sequence(iv, world_size)
    pos, end = rank_start[:-1].copy(), rank_start[1:]
    cuts, ranks = [], []
    while (live := pos < end).any():
        i = np.searchsorted(iv_start, pos[live], side="right") - 1
        depth = geo.token_depth(iv.lo[i] + pos[live] - iv_start[i])
        pos[live] = np.minimum(pos[live] + np.maximum(budget.room(depth), 1), end[live])
        more = pos[live] < end[live]
        cuts.append(pos[live][more])
        ranks.append(np.flatnonzero(live)[more])
    cut_pos, cut_rank = np.concatenate(cuts + [np.zeros(0, np.int64)]), np.concatenate(ranks + [np.zeros(0, np.int64)])
    order = np.lexsort((cut_pos, cut_rank))
    counts = np.bincount(cut_rank, minlength=world_size)
    return pieces_of(iv, world_size, cut_pos[order], cut_rank[order], int(counts.max()) + 1)
