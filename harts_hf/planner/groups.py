"""Context-parallel groups: a rank's serial pieces spread over idle ranks in one slot.

A trajectory longer than the budget runs as pieces in successive slots of one rank
(``split.py``) while ranks without work wait. Here the cost model decides whether to run
``w`` consecutive microbatches of such a rank at once, in the first of their slots, one on the
rank and one on each of ``w - 1`` idle ranks: a context-parallel group, whose handoffs the engine
streams layer call by layer call (``harts_hf.engine.stream``), a wavefront over ``L`` decoder
layers that takes about ``(L + w - 1) / L`` of its largest span's time. Each moved microbatch keeps
its tokens and context (the budget holds as before) and is the only unit of its slot on its rank,
so every span of a group runs at the same call position (``harts_hf.schedule.check_groups``);
spans keep their DFS order over the ranks, so a group never waits on itself. Readers in later
slots read the spans across ranks (cross-slot handoffs). Slots left empty on every rank go.

Pricing: every span's cost times the wavefront factor, plus :meth:`CostModel.transfer` of its
context and one path start in one message (an upper bound: some of it may lie on its own rank).
``plan`` keeps the plan only when its predicted step is lower and every microbatch fits.

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

__all__ = ["DEFAULT_LAYERS", "group_pieces", "grouped", "path_spans", "plan_pieces", "with_groups"]

DEFAULT_LAYERS = 24
"""Decoder layers of the cost model's ~1B hybrid model (6 attention + 18 GDN: ``cost.COMM_DEFAULTS``)."""


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


def group_pieces(p: Plan, geo: Geometry, chunk: int) -> tuple[Pieces, list[tuple[int, list[int]]]] | None:
    """The pieces of ``p`` with serial ranks' microbatches grouped over idle ranks, and the groups
    (new slot, ranks in span order); None if no rank idles or none runs several single-forest slots.

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
    pieces = Pieces(
        rank[order],
        slot[order],
        np.r_[base.lo[keep], cut[:, 2]][order],
        np.r_[base.hi[keep], cut[:, 3]][order],
        np.r_[base.branch[keep], cut[:, 4]][order],
        np.r_[base.replica[keep], np.zeros(len(spans), dtype=bool)][order],
        kept.size,
    )
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
        cost[ranks, slot] += p.cost_model.transfer(ctx, ctx > 0, ctx > 0)
        moved += p.cost_model.transfer_bytes(ctx, ctx > 0).sum()
    return dataclasses.replace(
        p,
        cost=cost,
        groups=len(groups),
        group_ranks=max(len(r) for _, r in groups),
        group_bytes=float(moved),
        group_layers=layers,
    )


def grouped(p: Plan, geo: Geometry, build: Callable[[Pieces], Plan], layers: int) -> Plan | None:
    """The plan with context-parallel groups, if it predicts a lower step than ``p``; else None."""
    made = group_pieces(p, geo, p.chunk_size)
    if made is None:
        return None
    out = with_groups(build(made[0]), made[1], layers)
    return out if out is not None and out.step_seconds < p.step_seconds else None
