"""Cross-rank handoffs of shared chains: a chain runs once, on one rank, before every reader.

Without them a rank recomputes every top chain above its branches (``assign.py``: replicas, the
plan's redundancy). Here the cost model decides, per *component* (a top chain with every top below
it, :func:`handed_chains`), between that and a handoff: a component whose root chain costs more to
recompute on one more rank than to move there (:meth:`CostModel.transfer` of its tokens and one
path start, there and back) is *handed*. Handed components run in a first slot of their own, each
in one unit with the chains above it recomputed there, packed over the ranks largest first within
the budget; every other piece moves one slot later, so every reader of a handed chain (on its rank
or another) comes after it. The branches are assigned and cut into slots again with the handed
chains free (no rank pays for them).

:func:`transfers` then prices the exchange the engine runs (``harts_hf.engine.exchange``): per
(producer rank, consumer rank) one message carrying the distinct context rows the consumer's units
read and one state per path starting on a handed token, values there and gradients back, charged to
both ranks (a rank's sends and receives overlap: ``CostModel.exchange``). The values move after slot 0's recording and the gradients in the backward, neither
again in a replay: the seconds go to the last slot, the one ``balance.step_seconds`` counts once.
``plan`` keeps the plan with handoffs only when its predicted step is lower, and when every
microbatch, received context included, stays within the budget.

Legend: M nodes, K top chains, H handed chains, G components, A recomputed (rank, top) pairs in slot
0, R ranks, S slots, E entries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .assign import RankIntervals, assign_ranks, group_paths, rank_intervals
from .cost import CostModel
from .geometry import Geometry
from .memory import Budget, MemoryModel
from .node_parts import node_parts_of
from .pieces import Pieces, merge
from .planned import Plan
from .slots import slot_pieces

__all__ = ["Handed", "Transfers", "handed_chains", "handoff_pieces", "pair_table", "transfers"]

_PIECE_FIELDS = ("rank", "slot", "lo", "hi", "branch", "replica")


@dataclass(frozen=True, eq=False)
class Handed:
    """Handed chains and where they run.

    Args:
        node: [H] top nodes run once (DFS order). rank: [H] the rank running each, in slot 0.
        producer: [M] that rank per node, -1 for a node not handed.
        above: [A, 2] (rank, node) of the top chains above the handed ones that each slot-0 unit
            recomputes as its context (its own tokens: a unit reads nothing of the same slot).
    """

    node: np.ndarray
    rank: np.ndarray
    producer: np.ndarray
    above: np.ndarray


def _top_subtrees(geo: Geometry, tops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [K], cost [K]) of each top's chain and the top chains below it (``tops`` sorted: a
    top's subtree is the tops from it to its subtree's end, in node order)."""
    cum_tokens = np.concatenate(([0], np.cumsum(geo.length[tops])))
    cum_cost = np.concatenate(([0.0], np.cumsum(geo.node_cost[tops])))
    last = np.searchsorted(geo.start[tops], geo.end[tops])  # first top past each subtree
    first = np.arange(tops.size)
    return cum_tokens[last] - cum_tokens[first], cum_cost[last] - cum_cost[first]


def _pack(
    geo: Geometry, roots: np.ndarray, tokens: np.ndarray, work: np.ndarray, world_size: int, budget: Budget
) -> np.ndarray:
    """[G] the rank each component (root node, tokens, cost) runs on in slot 0, -1 where none has
    room: largest first onto the least loaded rank with room in the budget. A rank pays the top
    chains above a component once: components under one parent share them (others sharing part of
    the path pay it again, an overestimate)."""
    which, lo, hi = geo.path_intervals(geo.start[roots])
    above_cost = np.bincount(which, weights=geo.prefix(hi) - geo.prefix(lo), minlength=roots.size)
    depth = geo.depth[roots]
    holds: dict[int, np.ndarray] = {}  # parent node -> [R] ranks holding the path down to it
    load, held = np.zeros(world_size), np.zeros(world_size)
    out = np.full(roots.size, -1, dtype=np.int64)
    for g in np.lexsort((roots, -work)).tolist():
        has = holds.setdefault(int(geo.parent[roots[g]]), np.zeros(world_size, dtype=bool))
        need = held + tokens[g] + np.where(has, 0, depth[g])
        if (need <= budget.tokens).any():
            r = int(np.argmin(np.where(need <= budget.tokens, load + np.where(has, 0.0, above_cost[g]), np.inf)))
            out[g], held[r] = r, need[r]
            load[r] += work[g] + (0.0 if has[r] else above_cost[g])
            has[r] = True
    return out


