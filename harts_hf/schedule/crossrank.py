"""Cross-rank handoffs: the context rows and states a unit reads from a unit of another rank.

``units.handoff_rows`` resolves, over every rank's units, which unit each read comes from (the
own rank's first, else the earliest other rank's, always in an earlier slot). Here that answer is
seen from one rank: a unit of another rank is reached through the *block* it sends this rank
(the rows of what it keeps that this rank's units read, per context subset or state grid), so a
:class:`~.units.Gather` addresses a block as it addresses a local producer's kept rows; and the
rank's units get the blocks they send (:attr:`~.units.Unit.sends`). :class:`Transfers` is the
typed table of every such handoff (producer rank/slot/unit -> consumer rank/slot/unit, subset,
rows); :class:`Exchange` says, per call of this rank, which blocks it receives in the recording
pass and which gradient blocks it sends and receives in the replay (``harts_hf.engine.exchange``
moves them), and which blocks stream inside a call instead: those between the spans of a
context-parallel group, units of one slot on several ranks (``harts_hf.engine.stream``; a group
that would wait on itself is refused, :func:`check_groups`).

Also here: whether a plan hands anything between ranks at all (:func:`crosses_ranks`: if not, a
rank compiles its own units only, as before), the pairs a unit predicts for another rank's targets
(:func:`boundary_pairs`) and the one rank that answers for each pair (:func:`pair_homes`).

Every rank compiles the same addresses from the plan (numpy, on the host); a rank's own device
tables only are built. Legend: U the step's units, H cross-rank handoffs, r reads of one unit.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from ..forest import RolloutForest, sorted_unique
from ..planner.plan import Plan

__all__ = ["Exchange", "Transfers", "boundary_pairs", "check_groups", "crosses_ranks", "pair_homes", "rank_view"]


@dataclass(frozen=True, eq=False)
class Transfers:
    """Cross-rank handoffs, one row per (producer unit, consumer unit, subset) [H]: units are
    numbered over the step (rank by rank, each in call order); ``subset`` names the context subset
    (None: every context row; ``ConvHaloTable(W)``; ``ReplayTable(C)``) or the state grid
    ``RoundsTable(C)``; ``rows`` how many distinct rows (or states) the consumer reads. Holds
    every handoff of the units this rank's addresses depend on (all those it sends or receives)."""

    producer_rank: np.ndarray
    producer_slot: np.ndarray
    producer: np.ndarray
    consumer_rank: np.ndarray
    consumer_slot: np.ndarray
    consumer: np.ndarray
    subset: tuple[Hashable, ...]
    rows: np.ndarray

    @classmethod
    def of(cls, rows: list[tuple[int, int, int, int, int, int, Hashable, int]]) -> Transfers:
        columns = list(zip(*rows)) if rows else [()] * 8
        as_np = lambda c: np.asarray(c, dtype=np.int64)
        return cls(*(as_np(c) for c in columns[:6]), tuple(columns[6]), as_np(columns[7]))

    def __len__(self) -> int:
        return int(self.rows.size)


@dataclass(frozen=True)
class Exchange:
    """One rank's share of the step's cross-rank handoffs, by its call index k (the same k on every
    rank: calls are slot-aligned when the step has cross-rank handoffs). Each entry is a
    (peer rank, unit number) pair, sorted: after call k of the recording, ``receive`` the blocks
    that units of other ranks made in their call k; after the replay of call k, ``grad_send`` the
    gradients of the blocks whose first reader on this rank is call k, and ``grad_receive`` the
    gradients other ranks send back for this rank's units. ``sends`` (the blocks after each call)
    come with the units.

    A block whose first reader runs at the producer's own call k (a context-parallel group: spans
    of one slot on several ranks) streams instead, per layer call inside call k, its gradients
    back inside the backward of call k (``harts_hf.engine.stream``): ``stream_receive`` the blocks
    this rank's call k reads so, ``stream_send`` the blocks its call k sends so (peer: the reading
    rank); none of them is in the other tables. ``group_calls``: the calls k at which any rank's
    group streams (the same on every rank: what every rank must do alike around them, such as
    FSDP2's parameter gathers)."""

    receive: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    grad_send: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    grad_receive: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    stream_receive: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    stream_send: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    group_calls: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.receive or self.grad_receive or self.stream_receive or self.stream_send)

    @classmethod
    def of(
        cls,
        receive: set,
        grad_send: set,
        grad_receive: set,
        stream_receive: set = frozenset(),
        stream_send: set = frozenset(),
        group_calls: tuple[int, ...] = (),
    ) -> Exchange:
        """From sets of (call, peer rank, unit number), and the group calls."""
        by_call = lambda entries: {
            k: tuple(sorted((peer, u) for c, peer, u in entries if c == k)) for k in sorted({e[0] for e in entries})
        }
        return cls(*(by_call(e) for e in (receive, grad_send, grad_receive, stream_receive, stream_send)), group_calls)


