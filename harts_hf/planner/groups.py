"""Context-parallel groups: a long trajectory's serial pieces spread over ranks with time to spare.

A trajectory longer than the budget runs as pieces in successive slots of one rank
(``split.py``) while the other ranks wait, idle or with less work in those slots. Two passes make
context-parallel groups, spans of one slot on several ranks reading each other, whose handoffs the
engine streams layer call by layer call (``harts_hf.engine.stream``), a wavefront over ``L``
decoder layers that takes about ``(L + w - 1) / L`` of its largest span's time:

- idle ranks (:func:`group_pieces`): ``w`` consecutive microbatches of a serial rank run at once,
  in the first of their slots, one on the rank and one on each of ``w - 1`` idle ranks; each moved
  microbatch keeps its tokens and context (the budget holds as before) and is the only unit of its
  slot on its rank. Slots left empty on every rank go.
- free time (:func:`spread_pieces`): in each slot whose costliest microbatch holds a chain piece,
  the piece is cut into spans water-filled over the microbatches of that slot with time to spare
  (busy or empty), which hold only its forest, so every span of a group runs at the same call
  position (``harts_hf.schedule.check_groups``); a piece whose microbatch holds its descendants
  stays whole (they would read its later spans at their own call). The slots stay.

Spans keep their DFS order over the ranks, so a group never waits on itself. Readers in later
slots read the spans across ranks (cross-slot handoffs).

Pricing: every span's cost times the wavefront factor, plus :meth:`CostModel.transfer` of its
context and one path start, in :data:`STREAM_MESSAGES` messages a layer (an upper bound on the bytes:
some of them may lie on its own rank).
``plan`` keeps the plan with the lower predicted step, only if lower than without groups and every
microbatch fits: a plan groups do not speed up is left as it was.

Legend: R ranks, S slots, P pieces, L decoder layers, w ranks in a group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from .geometry import Geometry
from .memory import Budget
from .pieces import Pieces
from .planned import Plan

__all__ = [
    "DEFAULT_LAYERS",
    "STREAM_MESSAGES",
    "group_pieces",
    "grouped",
    "joined_pieces",
    "path_spans",
    "plan_pieces",
    "spread_pieces",
    "with_groups",
]

DEFAULT_LAYERS = 24
"""Decoder layers of the cost model's ~1B hybrid model (6 attention + 18 GDN: ``cost.COMM_DEFAULTS``)."""
STREAM_MESSAGES = 3
"""Messages a streamed pair sends per decoder layer at the least: a value's header size, its header
and the value (``harts_hf.engine.stream``), for one value a layer call."""


def plan_pieces(p: Plan, geo: Geometry) -> Pieces:
    """The plan's pieces in global token indices."""
    lo = p.piece_start + geo.forest_tokens[p.piece_forest]
    return Pieces(
        p.piece_rank, p.piece_slot, lo, lo + p.piece_end - p.piece_start, p.piece_branch, p.piece_replica, p.num_slots
    )


def _helpers(p: Plan, serial: np.ndarray, idle: np.ndarray, cap: dict[int, int]) -> dict[int, list[int]]:
    """Idle ranks per serial rank: each next one to the rank whose group would take longest (its total
    cost over its ranks), at most ``cap[r]`` ranks in all; ties to the lower rank."""
    total = p.cost.sum(axis=1)
    given: dict[int, list[int]] = {int(r): [] for r in serial}
    for helper in idle.tolist():
        open_ = [r for r in given if 1 + len(given[r]) < cap[r]]
        if not open_:
            break
        r = max(open_, key=lambda r: (total[r] / (1 + len(given[r])), -r))
        given[r].append(helper)
    return {r: h for r, h in given.items() if h}


