"""Cross-rank handoffs: the context rows and states a unit reads from a unit of another rank.

``coverage`` resolves, over every rank's units, which unit each read comes from (the own rank's
first, else the earliest other rank's, always in an earlier slot). Here that answer is seen from
one rank (:func:`rank_view`): a unit of another rank is reached through the *block* it sends
this rank (the rows of what it keeps that this rank's units read, per context subset or state
grid), so a :class:`~.units.Gather` addresses a block as it addresses a local producer's kept
rows; and the rank's units get the blocks they send (:attr:`~.units.Unit.sends`).
:class:`Transfers` is the typed table of such handoffs (producer rank/slot/unit -> consumer
rank/slot/unit, subset, rows); :class:`Exchange` says, per call of this rank, which blocks it
receives in the recording pass and which gradient blocks it sends and receives in the replay
(``harts_hf.engine.exchange`` moves them), and which blocks stream inside a call instead: those
between the spans of a context-parallel group, units of one slot on several ranks
(``harts_hf.engine.stream``; a group that would wait on itself is refused, :func:`check_groups`).

Also here: the pairs a unit predicts for another rank's targets (:func:`boundary_pairs`) and the
one rank that answers for each pair (:func:`pair_homes`).

Every rank checks the same step-wide facts from the plan (as runs, on the host); a rank's own
addresses and device tables only are built. Legend: U the step's units, H cross-rank handoffs.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from ..forest import RolloutForest, sorted_unique
from ..runs import entry_tokens, group_firsts
from .coverage import Coverage, Reads, StepUnits

__all__ = ["Exchange", "RankView", "Transfers", "boundary_pairs", "check_groups", "pair_homes", "rank_view"]


@dataclass(frozen=True, eq=False)
class Transfers:
    """Cross-rank handoffs, one row per (producer unit, consumer unit, subset) [H]: units are
    numbered over the step (rank by rank, each in call order); ``subset`` names the context subset
    (None: every context row; ``ConvHaloTable(W)``; ``ReplayTable(C)``) or the state grid
    ``RoundsTable(C)``; ``rows`` how many distinct rows (or states) the consumer reads. Holds
    the handoffs one rank sends or receives."""

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


def check_groups(
    producer: np.ndarray, reader: np.ndarray, ranks: np.ndarray, slots: np.ndarray, call: np.ndarray
) -> tuple[int, ...]:
    """A unit may read a unit of another rank in its own slot (a context-parallel group) when both
    run at the same call index (their ranks then run them at once, layer by layer) and no such
    reads close a cycle (each would wait for the other inside the call). ``producer``, ``reader``
    [e]: which unit reads which, over every rank's units (every rank checks the same). Returns the
    call indices at which a group streams, the same on every rank."""
    same = (slots[producer] == slots[reader]) & (ranks[producer] != ranks[reader])
    edges = sorted(zip(producer[same].tolist(), reader[same].tolist()))
    for p, i in edges:
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
    """One subset's handoffs seen from one rank (:func:`rank_view`).

    Args:
        kept: per unit of this rank that some unit reads, its tokens they read, sorted: the rows
            of what it keeps.
        sources: [2, n] per read of this rank's units (in the order given), (producer, row in what
            this rank holds of it).
        held: [U] rows this rank holds of each producer: its kept rows (own rank) or the block it
            receives (another rank; 0 if none).
        sends: per unit of this rank, {consumer rank: rows of its kept rows in that rank's block}.
        transfers: (producer rank, producer slot, producer, consumer rank, consumer slot,
            consumer, rows) of every cross-rank read given.
    """

    kept: dict[int, np.ndarray]
    sources: np.ndarray
    held: np.ndarray
    sends: dict[int, dict[int, np.ndarray]]
    transfers: list[tuple[int, int, int, int, int, int, int]]


def rank_view(reads: Reads, ranks: np.ndarray, slots: np.ndarray, rank: int, world: int) -> RankView:
    """The handoffs of one subset seen from ``rank``, from ``reads``: every read of its units, and
    every read of another rank's unit that resolves to one of its units (what a unit keeps is what
    all its readers read). A producer of another rank is reached through the block of its kept
    rows that the consumer's rank reads (sorted rows), so reads of it are numbered into that block;
    ``world`` ranks."""
    units = ranks.size
    stride = int(reads.token.max(initial=0)) + 1
    p, t, q = reads.producer, reads.token, ranks[reads.reader]
    local, far = ranks[p] == rank, ranks[p] != q
    kept_key = sorted_unique(p[local] * stride + t[local])  # (producer, token) this rank keeps
    block_key = sorted_unique((p[far] * world + q[far]) * stride + t[far])  # (producer, reading rank, token)
    kept_start = np.searchsorted(kept_key, np.arange(units + 1) * stride)
    block_start = lambda pq: np.searchsorted(block_key, pq * stride)

    mine = q == rank
    pm, tm = p[mine], t[mine]
    here = ranks[pm] == rank
    row = np.where(
        here,
        np.searchsorted(kept_key, pm * stride + tm) - kept_start[pm],
        np.searchsorted(block_key, (pm * world + rank) * stride + tm) - block_start(pm * world + rank),
    )
    held = np.diff(kept_start)
    far_producers = np.unique(pm[~here])
    held[far_producers] = block_start(far_producers * world + rank + 1) - block_start(far_producers * world + rank)

    kept = {
        int(u): kept_key[kept_start[u] : kept_start[u + 1]] - u * stride
        for u in np.flatnonzero(held > 0)
        if ranks[u] == rank
    }
    pair = block_key // stride
    sends: dict[int, dict[int, np.ndarray]] = {}
    for pq in np.unique(pair[ranks[pair // world] == rank]):
        u, to = divmod(int(pq), world)
        tokens = block_key[block_start(pq) : block_start(pq + 1)] - pq * stride
        sends.setdefault(u, {})[to] = np.searchsorted(kept[u], tokens)
    read = sorted_unique((p[far] * units + reads.reader[far]) * stride + t[far]) // stride  # (producer, consumer)
    first = group_firsts(np.arange(read.size), read)
    key, count = read[first], np.diff(np.r_[first, read.size])
    transfers = [
        (int(ranks[u]), int(slots[u]), int(u), int(ranks[v]), int(slots[v]), int(v), int(n))
        for u, v, n in zip(key // units, key % units, count)
    ]
    return RankView(kept, np.stack((pm, row)), held, sends, transfers)


def boundary_pairs(forests: list[RolloutForest], step: StepUnits, coverage: list[Coverage]) -> Reads:
    """The pairs units compute for other ranks: a target whose predictor its unit reads from
    another rank is predicted there, by the unit holding the predictor's hidden state. Such a
    target is an entry token of its unit (``runs.entry_tokens``). As reads: ``reader`` the
    target's unit, ``token`` the target, ``producer`` the unit predicting it."""
    parts = []
    for f, forest in enumerate(forests):
        target, unit = entry_tokens(forest, step.of_forest(f))
        producer = coverage[f].resolve(forest.prev[target], step.rank[unit])
        far = step.rank[producer] != step.rank[unit]
        parts.append(Reads(unit[far], target[far], producer[far]))
    return Reads.concat(parts)


