"""Units: the model calls one rank makes for its plan, one per (microbatch slot, forest), compiled.

A slot may hold pieces of several forests; each forest's share is one packed model call (a
:class:`~harts_hf.ops.tree_batch.TreeBatch` whose context is the ancestors computed in earlier
slots). A unit is compiled once per plan, on the host with numpy: its token ids, its tree tables,
its log-prob pairs and the addresses of every handoff (which earlier unit keeps each context row
and each boundary state it reads, and which of its own rows and states later units read), all
moved to the device before the model runs. ``tree_logprobs`` runs the one-unit case
(:func:`forest_unit`).

Handoffs may cross ranks: a unit reads a context token from its own rank's unit that computes it,
else from a unit of another rank in an earlier slot, or in its own slot: a context-parallel group,
one long trajectory's contiguous spans run at once on several ranks, whose handoffs stream layer
call by layer call (``harts_hf.engine.stream``; both units at the same call index, no cycle:
``crossrank.check_groups``). The addresses are resolved over every rank's units
(:func:`handoff_rows`: every rank compiles the same answer) and seen from this rank by
``crossrank.py``: the blocks its units send and receive, by call. Units are numbered over the
step (:attr:`Unit.number`), the name their kept values go by on every rank. With cross-rank
handoffs, calls align by slot across ranks, and a pair whose predictor another rank computes is
computed there (the predictor's hidden state is there).

Legend: N a unit's own tokens, Nc its context tokens, P pairs (non-root compact tokens),
X export rows, E external states, C a linear-attention chunk size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ..checks import is_integer
from ..forest import RolloutForest, sorted_unique
from ..ops.rounds import RoundsTable, rounds_of
from ..ops.tree_batch import TreeBatch
from ..planner.plan import Plan
from .crossrank import Exchange, Transfers, boundary_pairs, check_groups, crosses_ranks, pair_homes, rank_view
from .tables import Tables, build_tables, chunk_sizes, context_subsets

__all__ = ["Gather", "RankUnits", "Unit", "compile_rank", "forest_unit", "handoff_rows", "rank_units"]


@dataclass(frozen=True, eq=False)
class Gather:
    """Rows a unit reads from values earlier units kept: ``index`` [r] into the concatenation of
    the kept rows of ``producers`` (unit indices, ascending)."""

    producers: tuple[int, ...]
    index: torch.Tensor

    @classmethod
    def of(cls, source: np.ndarray, kept: list[int], device: torch.device) -> Gather:
        """From ``source`` [2, r] (producing unit, row there) and each unit's kept row count."""
        producers = np.unique(source[0])
        offsets = np.zeros(max(len(kept), 1), dtype=np.int64)
        offsets[producers] = np.cumsum([0] + [kept[p] for p in producers[:-1]])
        index = offsets[source[0]] + source[1]
        return cls(tuple(int(p) for p in producers), torch.as_tensor(index, dtype=torch.long, device=device))


@dataclass(eq=False)
class Unit:
    """One model call of a rank, compiled.

    Args:
        index: position in the rank's call order (slot order; forests in order within a slot).
        slot, forest: where it comes from.
        tokens: [N] its own compact indices (sorted = DFS order).
        input_ids: [N] their token ids (device).
        batch: its tree metadata and tables (device; context = the ancestors that ran in earlier
            units; ``state_out`` = its states later units start from).
        exports: [X] own compact indices that later units read as context (sorted).
        export_rows: per context subset (None: all context rows; a table key naming a subset: a
            conv's halo ``ConvHaloTable(W)``, the tokens linear attention replays
            ``ReplayTable(C)``), the rows among its own tokens later units read for it (device;
            absent: none).
        pairs: [p] compact indices j whose predictor ``prev[j]`` is an own token and whose target
            j is computed on this rank, or read from this unit by another rank's: the
            (predictor, target) log-probs this call produces.
        pair_rows: [p] row of each predictor in the call's own hidden states (device).
        targets: [p] the pairs' target token ids (device).
        context: per context subset, where its rows are kept (absent: none).
        states: per chunk size C, where its E external states are kept (absent: E = 0).
        number: its number among the step's units (every rank's, rank by rank, each in call
            order; without cross-rank handoffs, among its rank's): the name its kept values go by,
            on every rank.
        sends: per rank of units that read it, per subset (a context subset or ``RoundsTable(C)``
            for the states on grid C), the rows of what it keeps that it sends there (device).
    """

    index: int
    slot: int
    forest: int
    tokens: np.ndarray
    input_ids: torch.Tensor
    batch: TreeBatch
    exports: np.ndarray
    export_rows: dict[Hashable, torch.Tensor]
    pairs: np.ndarray
    pair_rows: torch.Tensor
    targets: torch.Tensor
    context: dict[Hashable, Gather]
    states: dict[int, Gather]
    number: int = 0
    sends: dict[int, dict[Hashable, torch.Tensor]] = field(default_factory=dict)