def _path(geo: Geometry, base: Pieces, mine: np.ndarray) -> bool:
    """Whether a rank's pieces ``mine`` (in slot order) are one root path, none a recomputed copy."""
    lo, hi = int(base.lo[mine[0]]), int(base.hi[mine[-1]])
    return bool(
        not base.replica[mine].any()
        and (base.lo[mine[1:]] == base.hi[mine[:-1]]).all()
        and int(np.diff(geo.token_depth(np.array([lo, hi - 1])))[0]) == hi - 1 - lo
    )


def path_spans(geo: Geometry, budget: Budget, lo: int, hi: int, count: int, chunk: int) -> np.ndarray | None:
    """[count + 1] bounds of ``count`` spans of equal cost of the root-path piece ``lo:hi``, cut at
    chunk-aligned depths (no replay); None if two cuts meet or a span, with its ancestors as
    context, exceeds the budget."""
    ends = geo.prefix(np.array([lo, hi]))
    target = ends[0] + (ends[1] - ends[0]) * np.arange(1, count) / count
    top = int(geo.token_depth(np.array([lo]))[0])
    depth = np.round((np.floor(geo.token_at(target)) - lo + top) / chunk) * chunk
    bounds = np.r_[lo, np.clip(depth - top + lo, lo, hi).astype(np.int64), hi]
    if (np.diff(bounds) <= 0).any():
        return None
    return bounds if (budget.footprint(np.diff(bounds), top + bounds[:-1] - lo) <= budget.tokens).all() else None


def joined_pieces(
    base: Pieces,
    keep: np.ndarray,
    cut: np.ndarray,
    rank: np.ndarray,
    slot: np.ndarray,
    order: np.ndarray,
    num_slots: int,
) -> Pieces:
    """``base``'s pieces ``keep``, then the spans ``cut`` [N, >= 5] (rank, slot, lo, hi, branch; never
    replicas), placed at ``rank`` and ``slot`` (kept pieces first, as those), sorted by ``order``."""
    return Pieces(
        rank[order],
        slot[order],
        np.r_[base.lo[keep], cut[:, 2]][order],
        np.r_[base.hi[keep], cut[:, 3]][order],
        np.r_[base.branch[keep], cut[:, 4]][order],
        np.r_[base.replica[keep], np.zeros(len(cut), dtype=bool)][order],
        num_slots,
    )