def check_groups(sources: list[np.ndarray], ranks: np.ndarray, slots: np.ndarray, call: np.ndarray) -> tuple[int, ...]:
    """A unit may read a unit of another rank in its own slot (a context-parallel group) when both
    run at the same call index (their ranks then run them at once, layer by layer) and no such
    reads close a cycle (each would wait for the other inside the call). ``sources`` [2, r] per
    unit (producer, row) of its context reads, over every rank's units (every rank checks the same).
    Returns the call indices at which a group streams, the same on every rank."""
    edges = {
        (int(p), i)
        for i, s in enumerate(sources)
        for p in np.unique(s[0])
        if slots[p] == slots[i] and ranks[p] != ranks[i]
    }
    for p, i in sorted(edges):
        if call[p] != call[i]:
            raise ValueError(
                f"rank {ranks[i]} reads rank {ranks[p]}'s tokens in slot {slots[i]}, but runs its unit of them at "
                "another position in the slot (the ranks hold different forests there): a context-parallel group's "
                "spans must be the only piece, or the same forest's position, in their slot on every rank of the group"
            )
    readers: dict[int, set[int]] = {}
    for p, i in edges:
        readers.setdefault(p, set()).add(i)
    state: dict[int, int] = {}  # 1: on the current path, 2: done

    def visit(u: int) -> None:
        state[u] = 1
        for v in readers.get(u, ()):
            if state.get(v) == 1:
                raise ValueError(
                    f"the units of slot {slots[u]} on ranks {ranks[u]} and {ranks[v]} read each other's tokens (a "
                    "cycle): a context-parallel group's spans must each be a contiguous DFS range of the trajectories "
                    "it splits"
                )
            if v not in state:
                visit(v)
        state[u] = 2

    for u in sorted(readers):
        if u not in state:
            visit(u)
    return tuple(sorted({int(call[i]) for _, i in edges}))


@dataclass(frozen=True, eq=False)
class RankView:
    """One subset's handoff rows seen from one rank (:func:`rank_view`).

    Args:
        sources: per unit of the step, [2, r] (producer, row in what this rank holds of it); only
            this rank's units' are meaningful.
        held: [U] rows this rank holds of each producer: its kept rows (own rank) or the block it
            receives (another rank; 0 if none).
        sends: per unit of this rank, {consumer rank: rows of its kept rows in that rank's block}.
        transfers: (producer rank, producer slot, producer, consumer rank, consumer slot,
            consumer, rows) of every cross-rank read of this subset.
    """

    sources: list[np.ndarray]
    held: np.ndarray
    sends: dict[int, dict[int, np.ndarray]]
    transfers: list[tuple[int, int, int, int, int, int, int]]