def handed_chains(
    geo: Geometry, group_node: np.ndarray, world_size: int, budget: Budget, cost: CostModel
) -> Handed | None:
    """The top chains above ``group_node`` (``find_branches``' groups) to hand over, and their ranks;
    None if none is worth it.

    A *component* is a top with every top below it: the highest tops whose component, with the
    chains above it (recomputed in its unit), fits one microbatch and costs at most a rank's share
    of all top chains (or has no top below it), and whose own chain costs more to recompute than to
    move (:meth:`CostModel.transfer` of its tokens and one path start). A shared root above the
    components (a system prompt) stays recomputed: handed, it would run on one rank while the
    others wait for it. Components are packed over the ranks' slot 0 (:func:`_pack`).
    """
    tops = np.unique(np.concatenate([np.zeros(0, dtype=np.int64), *group_paths(geo, group_node)]))
    if tops.size == 0:
        return None
    tokens, work = _top_subtrees(geo, tops)
    # both shrink going down, so every top below a component's root qualifies too
    small = (work <= work[geo.parent[tops] < 0].sum() / world_size) | (tokens == geo.length[tops])
    ok = np.zeros(geo.num_nodes, dtype=bool)
    ok[tops] = (geo.depth[tops] + tokens <= budget.tokens) & small
    highest = ok[tops] & ((geo.parent[tops] < 0) | ~ok[np.maximum(geo.parent[tops], 0)])
    pays = geo.node_cost[tops] > cost.transfer(geo.length[tops], 1, 1)
    roots = np.flatnonzero(highest & pays)  # [G] indices into tops
    if roots.size == 0:
        return None
    root_rank = _pack(geo, tops[roots], tokens[roots], work[roots], world_size, budget)
    roots, root_rank = roots[root_rank >= 0], root_rank[root_rank >= 0]
    if roots.size == 0:
        return None
    last = np.searchsorted(geo.start[tops], geo.end[tops[roots]])
    size = last - roots
    member = np.repeat(roots - np.cumsum(size) + size, size) + np.arange(size.sum())  # [H] indices into tops
    rank = np.repeat(root_rank, size)
    order = np.argsort(member, kind="stable")
    node, rank = tops[member[order]], rank[order]
    producer = np.full(geo.num_nodes, -1, dtype=np.int64)
    producer[node] = rank
    which, lo, _ = geo.path_intervals(geo.start[tops[roots]])
    above = np.unique(np.stack((root_rank[which], geo.node_of(lo)), axis=1), axis=0).reshape(-1, 2)
    return Handed(node, rank, producer, above)


def _bound(geo: Geometry, handed: Handed, free: np.ndarray, world_size: int, cost: CostModel) -> float:
    """A lower bound of the step with ``handed``: slot 0's busiest rank (its components and the chains
    above them) with its replay, then the work left (``free``: node costs without the handed chains,
    less the chains slot 0 recomputes) spread evenly."""
    first = np.bincount(
        np.concatenate((handed.rank, handed.above[:, 0])),
        weights=geo.node_cost[np.concatenate((handed.node, handed.above[:, 1]))],
        minlength=world_size,
    ).max()
    rest = free.sum() - geo.node_cost[np.unique(handed.above[:, 1])].sum()
    return float((1 + cost.forward_share) * (first + cost.microbatch) + rest / world_size)


