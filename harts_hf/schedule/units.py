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
``crossrank.check_groups``). Who reads whom is resolved over every rank's units as runs of tokens
(``coverage.py``: every rank checks the same step), token by token only for this rank's units and
their readers, and seen from this rank by ``crossrank.py``: the blocks its units send and
receive, by call. Units are numbered over the step (:attr:`Unit.number`), the name their kept
values go by on every rank. With cross-rank handoffs, calls align by slot across ranks, and a pair
whose predictor another rank computes is computed there (the predictor's hidden state is there).

Legend: N a unit's own tokens, Nc its context tokens, P pairs (non-root compact tokens),
X export rows, E external states, C a linear-attention chunk size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..checks import is_integer
from ..forest import RolloutForest
from ..ops.rounds import RoundsTable, rounds_of
from ..ops.tree_batch import TreeBatch
from ..planner.plan import Plan
from ..runs import Runs, context_runs, entry_tokens, group_firsts
from .coverage import Coverage, Reads, StepUnits
from .crossrank import Exchange, Transfers, boundary_pairs, check_groups, pair_homes, rank_view
from .tables import Tables, build_tables, chunk_sizes, context_subsets

__all__ = ["Gather", "RankUnits", "Unit", "compile_rank", "forest_unit", "rank_units"]


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


def rank_units(
    forests: list[RolloutForest], plan: Plan, rank: int, tables: Tables, device: torch.device | str
) -> list[Unit]:
    """The compiled units of ``rank``'s row of ``plan`` (:func:`compile_rank`)."""
    return compile_rank(forests, plan, rank, tables, device).units


@dataclass(frozen=True, eq=False)
class RankUnits:
    """:func:`compile_rank`'s answer: the rank's ``units``, its ``calls`` per pass (the units and the
    padding calls that align slots across ranks), each a unit index or -1 (padding), the
    cross-rank handoffs this rank sends or receives (``transfers``) and its share of the step's
    exchange (``exchange``); with them, ``pair_home`` per forest [P_f] bool: the pairs whose values
    (and gradients) this rank answers for when the ranks share them (each pair on exactly one
    rank; None without cross-rank handoffs: a rank's trajectories then have all their pairs on it)."""

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
    Who reads whom is resolved over every rank's units as runs (``coverage``: every rank checks
    the same); tokens are expanded, and batches built on the host, for this rank's units and for
    the units reading a context subset of theirs only (found within the tables' reach of their
    entry tokens); device tables for this rank's units only."""
    if not is_integer(rank) or not 0 <= rank < plan.world_size:
        raise ValueError(f"rank must be an integer in [0, {plan.world_size}) (the plan's world size), got {rank!r}")
    device = torch.device(device)
    step = StepUnits.of(plan)
    ranks, slots = step.rank, step.slot
    _check_fits(forests, step)
    coverage = [Coverage.of(forest, step.of_forest(f), ranks, slots) for f, forest in enumerate(forests)]
    contexts = [context_runs(forest, step.of_forest(f)) for f, forest in enumerate(forests)]
    _check_counts(plan, step, contexts)
    resolved = [cover.resolve_runs(context, ranks) for cover, context in zip(coverage, contexts)]
    producer, reader = _edges(step, resolved)
    cross = bool((ranks[producer] != ranks[reader]).any())
    call = _call_index(ranks, slots, cross)
    exchange = _exchange(producer, reader, ranks, call, rank, check_groups(producer, reader, ranks, slots, call))

    mine = np.flatnonzero(ranks == rank)
    base = 0 if cross or not mine.size else int(mine[0])  # unit numbers: over the step, or over the rank's
    subsets: list[Hashable] = [*context_subsets(tables), *(RoundsTable(C) for C in chunk_sizes(tables))]
    near = _near_reads(forests, step, coverage, max((table.reach for table in subsets), default=0))
    readers = np.unique(near.reader[np.isin(near.producer, mine) & (ranks[near.reader] != rank)])
    near_mine = near.select(ranks[near.reader] == rank)  # where this rank's units' subsets must lie
    batches = {int(g): _batch(forests, step, g) for g in (*mine, *readers)}
    read = lambda g, subset: _reads(batches[int(g)], int(g), subset, step, coverage)

    exports: list[dict[Hashable, np.ndarray]] = [{} for _ in mine]
    contexts_of: list[dict[Hashable, Gather]] = [{} for _ in mine]
    state_out: list[dict[int, np.ndarray]] = [{} for _ in mine]
    states: list[dict[int, Gather]] = [{} for _ in mine]
    sends: list[dict[int, dict[Hashable, torch.Tensor]]] = [{} for _ in mine]
    transfers: list[tuple] = []
    for subset in [None, *subsets]:
        own = [read(g, subset) for g in mine]
        if subset is None:  # the other ranks' context reads of this rank's units, from the resolved runs
            theirs = _read_from(resolved, np.isin(np.arange(step.size), mine), ranks != rank)
        else:
            _check_reach(own, near_mine, subset)
            theirs = Reads.concat([read(j, subset) for j in readers])
        theirs = theirs.select(np.isin(theirs.producer, mine) & (ranks[theirs.reader] != rank))
        view = rank_view(Reads.concat([*own, theirs]), ranks, slots, rank, plan.world_size)
        at = np.cumsum([0, *(r.token.size for r in own)])  # this rank's reads come first, unit by unit
        for i, g in enumerate(mine):
            kept = view.kept.get(int(g), np.zeros(0, dtype=np.int64))
            if isinstance(subset, RoundsTable):
                state_out[i][subset.chunk_size] = batches[int(g)].num_context + np.searchsorted(step.tokens_of(g), kept)
            else:
                exports[i][subset] = kept
            if at[i + 1] > at[i]:
                gather = Gather.of(view.sources[:, at[i] : at[i + 1]] - [[base], [0]], view.held[base:], device)
                gathers = states[i] if isinstance(subset, RoundsTable) else contexts_of[i]
                gathers[subset.chunk_size if isinstance(subset, RoundsTable) else subset] = gather
            for to, rows in view.sends.get(int(g), {}).items():
                sends[i].setdefault(to, {})[subset] = torch.as_tensor(rows, dtype=torch.long, device=device)
        transfers += [(*t[:6], subset, t[6]) for t in view.transfers]

    boundary = boundary_pairs(forests, step, coverage)
    pairs_of = _pairs(forests, step, mine, boundary)
    units = []
    for i, g in enumerate(mine):
        f, batch = int(step.forest[g]), batches[int(g)]
        if any(rows.size for rows in state_out[i].values()):
            batch = batch.with_state_out({c: rows for c, rows in state_out[i].items() if rows.size})
        unit = _unit(
            i,
            int(slots[g]),
            f,
            forests[f],
            batch,
            step.tokens_of(g),
            pairs_of[i],
            exports[i],
            contexts_of[i],
            states[i],
            tables,
            device,
        )
        units.append(dataclasses.replace(unit, number=int(g) - base, sends=sends[i]))
    order = [-1] * (int(call[slice(None) if cross else mine].max(initial=-1)) + 1)
    for i, g in enumerate(mine):
        order[call[g]] = i
    home = None
    if cross:
        home = pair_homes(forests, step, coverage, boundary, _by_forest(step, mine, pairs_of, len(forests)), rank)
    return RankUnits(units, tuple(order), Transfers.of(transfers), exchange, home)