ProducerIndex = list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None]
"""Per forest, the units computing its tokens, sorted two ways: by (rank, token) and by (token,
slot, rank): keys and units of each (:func:`producer_index`)."""


def producer_index(
    forests: list[RolloutForest], units: list[tuple[int, np.ndarray]], ranks: np.ndarray, slots: np.ndarray
) -> ProducerIndex:
    """Which unit computes each token: on each rank (a rank computes a token once), and first over
    ranks (by slot, then rank); built once per step, read by every :func:`handoff_rows`."""
    out: ProducerIndex = []
    for f, forest in enumerate(forests):
        mine = [i for i, (g, _) in enumerate(units) if g == f]
        if not mine:
            out.append(None)
            continue
        unit = np.concatenate([np.full(units[i][1].size, i, dtype=np.int64) for i in mine])
        token = np.concatenate([units[i][1] for i in mine])
        local_key = ranks[unit] * forest.num_compact_tokens + token
        local = np.argsort(local_key)
        first = np.lexsort((ranks[unit], slots[unit], token))
        out.append((local_key[local], unit[local], token[first], unit[first]))
    return out


def handoff_rows(
    forests: list[RolloutForest],
    units: list[tuple[int, np.ndarray]],
    reads: list[np.ndarray],
    ranks: np.ndarray,
    slots: np.ndarray,
    producers: ProducerIndex | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Who hands what to whom: ``units`` are (forest, own compact indices) of the step's units (every
    rank's), ``ranks`` and ``slots`` [U] where each runs, ``reads`` the compact indices each reads
    from earlier slots (``producers``: their :func:`producer_index`, if built). A unit reads a token
    from the unit of its own rank that computes it, else from the first unit (by slot, then rank) of
    another rank that computes it; either must run in an earlier slot, or, on another rank, in the
    same slot (a context-parallel group; a later slot is refused). Per unit: its own tokens that
    some unit reads (sorted: the rows of what it keeps), and [2, r] for each token it reads, the
    unit holding it and its row there."""
    producers = producer_index(forests, units, ranks, slots) if producers is None else producers
    source = [np.zeros(0, dtype=np.int64) for _ in units]
    for i, ((f, _), read) in enumerate(zip(units, reads)):
        if read.size:
            local_key, local_unit, first_token, first_unit = producers[f]
            here = _lookup(local_key, local_unit, ranks[i] * forests[f].num_compact_tokens + read)
            source[i] = np.where(here >= 0, here, _lookup(first_token, first_unit, read))
            _check_producers(forests, units, ranks, slots, i, read, source[i])
    none = np.zeros(0, dtype=np.int64)
    producer, read = np.concatenate([none, *source]), np.concatenate([none, *reads])
    stride = max(f.num_compact_tokens for f in forests) + 1
    key = producer * stride + read
    held = sorted_unique(key)
    start = np.searchsorted(held, np.arange(len(units) + 1) * stride)
    kept = [held[start[u] : start[u + 1]] - u * stride for u in range(len(units))]
    row = np.split(np.searchsorted(held, key) - start[producer], np.cumsum([r.size for r in reads])[:-1])
    return kept, [np.stack((s, r)) for s, r in zip(source, row)]


def _lookup(keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
    """``values`` at the first of the sorted ``keys`` equal to each query, -1 where none is."""
    if keys.size == 0:
        return np.full(query.size, -1, dtype=np.int64)
    at = np.minimum(np.searchsorted(keys, query), keys.size - 1)
    return np.where(keys[at] == query, values[at], -1)


def _check_producers(
    forests: list[RolloutForest],
    units: list[tuple[int, np.ndarray]],
    ranks: np.ndarray,
    slots: np.ndarray,
    i: int,
    read: np.ndarray,
    source: np.ndarray,
) -> None:
    """Every token unit ``i`` reads has a producer in an earlier slot (module docstring)."""
    where = f"slot {slots[i]} of rank {ranks[i]} reads context tokens of forest {units[i][0]}"
    if (source < 0).any():
        raise ValueError(f"{where} that no rank computes: the plan does not match these forests")
    later = source[slots[source] > slots[i]]
    if (ranks[later] != ranks[i]).any():
        raise ValueError(
            f"{where} that rank {ranks[later[ranks[later] != ranks[i]][0]]} computes in a later slot: a unit reads "
            "another rank's tokens from an earlier slot, or from its own slot as a context-parallel group"
        )
    if (ranks[source[slots[source] >= slots[i]]] == ranks[i]).any():
        raise ValueError(f"{where} that no earlier slot computes: the plan does not match these forests")


def _unit(
    index: int,
    slot: int,
    f: int,
    forest: RolloutForest,
    batch: TreeBatch,
    tokens: np.ndarray,
    pairs: np.ndarray,
    exports: dict[Hashable, np.ndarray],
    context: dict[Hashable, Gather],
    states: dict[int, Gather],
    tables: Tables,
    device: torch.device,
) -> Unit:
    as_t = lambda x: torch.as_tensor(x, dtype=torch.long, device=device)
    return Unit(
        index=index,
        slot=slot,
        forest=f,
        tokens=tokens,
        input_ids=as_t(forest.tokens[tokens]),
        batch=build_tables(batch, tables, device),
        exports=exports[None],
        export_rows={key: as_t(np.searchsorted(tokens, rows)) for key, rows in exports.items() if rows.size},
        pairs=pairs,
        pair_rows=as_t(np.searchsorted(tokens, forest.prev[pairs])),
        targets=as_t(forest.tokens[pairs]),
        context=context,
        states=states,
    )


def forest_unit(forest: RolloutForest, tables: Tables, device: torch.device | str) -> Unit:
    """The one unit of a whole forest (every token, every pair, no handoff)."""
    tokens = np.arange(forest.num_compact_tokens)
    batch = TreeBatch.from_forest(forest)
    pairs = np.flatnonzero(forest.prev >= 0)
    exports = {None: np.zeros(0, dtype=np.int64)}
    return _unit(0, 0, 0, forest, batch, tokens, pairs, exports, {}, {}, tables, torch.device(device))


class _Call(NamedTuple):
    """One model call of some rank, on the host: where it runs, its tokens and batch."""

    rank: int
    slot: int
    forest: int
    tokens: np.ndarray
    batch: TreeBatch
    context: np.ndarray  # its context tokens (compact indices)


def _step_calls(forests: list[RolloutForest], plan: Plan, ranks: range) -> list[_Call]:
    """The calls of ``ranks``, rank by rank, each in call order (slots; forests in order within one)."""
    calls: list[_Call] = []
    for rank in ranks:
        computed = [np.zeros(f.num_compact_tokens, dtype=bool) for f in forests]
        for slot in range(plan.num_slots):
            first = len(calls)
            for f, tokens in plan.microbatch(rank, slot):
                tokens = sorted_unique(tokens)
                if computed[f][tokens].any():
                    raise ValueError(f"the plan computes some tokens of forest {f} twice on rank {rank}")
                computed[f][tokens] = True
                batch = TreeBatch.from_forest(forests[f], tokens)  # on the host until its tables are built
                calls.append(_Call(rank, slot, f, tokens, batch, batch.global_index[: batch.num_context].numpy()))
            held = tuple(sum(c[k].size for c in calls[first:]) for k in (3, 5))  # own tokens, context tokens
            if held != (plan.tokens[rank, slot], plan.context[rank, slot]):
                raise ValueError(
                    f"slot {slot} of rank {rank} holds {held[0]} own and {held[1]} context tokens where the plan "
                    f"counted {plan.tokens[rank, slot]} and {plan.context[rank, slot]}: the plan does not match these "
                    "forests"
                )
    return calls


def _call_index(calls: list[_Call], aligned: bool) -> np.ndarray:
    """[U] each unit's position in its rank's call order: with ``aligned`` (a step with cross-rank
    handoffs), slot s starts at the same call on every rank (ranks with fewer units in a slot pad it),
    so that a unit of an earlier slot always runs at an earlier call than its readers."""
    ranks, slots = (np.array([c[k] for c in calls], dtype=np.int64) for k in (0, 1))
    position = np.zeros(len(calls), dtype=np.int64)
    if not calls:
        return position
    for r in np.unique(ranks):
        mine = np.flatnonzero(ranks == r)
        position[mine] = np.arange(mine.size)
    if not aligned:
        return position
    first = {(r, s): i for i, (r, s) in reversed(list(enumerate(zip(ranks, slots))))}
    within = position - np.array([position[first[r, s]] for r, s in zip(ranks, slots)])
    width = np.zeros(int(slots.max()) + 1, dtype=np.int64)
    np.maximum.at(width, slots, within + 1)
    return np.r_[0, np.cumsum(width)][slots] + within


def rank_units(
    forests: list[RolloutForest], plan: Plan, rank: int, tables: Tables, device: torch.device | str
) -> list[Unit]:
    """The compiled units of ``rank``'s row of ``plan`` (:func:`compile_rank`)."""
    return compile_rank(forests, plan, rank, tables, device).units


@dataclass(frozen=True, eq=False)
class RankUnits:
    """:func:`compile_rank`'s answer: the rank's ``units``, its ``calls`` per pass (the units and the
    padding calls that align slots across ranks), each a unit index or -1 (padding), the step's
    cross-rank handoffs (``transfers``) and the rank's share of them (``exchange``); with them,
    ``pair_home`` per forest [P_f] bool: the pairs whose values (and gradients) this rank answers
    for when the ranks share them (each pair on exactly one rank; None without cross-rank
    handoffs: a rank's trajectories then have all their pairs on it)."""

    units: list[Unit]
    calls: tuple[int, ...]
    transfers: Transfers
    exchange: Exchange
    pair_home: list[np.ndarray] | None = None


def compile_rank(
    forests: list[RolloutForest], plan: Plan, rank: int, tables: Tables, device: torch.device | str
) -> RankUnits:
    """Compile ``rank``'s row of ``plan``. A unit reads its context from earlier slots: of its own
    rank, or of another rank (a cross-rank handoff, sent by ``harts_hf.engine.exchange``) in an
    earlier slot or, as a context-parallel group, in its own slot; a plan whose tokens no earlier
    slot computes, or whose group would wait on itself (``crossrank.check_groups``), is refused.
    The handoff addresses are resolved over every rank's units on the host (numpy), the device
    tables built for this rank's units only."""
    if not is_integer(rank) or not 0 <= rank < plan.world_size:
        raise ValueError(f"rank must be an integer in [0, {plan.world_size}) (the plan's world size), got {rank!r}")
    device = torch.device(device)
    # Without cross-rank handoffs a rank's addresses are its own units' business: compile those only.
    cross = crosses_ranks(forests, plan)
    calls = _step_calls(forests, plan, range(plan.world_size) if cross else range(rank, rank + 1))
    ranks, slots = (np.array([c[k] for c in calls], dtype=np.int64) for k in (0, 1))
    own = [(c.forest, c.tokens) for c in calls]
    producers = producer_index(forests, own, ranks, slots)
    _, sources = handoff_rows(forests, own, [c.context for c in calls], ranks, slots, producers)
    call = _call_index(calls, cross)
    group_calls = check_groups(sources, ranks, slots, call)
    # The units whose reads decide this rank's addresses: its own, and every reader of a unit that
    # this rank's units are or read from (a producer's kept rows are what all its readers read).
    mine = np.flatnonzero(ranks == rank)
    near = np.union1d(mine, np.concatenate([sources[i][0] for i in mine] or [np.zeros(0, dtype=np.int64)]))
    relevant = [i for i, s in enumerate(sources) if ranks[i] == rank or np.isin(s[0], near).any()]
    none = np.zeros(0, dtype=np.int64)
    local = {int(g): i for i, g in enumerate(mine)}

    exports: list[dict[Hashable, np.ndarray]] = [{} for _ in mine]
    contexts: list[dict[Hashable, Gather]] = [{} for _ in mine]
    sends: list[dict[int, dict[Hashable, torch.Tensor]]] = [{} for _ in mine]
    transfers: list[tuple] = []
    # (producer, reading rank) -> the reading rank's first call that reads it (its gradients go back after it)
    first_read: dict[tuple[int, int], int] = {}

    def hand_off(subset: Hashable, read_of) -> list[np.ndarray]:
        """One subset's handoffs (``read_of(call)``: its reads); returns every unit's kept tokens."""
        reads = [read_of(calls[i]) if i in relevant_set else none for i in range(len(calls))]
        kept, found = handoff_rows(forests, own, reads, ranks, slots, producers)
        view = rank_view(kept, found, ranks, slots, rank, plan.world_size)
        for g, i in local.items():
            if reads[g].size:
                gathers[subset][i] = Gather.of(view.sources[g], view.held, device)
            for to, rows in view.sends[g].items():
                sends[i].setdefault(to, {})[subset] = torch.as_tensor(rows, dtype=torch.long, device=device)
        for p_rank, p_slot, p, c_rank, c_slot, c, n in view.transfers:
            transfers.append((p_rank, p_slot, p, c_rank, c_slot, c, subset, n))
            first_read[p, c_rank] = min(first_read.get((p, c_rank), int(call[c])), int(call[c]))
        return kept

    relevant_set = set(relevant)
    gathers: dict[Hashable, dict[int, Gather]] = {}
    # Context rows, per subset a layer reads: all (attention), a conv's halo, the replayed tokens.
    for key in [None, *context_subsets(tables)]:
        gathers[key] = {}
        subset = lambda c, key=key: c.context if key is None else c.batch.global_index[c.batch.cached(key)].numpy()
        kept = hand_off(key, subset)
        for g, i in local.items():
            exports[i][key] = kept[g]
            if i in gathers[key]:
                contexts[i][key] = gathers[key][i]

    # Boundary states, per chunk grid: a unit's external paths start from states after context
    # tokens (``Rounds.external_tokens``), which their producers return (``TreeBatch.state_out``).
    state_out: list[dict[int, np.ndarray]] = [{} for _ in mine]
    states: list[dict[int, Gather]] = [{} for _ in mine]
    for C in chunk_sizes(tables):
        gathers[RoundsTable(C)] = {}
        out = hand_off(
            RoundsTable(C), lambda c, C=C: c.batch.global_index[rounds_of(c.batch, C).external_tokens].numpy()
        )
        for g, i in local.items():
            if out[g].size:
                state_out[i][C] = calls[g].batch.num_context + np.searchsorted(calls[g].tokens, out[g])
            if i in gathers[RoundsTable(C)]:
                states[i][C] = gathers[RoundsTable(C)][i]

    # A block whose first reader runs at the producer's call (its group) streams inside that call.
    streamed = {(p, q) for (p, q), k in first_read.items() if k == call[p]}
    later = {pq: k for pq, k in first_read.items() if pq not in streamed}
    exchange = Exchange.of(
        {(int(call[p]), int(ranks[p]), p) for p, q in later if q == rank},
        {(k, int(ranks[p]), p) for (p, q), k in later.items() if q == rank},
        {(k, q, p) for (p, q), k in later.items() if ranks[p] == rank},
        {(int(call[p]), int(ranks[p]), p) for p, q in streamed if q == rank},
        {(int(call[p]), q, p) for p, q in streamed if ranks[p] == rank},
        group_calls,
    )
    owner = [np.full(f.num_compact_tokens, -1, dtype=np.int64) for f in forests]
    for i, g in enumerate(mine):
        owner[calls[g].forest][calls[g].tokens] = i
    boundary = boundary_pairs(forests, [(c.forest, c.tokens, c.context) for c in calls], sources, ranks)
    pairs_of = [boundary[g] for g in mine]
    for f, forest in enumerate(forests):
        pairs = np.flatnonzero((forest.prev >= 0) & (owner[f] >= 0))  # targets computed on this rank
        unit = owner[f][forest.prev[pairs]]
        pairs, unit = pairs[unit >= 0], unit[unit >= 0]  # the others' predictors are another rank's
        order = np.argsort(unit, kind="stable")
        bounds = np.searchsorted(unit[order], np.arange(len(mine) + 1))
        for i in np.unique(unit):
            pairs_of[i] = np.union1d(pairs_of[i], pairs[order[bounds[i] : bounds[i + 1]]])

    units = []
    for i, g in enumerate(mine):
        c = calls[g]
        batch = c.batch
        if state_out[i]:
            batch = batch.with_state_out(state_out[i])
        unit = _unit(
            i,
            c.slot,
            c.forest,
            forests[c.forest],
            batch,
            c.tokens,
            pairs_of[i],
            exports[i],
            contexts[i],
            states[i],
            tables,
            device,
        )
        units.append(dataclasses.replace(unit, number=int(g), sends=sends[i]))
    width = int(call[ranks == rank].max(initial=-1)) + 1 if not cross else int(call.max(initial=-1)) + 1
    order = [-1] * width
    for i, g in enumerate(mine):
        order[call[g]] = i
    home = pair_homes(forests, own, boundary, ranks, rank) if cross else None
    return RankUnits(units, tuple(order), Transfers.of(transfers), exchange, home)