def handoff_pieces(
    geo: Geometry,
    options: list[tuple[tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray | None]],
    world_size: int,
    budget: Budget,
    chunk: int,
    cost: CostModel,
    beat: float,
    memory: MemoryModel,
    graphs: str,
) -> Iterator[tuple[Pieces, Handed]]:
    """The pieces of one of ``options`` (branches and the extra cost per branch root node, as ``plan``
    tries them) with the chains :func:`handed_chains` picks run once in slot 0 and everything else
    assigned and cut anew one slot later: the option whose lower bound (:func:`_bound`) is lowest, if
    that beats the step ``beat`` (one candidate: an assignment is most of a plan's time); ``memory``
    and ``graphs`` price the cuts' reruns (``slots.slot_pieces``). A top chain
    a rank recomputes in slot 0 leaves its later sequence; of the copies of a recomputed chain the
    lowest rank's owns its tokens (as ``assign.rank_intervals``).

    Two cuts of the rest, the second made only when asked for: the handed chains and slot 0's tops
    dropped before cutting (the fewest slots, but ``slot_pieces`` counts only the first token's root
    path as context, not the handed chains a microbatch of several subtrees reads: ``plan`` checks
    the budget on the built plan), and dropped after (their tokens, counted as own while cutting, bound the
    context they leave behind; handed chains cost nothing there, so they do not move the cuts)."""
    scored = []
    for i, (branches, node_extra) in enumerate(options):
        handed = handed_chains(geo, branches[2], world_size, budget, cost)
        if handed is not None:
            free = np.where(handed.producer >= 0, 0.0, geo.node_cost)
            scored.append((_bound(geo, handed, free, world_size, cost), i, branches, node_extra, handed, free))
    if not scored:
        return
    bound, _, branches, node_extra, handed, free = min(scored, key=lambda x: x[:2])
    if bound >= beat:
        return
    geo_free = dataclasses.replace(geo, cum=np.concatenate(([0.0], np.cumsum(free))))
    asg = assign_ranks(geo_free, world_size, branches, node_extra)
    iv = rank_intervals(geo_free, asg, world_size, budget.tokens)
    above = handed.above[:, 0] * geo.num_nodes + handed.above[:, 1]

    def gone(rank: np.ndarray, lo: np.ndarray, branch: np.ndarray) -> np.ndarray:
        node = geo.node_of(lo)
        return (branch < 0) & ((handed.producer[node] >= 0) | np.isin(rank * geo.num_nodes + node, above))

    kept = ~gone(iv.rank, iv.lo, iv.branch)
    for cut_of in (RankIntervals(*(getattr(iv, f.name)[kept] for f in dataclasses.fields(iv))), iv):
        cut = slot_pieces(geo_free, cut_of, world_size, budget, chunk, cost, memory, graphs)
        live = ~gone(cut.rank, cut.lo, cut.branch)
        rest = Pieces(*(getattr(cut, f)[live] for f in _PIECE_FIELDS), num_slots=cut.num_slots + 1)
        yield _with_slot0(geo, handed, dataclasses.replace(rest, slot=rest.slot + 1), world_size), handed


def _with_slot0(geo: Geometry, handed: Handed, rest: Pieces, world_size: int) -> Pieces:
    """``rest`` (slots 1..) and slot 0's handed chains and the tops above them, the recomputed tops
    owned by the lowest rank holding a copy."""
    node0 = np.concatenate((handed.above[:, 1], handed.node))
    first = Pieces(
        rank=np.concatenate((handed.above[:, 0], handed.rank)),
        slot=np.zeros(node0.size, dtype=np.int64),
        lo=geo.start[node0],
        hi=geo.start[node0] + geo.length[node0],
        branch=np.full(node0.size, -1, dtype=np.int64),
        replica=np.zeros(node0.size, dtype=bool),
        num_slots=rest.num_slots,
    )
    pieces = merge(first, rest)
    top = geo.node_of(pieces.lo)
    copy = (pieces.branch < 0) & (handed.producer[top] < 0)
    owner = np.full(geo.num_nodes, world_size, dtype=np.int64)
    np.minimum.at(owner, top[copy], pieces.rank[copy])
    return dataclasses.replace(pieces, replica=copy & (pieces.rank != owner[top]))