def _call_index(ranks: np.ndarray, slots: np.ndarray, aligned: bool) -> np.ndarray:
    """[U] each unit's position in its rank's call order (units rank by rank, each in call order):
    with ``aligned`` (a step with cross-rank handoffs), slot s starts at the same call on every
    rank (ranks with fewer units in a slot pad it), so that a unit of an earlier slot always runs
    at an earlier call than its readers."""
    start = lambda key: np.searchsorted(key, key)  # the first unit with the same key (sorted keys)
    position = np.arange(ranks.size) - start(ranks)
    if not aligned or not ranks.size:
        return position
    within = position - position[start(ranks * (int(slots.max()) + 1) + slots)]
    width = np.zeros(int(slots.max()) + 1, dtype=np.int64)
    np.maximum.at(width, slots, within + 1)
    return np.r_[0, np.cumsum(width)][slots] + within


def _check_counts(plan: Plan, step: StepUnits, contexts: list[Runs]) -> None:
    """Every slot holds the own and context tokens the plan counted (else the plan is another
    batch's)."""
    held = np.zeros((2, *plan.tokens.shape), dtype=np.int64)
    np.add.at(held[0], (step.rank, step.slot), step.own.counts(step.size))
    for context in contexts:
        np.add.at(held[1], (step.rank, step.slot), context.counts(step.size))
    wrong = np.argwhere((held[0] != plan.tokens) | (held[1] != plan.context))
    if wrong.size:
        r, s = wrong[0]
        raise ValueError(
            f"slot {s} of rank {r} holds {held[0, r, s]} own and {held[1, r, s]} context tokens where the plan "
            f"counted {plan.tokens[r, s]} and {plan.context[r, s]}: the plan does not match these forests"
        )