def pair_homes(
    forests: list[RolloutForest],
    step: StepUnits,
    coverage: list[Coverage],
    boundary: Reads,
    pairs: list[np.ndarray],
    rank: int,
) -> list[np.ndarray]:
    """Per forest [P_f] bool: the pairs ``rank`` is the lowest rank to compute (a replicated
    chain's pairs run on every rank holding it; one answers for them), of ``pairs`` per forest,
    the targets of those it computes. A rank computes a pair if it computes both its tokens, or
    if the target is among a unit's :func:`boundary_pairs` there."""
    out = []
    for f, (forest, cover, target) in enumerate(zip(forests, coverage, pairs)):
        segments = cover.num_segments
        lowest = np.full(segments, np.iinfo(np.int64).max, dtype=np.int64)  # (none computes it)
        np.minimum.at(lowest, cover.key % segments, cover.key // segments)
        seg_t, seg_p = cover.segment(target), cover.segment(forest.prev[target])
        lower = (seg_t == seg_p) & (lowest[seg_t] < rank)  # both tokens in one segment: its ranks
        apart = np.flatnonzero(seg_t != seg_p)
        which, other = cover.ranks_computing(seg_t[apart])
        below = other < rank
        both = np.isin(other[below] * segments + seg_p[apart][which[below]], cover.key)
        lower[apart[which[below][both]]] = True
        theirs = boundary.select((step.forest[boundary.reader] == f) & (step.rank[boundary.producer] < rank))
        lower |= np.isin(target, theirs.token)
        home = np.zeros(forest.num_pairs, dtype=bool)
        home[forest.pair_number(target[~lower])] = True
        out.append(home)
    return out