@dataclass(frozen=True)
class Transfers:
    """What the engine's exchange of a plan with handoffs costs: ``seconds`` [R] each rank spends
    sending and receiving, ``messages`` (producer, reader) pairs, ``bytes`` moved (values and
    gradients)."""

    seconds: np.ndarray
    messages: int
    bytes: float

    @classmethod
    def of_pairs(cls, rows: np.ndarray, states: np.ndarray, cost: CostModel, messages: int = 1) -> Transfers:
        """The transfers of [R, R] (producer, reader) context rows and path-start states, ``messages``
        a pair that moves any, priced by ``cost``: a rank's sends and its receives, posted together
        (:meth:`~.cost.CostModel.exchange`)."""
        used = (rows > 0) | (states > 0)
        pair_seconds = cost.transfer(rows, states, messages * used)
        seconds = cost.exchange(pair_seconds.sum(axis=1), pair_seconds.sum(axis=0))
        return cls(seconds, int(messages * used.sum()), float(cost.transfer_bytes(rows, states).sum()))

    def onto(self, p: Plan) -> Plan:
        """``p`` with these transfers charged to its last slot (sent once, not replayed: the slot the
        step counts once) and counted with its handoffs."""
        cost = p.cost.copy()
        cost[:, -1] += self.seconds
        return dataclasses.replace(
            p,
            cost=cost,
            handoffs=p.handoffs + self.messages,
            handoff_bytes=p.handoff_bytes + self.bytes,
            handoff_seconds=max(p.handoff_seconds, float(self.seconds.max())),
        )


def transfers(
    geo: Geometry, pieces: Pieces, handed: Handed, num_slots: int, world_size: int, cost: CostModel
) -> Transfers:
    """The cross-rank handoffs of ``pieces`` (cut in ``num_slots`` slots), priced (module docstring)."""
    parts = node_parts_of(geo, pieces.microbatch, pieces.lo, pieces.hi, world_size * num_slots)
    ext = parts.external
    entry, reader = parts.lo[ext], parts.mb[ext] // num_slots  # [E]
    # context rows: per (reader rank, handed node on its entries' root paths) the deepest row read
    which, lo, hi = geo.path_intervals(entry)
    node = geo.node_of(lo)
    src = handed.producer[node]
    far = (src >= 0) & (src != reader[which])
    key, inv = np.unique(reader[which][far] * geo.num_nodes + node[far], return_inverse=True)
    rows = np.zeros(key.size, dtype=np.int64)
    np.maximum.at(rows, inv, (hi - geo.start[node])[far])
    pair_rows = (handed.producer[key % geo.num_nodes], key // geo.num_nodes, rows)
    # path starts: entries whose parent token is handed from another rank, one state each per reader rank
    parent = parts.parent_token[ext]
    psrc = handed.producer[geo.node_of(np.maximum(parent, 0))]
    starts = (parent >= 0) & (psrc >= 0) & (psrc != reader)
    state_key = np.unique(reader[starts] * geo.num_tokens + parent[starts])
    pair_states = (handed.producer[geo.node_of(state_key % geo.num_tokens)], state_key // geo.num_tokens)
    # per (producer, reader) pair: rows, states, one message
    ctx = pair_table(*pair_rows, world_size)
    states = pair_table(*pair_states, np.ones(pair_states[0].size), world_size)
    return Transfers.of_pairs(ctx, states, cost)


def pair_table(producer: np.ndarray, reader: np.ndarray, weight: np.ndarray, world_size: int) -> np.ndarray:
    """[R, R] sums of ``weight`` per (producer rank, reader rank) pair, of reads [n] between ranks."""
    pair = producer * world_size + reader
    return np.bincount(pair, weights=weight, minlength=world_size * world_size).reshape(world_size, world_size)