def _check_fits(forests: list[RolloutForest], step: StepUnits) -> None:
    """The plan's pieces lie in these forests."""
    sizes = np.array([f.num_compact_tokens for f in forests], dtype=np.int64)
    forest = step.forest[step.own.group]
    if (forest >= sizes.size).any() or (step.own.hi > sizes[np.minimum(forest, sizes.size - 1)]).any():
        raise ValueError("the plan has pieces outside these forests: the plan does not match these forests")


def _edges(step: StepUnits, resolved: list[tuple[Runs, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(producer, reader) [e]: which unit reads context from which, over the step, each once, from
    the context runs resolved per forest; refuses a read with no producer in an earlier slot, or
    in its own slot on another rank (module docstring)."""
    none = np.zeros(0, dtype=np.int64)
    reader = np.concatenate([none, *(runs.group for runs, _ in resolved)])
    producer = np.concatenate([none, *(p for _, p in resolved)])
    ranks, slots = step.rank, step.slot
    missing = producer < 0
    p = np.maximum(producer, 0)
    later = ~missing & (slots[p] > slots[reader]) & (ranks[p] != ranks[reader])
    unordered = ~missing & (slots[p] >= slots[reader]) & (ranks[p] == ranks[reader])
    for bad, why in (
        (missing, "that no rank computes: the plan does not match these forests"),
        (
            later,
            (
                "that rank {} computes in a later slot: a unit reads another rank's tokens from an earlier slot, "
                "or from its own slot as a context-parallel group"
            ),
        ),
        (unordered, "that no earlier slot computes: the plan does not match these forests"),
    ):
        if bad.any():
            at = np.flatnonzero(bad)[np.argmin(reader[bad])]
            i = reader[at]
            raise ValueError(
                f"slot {slots[i]} of rank {ranks[i]} reads context tokens of forest {step.forest[i]} "
                + why.format(ranks[p[at]])
            )
    edge = np.unique(producer * step.size + reader)
    return edge // step.size, edge % step.size


def _exchange(
    producer: np.ndarray, reader: np.ndarray, ranks: np.ndarray, call: np.ndarray, rank: int, group_calls: tuple
) -> Exchange:
    """``rank``'s share of the step's exchange, from its cross-rank reads (``producer``, ``reader``
    [e]): a block goes to a rank after its producer's call, its gradients back after the replay of
    the first call there that reads it; one whose first reader runs at the producer's own call
    (a context-parallel group) streams inside that call."""
    far = ranks[producer] != ranks[reader]
    source, to, when = producer[far], ranks[reader[far]], call[reader[far]]
    mine = (to == rank) | (ranks[source] == rank)  # only the blocks this rank sends or receives
    source, to, when = source[mine], to[mine], when[mine]
    head = group_firsts(np.lexsort((when, to, source)), source, to)  # per (producer, reading rank), its first call
    # (producer, reading rank) -> that rank's first call reading it
    first_read = dict(zip(zip(source[head].tolist(), to[head].tolist()), when[head].tolist()))
    streamed = {(p, q) for (p, q), k in first_read.items() if k == call[p]}
    later = {pq: k for pq, k in first_read.items() if pq not in streamed}
    return Exchange.of(
        {(int(call[p]), int(ranks[p]), p) for p, q in later if q == rank},
        {(k, int(ranks[p]), p) for (p, q), k in later.items() if q == rank},
        {(k, q, p) for (p, q), k in later.items() if ranks[p] == rank},
        {(int(call[p]), int(ranks[p]), p) for p, q in streamed if q == rank},
        {(int(call[p]), q, p) for p, q in streamed if ranks[p] == rank},
        group_calls,
    )


def _batch(forests: list[RolloutForest], step: StepUnits, unit: int) -> TreeBatch:
    """A unit's batch, on the host until its tables are built."""
    return TreeBatch.from_forest(forests[step.forest[unit]], step.tokens_of(unit))


def _reads(batch: TreeBatch, unit: int, subset: Hashable, step: StepUnits, coverage: list[Coverage]) -> Reads:
    """A unit's reads of ``subset``, resolved: every context token (None), a context subset table's
    tokens, or the tokens after which its external states on a chunk grid sit (``RoundsTable``)."""
    if subset is None:
        rows = slice(0, batch.num_context)
    elif isinstance(subset, RoundsTable):
        rows = rounds_of(batch, subset.chunk_size).external_tokens
    else:
        rows = batch.cached(subset)
    tokens = batch.global_index[rows].numpy()
    producer = coverage[step.forest[unit]].resolve(tokens, step.rank[unit])
    return Reads(np.full(tokens.size, unit, dtype=np.int64), tokens, producer)


def _read_from(resolved: list[tuple[Runs, np.ndarray]], producers: np.ndarray, readers: np.ndarray) -> Reads:
    """The reads of the resolved context runs (each read from one producer unit) whose producer is
    one of ``producers`` and reader one of ``readers`` ([U] bool each), as token reads: only those
    runs are expanded."""
    parts = []
    for runs, producer in resolved:
        keep = producers[producer] & readers[runs.group]
        runs, producer = runs.select(keep), producer[keep]
        parts.append(Reads(runs.groups(), runs.tokens(), np.repeat(producer, runs.size)))
    return Reads.concat(parts)


def _check_reach(reads: list[Reads], near: Reads, subset: Hashable) -> None:
    """A unit's reads of ``subset`` lie within its reach (``Table.reach``) above the unit's entry
    tokens (``near``: those reads of the same units), where the units reading another rank's
    tokens are looked for."""
    stride = int(max([near.token.max(initial=0), *(r.token.max(initial=0) for r in reads)])) + 1
    allowed = np.unique(near.reader * stride + near.token)
    for r in reads:
        if not np.isin(r.reader * stride + r.token, allowed).all():
            raise RuntimeError(
                f"{subset!r} reads context tokens farther than {subset.reach} levels above the unit's entry tokens "
                "(its reach): the table's reach is out of date"
            )


def _near_reads(forests: list[RolloutForest], step: StepUnits, coverage: list[Coverage], reach: int) -> Reads:
    """Every unit's reads within ``reach`` levels above its entry tokens: where its context subsets
    and boundary states lie (``Table.reach``), resolved."""
    parts = []
    for f, (forest, cover) in enumerate(zip(forests, coverage)):
        entry, unit = entry_tokens(forest, step.of_forest(f))
        level, who = [], []
        at = forest.prev[entry]
        for _ in range(reach):
            live = at >= 0
            at, unit = at[live], unit[live]
            if not at.size:
                break
            level.append(at)
            who.append(unit)
            at = forest.prev[at]
        none = np.zeros(0, dtype=np.int64)
        token, reader = np.concatenate([none, *level]), np.concatenate([none, *who])
        parts.append(Reads(reader, token, cover.resolve(token, step.rank[reader])))
    return Reads.concat(parts)


def _pairs(forests: list[RolloutForest], step: StepUnits, mine: np.ndarray, boundary: Reads) -> list[np.ndarray]:
    """Per unit of this rank (``mine``), the pairs it computes: those whose target this rank
    computes and whose predictor the unit holds, and its :func:`crossrank.boundary_pairs`."""
    out = [boundary.token[boundary.producer == g] for g in mine]
    for f, forest in enumerate(forests):
        units = [i for i, g in enumerate(mine) if step.forest[g] == f]
        if not units:
            continue
        tokens = [step.tokens_of(mine[i]) for i in units]
        token, owner = np.concatenate(tokens), np.repeat(units, [t.size for t in tokens])
        order = np.argsort(token, kind="stable")
        token, owner = token[order], owner[order]
        target = token[forest.prev[token] >= 0]
        at = np.minimum(np.searchsorted(token, forest.prev[target]), token.size - 1)
        held = token[at] == forest.prev[target]  # the predictor is this rank's too
        for i in units:
            out[i] = np.union1d(out[i], target[held & (owner[at] == i)])
    return out


def _by_forest(step: StepUnits, mine: np.ndarray, pairs_of: list[np.ndarray], num_forests: int) -> list[np.ndarray]:
    """The pairs' targets this rank computes, per forest."""
    none = np.zeros(0, dtype=np.int64)
    return [
        np.concatenate([none, *(p for g, p in zip(mine, pairs_of) if step.forest[g] == f)]) for f in range(num_forests)
    ]