def _sharing(base: Pieces, pieces: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """[len(pieces)] whether each of ``pieces`` (indices into ``base``) holds a token of one of the
    intervals ``lo``-``hi``."""
    return ((base.lo[pieces, None] < hi[None]) & (lo[None] < base.hi[pieces, None])).any(axis=1)


def _replicated_beside(base: Pieces, rank: int) -> bool:
    """Whether ``rank`` recomputes tokens another rank owns in one of ``rank``'s slots or later: its
    microbatches moved onto idle ranks would read them from that owner (the schedule reads a token
    from its owner), at whatever position the owner runs the forest in the slot."""
    copies = np.flatnonzero((base.rank == rank) & base.replica)
    first = base.slot[base.rank == rank].min()
    owners = np.flatnonzero(~base.replica & (base.rank != rank) & (base.slot >= first))
    return bool(_sharing(base, owners, base.lo[copies], base.hi[copies]).any())


def group_pieces(p: Plan, geo: Geometry, chunk: int) -> tuple[Pieces, list[tuple[int, list[int]]]] | None:
    """The pieces of ``p`` with serial ranks' microbatches grouped over idle ranks, and the groups
    (new slot, ranks in span order); None if no rank idles or none runs several single-forest slots
    without recomputing tokens another rank owns then (:func:`_replicated_beside`).

    A serial rank whose pieces are one root path is cut again into spans of equal cost, ``w`` per
    group (the fewest groups within the budget), so a group's wavefront waits on no slow span;
    otherwise its microbatches are the spans, ``w`` consecutive ones per group."""
    busy = p.tokens > 0
    idle = np.flatnonzero(~busy.any(axis=1))
    mb = p.piece_rank * p.num_slots + p.piece_slot
    nf = int(p.piece_forest.max()) + 1
    forests_per_mb = np.bincount(np.unique(mb * nf + p.piece_forest) // nf, minlength=busy.size)
    single = (forests_per_mb.reshape(busy.shape) <= 1).all(axis=1)
    serial = np.flatnonzero((busy.sum(axis=1) > 1) & single)
    if idle.size == 0 or serial.size == 0:
        return None
    base = plan_pieces(p, geo)
    serial = np.array([r for r in serial.tolist() if not _replicated_beside(base, r)], dtype=np.int64)
    if serial.size == 0:
        return None
    own = {int(r): np.flatnonzero(p.piece_rank == r) for r in serial}
    own = {r: mine[np.lexsort((base.lo[mine], p.piece_slot[mine]))] for r, mine in own.items()}
    path = {r: _path(geo, base, mine) for r, mine in own.items()}
    # a path is cut again: as many spans as chunks; other ranks' microbatches are the spans
    cap = {
        r: (int(base.hi[mine[-1]] - base.lo[mine[0]]) // chunk if path[r] else int(busy[r].sum()))
        for r, mine in own.items()
    }
    new_rank, new_slot = p.piece_rank.copy(), p.piece_slot.copy()
    drop = np.zeros(new_rank.size, dtype=bool)
    spans: list[tuple[int, int, int, int, int]] = []  # (rank, slot, lo, hi, branch) cut again
    groups = []
    for r, helpers in sorted(_helpers(p, serial, idle, cap).items()):
        members = [r, *helpers]
        used = np.flatnonzero(busy[r])
        mine = own[r]
        lo, hi = int(base.lo[mine[0]]), int(base.hi[mine[-1]])
        for count in range(-(-used.size // len(members)), used.size + 1) if path[r] else ():
            bounds = path_spans(geo, p.budget, lo, hi, count * len(members), chunk)
            if bounds is not None:
                drop[mine] = True
                branch = int(base.branch[mine[0]])
                for i, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
                    spans.append((members[i % len(members)], int(used[i // len(members)]), a, b, branch))
                groups += [(int(used[j]), members) for j in range(count)]
                break
        else:
            for first in range(0, used.size, len(members)):
                chunk_slots = used[first : first + len(members)]
                for member, s in zip(members, chunk_slots):
                    moved = (p.piece_rank == r) & (p.piece_slot == s)
                    new_rank[moved], new_slot[moved] = member, chunk_slots[0]
                if chunk_slots.size > 1:
                    groups.append((int(chunk_slots[0]), members[: chunk_slots.size]))
    if not groups:
        return None
    keep = ~drop
    cut = np.array(spans, dtype=np.int64).reshape(-1, 5)
    rank = np.r_[new_rank[keep], cut[:, 0]]
    slot = np.r_[new_slot[keep], cut[:, 1]]
    kept = np.unique(slot)  # slots empty on every rank go
    slot = np.searchsorted(kept, slot)
    groups = [(int(np.searchsorted(kept, s)), ranks) for s, ranks in groups]
    order = np.lexsort((np.arange(rank.size), slot, rank))  # a microbatch keeps its piece order
    pieces = joined_pieces(base, keep, cut, rank, slot, order, kept.size)
    return pieces, groups


def with_groups(p: Plan, groups: list[tuple[int, list[int]]], layers: int) -> Plan | None:
    """``p`` (built from grouped pieces) with each group priced as a wavefront over ``layers`` layers
    plus its spans' transfers; None if a microbatch's footprint exceeds the budget."""
    if not p.fits_budget:
        return None
    cost = p.cost.copy()
    moved = 0.0
    for slot, ranks in groups:
        cost[ranks, slot] *= (layers + len(ranks) - 1) / layers
        ctx = p.context[ranks, slot]
        cost[ranks, slot] += p.cost_model.transfer(ctx, ctx > 0, STREAM_MESSAGES * layers * (ctx > 0))
        moved += p.cost_model.transfer_bytes(ctx, ctx > 0).sum()
    return dataclasses.replace(
        p,
        cost=cost,
        groups=len(groups),
        group_ranks=max(len(r) for _, r in groups),
        group_bytes=float(moved),
        group_layers=layers,
    )


def _water_level(base: np.ndarray, amount: float) -> float:
    """The level ``T`` at which ``sum(max(0, T - base)) == amount``: each cell filled up to it."""
    b = np.sort(base)
    levels = (amount + np.cumsum(b)) / np.arange(1, b.size + 1)
    return float(levels[np.flatnonzero(np.r_[levels[:-1] <= b[1:], True])[0]])


def _read_below(geo: Geometry, base: Pieces, chains: np.ndarray, microbatch: np.ndarray) -> np.ndarray:
    """[len(chains)] whether a piece of ``microbatch`` (indices into ``base``) descends from each chain
    piece's last token (lies in ``[hi, end of its subtree)``): it reads the whole chain, so spread, the
    chain's later spans would be read by its own rank's unit at their call: a group waiting on itself."""
    hi = base.hi[chains][:, None]
    below = geo.end[geo.node_of(base.hi[chains] - 1)][:, None]
    lo = base.lo[microbatch][None]
    return ((lo >= hi) & (lo < below)).any(axis=1)


def _computed_later(geo: Geometry, base: Pieces, piece: int, slot: int, num_ranks: int) -> np.ndarray:
    """[R] whether each rank computes a token of chain piece ``piece`` or of its root path after ``slot``
    (a replica, a branch's top): a span of it there would read that token from its own later unit, not
    from the rank computing it in time."""
    _, lo, hi = geo.path_intervals(np.array([base.hi[piece] - 1]), inclusive=True)
    later = np.flatnonzero(base.slot > slot)
    reads = _sharing(base, later, lo, hi)
    return np.bincount(base.rank[later[reads]], minlength=num_ranks) > 0


def _owned_beside(geo: Geometry, base: Pieces, piece: int, rank: int) -> bool:
    """Whether another rank owns, in the same slot, an ancestor of chain piece ``piece`` (of ``rank``):
    its spans elsewhere would read it from that rank (the schedule reads a token from its owner), at
    whatever position that rank runs the forest in the slot, not from the copy beside the first span."""
    _, lo, hi = geo.path_intervals(np.array([base.lo[piece]]))
    same = np.flatnonzero(~base.replica & (base.slot == base.slot[piece]) & (base.rank != rank))
    return bool(_sharing(base, same, lo, hi).any())


def spread_pieces(p: Plan, geo: Geometry, chunk: int) -> tuple[Pieces, list[tuple[int, list[int]]]] | None:
    """The pieces of ``p`` with, in each slot, the chain piece of its costliest microbatch cut into
    spans over the ranks with free time in that slot, and the groups (slot, ranks in span order);
    None if no slot gains a group.

    A piece whose ancestors another rank owns in the same slot is not cut (:func:`_owned_beside`).
    The piece's cost is water-filled over its rank's other work and the other ranks' microbatches
    of the slot (an empty one counts its fixed overhead): every member ends at about the same cost.
    Its rank keeps the first span (the piece's context stays put), the others follow in rank order;
    cuts lie on chunk-aligned depths (no replay). A piece whose microbatch holds its descendants is
    not cut (:func:`_read_below`). A member's microbatch must hold only the piece's forest (its spans
    then run at the same call position), its rank compute none of the span's ancestors in a later slot
    (:func:`_computed_later`) nor any of the piece's tokens (a replica: it would compute them twice),
    and its microbatch still fit the budget with the span and its ancestors as context (an upper
    bound: it may share some)."""
    base = plan_pieces(p, geo)
    R, S = p.cost.shape
    nf = int(p.piece_forest.max()) + 1
    holds = np.zeros((R, S, nf), dtype=bool)
    holds[p.piece_rank, p.piece_slot, p.piece_forest] = True
    depth = geo.token_depth(np.c_[base.lo, base.hi - 1])
    chain = ~base.replica & (depth[:, 1] - depth[:, 0] == base.hi - 1 - base.lo) & (base.hi - base.lo > chunk)
    drop = np.zeros(base.lo.size, dtype=bool)
    spans: list[tuple[int, int, int, int, int, int]] = []  # (rank, slot, lo, hi, branch, place in its microbatch)
    groups = []
    for s in range(S):
        r = int(np.argmax(p.cost[:, s]))
        mine = np.flatnonzero((p.piece_rank == r) & (p.piece_slot == s) & chain)
        mine = mine[~_read_below(geo, base, mine, np.flatnonzero((p.piece_rank == r) & (p.piece_slot == s)))]
        if mine.size == 0 or holds[r, s].sum() > 1:
            continue
        i = int(mine[np.argmax((base.hi - base.lo)[mine])])
        lo, hi, f = int(base.lo[i]), int(base.hi[i]), int(p.piece_forest[i])
        if _owned_beside(geo, base, i, r):
            continue
        late = _computed_later(geo, base, i, s, R)
        held = np.bincount(base.rank[(base.lo < hi) & (lo < base.hi)], minlength=R) > 0  # a copy of its tokens
        ranks = [q for q in range(R) if q == r or not (np.delete(holds[q, s], f).any() or late[q] or held[q])]
        own = geo.prefix(np.array([lo, hi]))
        fill = np.array([p.cost[q, s] if p.tokens[q, s] else p.cost_model.microbatch for q in ranks])
        fill[ranks.index(r)] -= own[1] - own[0]
        share = np.maximum(_water_level(fill, own[1] - own[0]) - fill, 0.0)
        order = [ranks.index(r)] + [j for j, q in enumerate(ranks) if q != r]
        members, share = [ranks[j] for j in order], share[order]
        top = int(depth[i, 0])
        cut = np.floor(geo.token_at(own[0] + np.cumsum(share)[:-1])) - lo + top
        bounds = np.r_[lo, np.clip(np.round(cut / chunk) * chunk - top + lo, lo, hi).astype(np.int64), hi]
        kept = np.flatnonzero(np.diff(bounds) > 0)
        if kept.size < 2 or kept[0] != 0:  # the piece's rank keeps the first span: its context stays put
            continue
        members = [members[k] for k in kept]
        lows, highs = bounds[kept], bounds[kept + 1]
        moved = np.array([q != r for q in members])  # the spans that land in another rank's microbatch
        taker = np.array(members)[moved]
        grown = p.budget.footprint(
            p.tokens[taker, s] + (highs - lows)[moved], p.context[taker, s] + top + lows[moved] - lo
        )
        if (grown > p.budget.tokens).any():
            continue
        drop[i] = True
        spans += [
            (q, s, int(a), int(b), int(base.branch[i]), i if q == r else -1) for q, a, b in zip(members, lows, highs)
        ]
        groups.append((s, members))
    if not groups:
        return None
    keep = np.flatnonzero(~drop)
    cut = np.array(spans, dtype=np.int64)
    rank, slot, place = np.r_[base.rank[keep], cut[:, 0]], np.r_[base.slot[keep], cut[:, 1]], np.r_[keep, cut[:, 5]]
    order = np.lexsort((place, slot, rank))  # a moved span first in its microbatch: it carries the context
    pieces = joined_pieces(base, keep, cut, rank, slot, order, S)
    return pieces, groups


def grouped(p: Plan, geo: Geometry, build: Callable[[Pieces], Plan], layers: int) -> Plan | None:
    """The plan with context-parallel groups (idle ranks taking a serial rank's microbatches, or ranks'
    free time in a slot taking spans of its costliest chain) that predicts the lowest step, if lower
    than ``p``'s; else None."""
    best = None
    for made in (group_pieces(p, geo, p.chunk_size), spread_pieces(p, geo, p.chunk_size)):
        out = None if made is None else with_groups(build(made[0]), made[1], layers)
        if out is not None and out.step_seconds < (best or p).step_seconds:
            best = out
    return best