def rank_view(
    kept: list[np.ndarray], sources: list[np.ndarray], ranks: np.ndarray, slots: np.ndarray, rank: int, world: int
) -> RankView:
    """``handoff_rows``' answer (``kept`` per unit, ``sources`` [2, r] per unit) seen from ``rank``:
    a producer of another rank is reached through the block of its kept rows that the consumer's
    rank reads (sorted rows), so reads of it are renumbered into that block; ``world`` ranks."""
    none = np.zeros(0, dtype=np.int64)
    consumer = np.concatenate([none, *(np.full(s.shape[1], i, dtype=np.int64) for i, s in enumerate(sources))])
    producer, row = (np.concatenate([none, *(s[k] for s in sources)]) for k in (0, 1))
    remote = ranks[producer] != ranks[consumer]
    p, q, c, r = producer[remote], ranks[consumer[remote]], consumer[remote], row[remote]
    stride = max((k.size for k in kept), default=0) + 1
    block = sorted_unique((p * world + q) * stride + r)  # (producer, consumer rank, row), sorted
    pair, block_row = block // stride, block % stride
    bounds = np.searchsorted(pair, np.arange(len(kept) * world + 1))
    rows_of = lambda u, to: block_row[bounds[u * world + to] : bounds[u * world + to + 1]]

    held = np.array([k.size if ranks[u] == rank else rows_of(u, rank).size for u, k in enumerate(kept)], dtype=np.int64)
    out = []
    for i, s in enumerate(sources):
        if ranks[i] != rank or not s.shape[1]:
            out.append(s)
            continue
        far = ranks[s[0]] != rank
        renumbered = s[1].copy()
        for u in np.unique(s[0][far]):
            at = far & (s[0] == u)
            renumbered[at] = np.searchsorted(rows_of(u, rank), s[1][at])
        out.append(np.stack((s[0], renumbered)))
    sends = {
        int(u): {int(to): rows_of(u, to) for to in range(world) if to != rank and rows_of(u, to).size}
        for u in np.flatnonzero(ranks == rank)
    }
    units = len(kept)
    read = sorted_unique((p * units + c) * stride + r) // stride  # (producer, consumer unit) of each distinct row
    first = np.flatnonzero(np.r_[True, read[1:] != read[:-1]]) if read.size else read
    key, count = read[first], np.diff(np.r_[first, read.size])
    transfers = [
        (int(ranks[u]), int(slots[u]), int(u), int(ranks[v]), int(slots[v]), int(v), int(n))
        for u, v, n in zip(key // units, key % units, count)
    ]
    return RankView(out, held, sends, transfers)


def crosses_ranks(forests: list[RolloutForest], plan: Plan) -> bool:
    """Whether some unit of ``plan`` reads context another rank computes: whether a parent of its
    tokens outside it is computed on another rank only (its farther ancestors then follow: each is
    in the parent's unit or read by it). Cheap (no batch is built): a plan without cross-rank
    handoffs compiles one rank's units only."""
    for rank in range(plan.world_size):
        computed = [np.zeros(f.num_compact_tokens, dtype=bool) for f in forests]
        pieces = [plan.microbatch(rank, slot) for slot in range(plan.num_slots)]
        for f, tokens in (entry for slot in pieces for entry in slot):
            computed[f][tokens] = True
        for f, tokens in (entry for slot in pieces for entry in slot):
            parent = forests[f].prev[tokens]
            if not computed[f][parent[parent >= 0]].all():
                return True
    return False


def boundary_pairs(
    forests: list[RolloutForest],
    units: list[tuple[int, np.ndarray, np.ndarray]],
    sources: list[np.ndarray],
    ranks: np.ndarray,
) -> list[np.ndarray]:
    """Per unit of the step ((forest, own tokens, context tokens), ``sources`` [2, Nc] where its
    context comes from), the pairs it computes for other ranks: a target whose predictor a unit
    reads from another rank is predicted there, by the unit holding the predictor's hidden state."""
    out: list[list[np.ndarray]] = [[] for _ in units]
    for i, (f, tokens, context) in enumerate(units):
        prev = forests[f].prev
        target = tokens[prev[tokens] >= 0]
        at = np.minimum(np.searchsorted(context, prev[target]), max(context.size - 1, 0))
        read = (context[at] == prev[target]) if context.size else np.zeros(target.size, dtype=bool)
        producer = sources[i][0][at[read]]
        far = ranks[producer] != ranks[i]
        for u in np.unique(producer[far]):
            out[u].append(target[read][far][producer[far] == u])
    return [np.unique(np.concatenate(o)) if o else np.zeros(0, dtype=np.int64) for o in out]


def pair_homes(
    forests: list[RolloutForest],
    units: list[tuple[int, np.ndarray]],
    boundary: list[np.ndarray],
    ranks: np.ndarray,
    rank: int,
) -> list[np.ndarray]:
    """Per forest [P_f] bool: the pairs ``rank`` is the lowest rank to compute, of the step's
    ``units`` (forest, own tokens) and their :func:`boundary_pairs` (a replicated chain's pairs run
    on every rank holding it; one answers for them)."""
    world = int(ranks.max(initial=0)) + 1
    home = [np.full(f.num_compact_tokens, world, dtype=np.int64) for f in forests]
    for r in range(world):
        computed = [np.zeros(f.num_compact_tokens, dtype=bool) for f in forests]
        for i in np.flatnonzero(ranks == r):
            computed[units[i][0]][units[i][1]] = True
        for f, forest in enumerate(forests):
            here = np.flatnonzero((forest.prev >= 0) & computed[f] & computed[f][np.maximum(forest.prev, 0)])
            theirs = [boundary[i] for i in np.flatnonzero(ranks == r) if units[i][0] == f]
            pairs = np.concatenate([here, *theirs])
            home[f][pairs] = np.minimum(home[f][pairs], r)
    return [h[f.prev >= 0] == rank for h, f in zip(home, forests)]
