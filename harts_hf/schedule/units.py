"""Units: the model calls one rank makes for its plan, one per (microbatch slot, forest), compiled.

A slot may hold pieces of several forests; each forest's share is one packed model call (a
:class:`~harts_hf.ops.tree_batch.TreeBatch` whose context is the ancestors computed in earlier
slots). A unit is compiled once per plan, on the host with numpy: its token ids, its tree tables,
its log-prob pairs and the addresses of every handoff (which earlier unit keeps each context row
and each boundary state it reads, and which of its own rows and states later units read), all
moved to the device before the model runs. ``tree_logprobs`` runs the one-unit case
(:func:`forest_unit`).

Legend: N a unit's own tokens, Nc its context tokens, P pairs (non-root compact tokens),
X export rows, E external states, C a linear-attention chunk size.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import is_integer
from ..forest import RolloutForest, sorted_unique
from ..ops.rounds import rounds_of
from ..ops.tree_batch import TreeBatch
from ..planner.plan import Plan
from .tables import Tables, build_tables, chunk_sizes, context_subsets

__all__ = ["Gather", "Unit", "forest_unit", "handoff_rows", "rank_units"]


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
        export_rows: per context subset (None: all context rows; a table holding a subset: a
            conv's halo ``ConvHaloTable(W)``, the tokens linear attention replays
            ``ReplayTable(C)``), the rows among its own tokens later units read for it (device;
            absent: none).
        pairs: [p] compact indices j whose predictor ``prev[j]`` is an own token and whose target
            j is computed on this rank: the (predictor, target) log-probs this call produces.
        pair_rows: [p] row of each predictor in the call's own hidden states (device).
        targets: [p] the pairs' target token ids (device).
        context: per context subset, where its rows are kept (absent: none).
        states: per chunk size C, where its E external states are kept (absent: E = 0).
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


def handoff_rows(
    forests: list[RolloutForest], units: list[tuple[int, np.ndarray]], reads: list[np.ndarray]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Who hands what to whom: ``units`` are (forest, own compact indices) in call order, ``reads``
    the compact indices each unit reads from earlier units. Per unit: its own tokens that some unit
    reads (sorted: the rows of what it keeps), and [2, r] for each token it reads, the unit holding
    it and its row there."""
    owner = [np.full(f.num_compact_tokens, -1, dtype=np.int64) for f in forests]
    needed = [np.zeros(f.num_compact_tokens, dtype=bool) for f in forests]
    row = [np.zeros(f.num_compact_tokens, dtype=np.int64) for f in forests]
    for i, ((f, tokens), read) in enumerate(zip(units, reads)):
        owner[f][tokens] = i
        needed[f][read] = True
    kept = []
    for f, tokens in units:
        mine = tokens[needed[f][tokens]]
        row[f][mine] = np.arange(mine.size)
        kept.append(mine)
    return kept, [np.stack((owner[f][read], row[f][read])) for (f, _), read in zip(units, reads)]


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
    builders: Tables,
    device: torch.device,
) -> Unit:
    as_t = lambda x: torch.as_tensor(x, dtype=torch.long, device=device)
    return Unit(
        index=index,
        slot=slot,
        forest=f,
        tokens=tokens,
        input_ids=as_t(forest.tokens[tokens]),
        batch=build_tables(batch, builders, device),
        exports=exports[None],
        export_rows={key: as_t(np.searchsorted(tokens, rows)) for key, rows in exports.items() if rows.size},
        pairs=pairs,
        pair_rows=as_t(np.searchsorted(tokens, forest.prev[pairs])),
        targets=as_t(forest.tokens[pairs]),
        context=context,
        states=states,
    )


def forest_unit(forest: RolloutForest, builders: Tables, device: torch.device | str) -> Unit:
    """The one unit of a whole forest (every token, every pair, no handoff)."""
    tokens = np.arange(forest.num_compact_tokens)
    batch = TreeBatch.from_forest(forest)
    pairs = np.flatnonzero(forest.prev >= 0)
    exports = {None: np.zeros(0, dtype=np.int64)}
    return _unit(0, 0, 0, forest, batch, tokens, pairs, exports, {}, {}, builders, torch.device(device))


def rank_units(
    forests: list[RolloutForest], plan: Plan, rank: int, builders: Tables, device: torch.device | str
) -> list[Unit]:
    """The compiled units of ``rank``'s row of ``plan``; refuses a plan whose context tokens were
    not computed in an earlier slot of the same rank (the engine never reads another rank's
    activations)."""
    if not is_integer(rank) or not 0 <= rank < plan.world_size:
        raise ValueError(f"rank must be an integer in [0, {plan.world_size}) (the plan's world size), got {rank!r}")
    device = torch.device(device)
    owner = [np.full(f.num_compact_tokens, -1, dtype=np.int64) for f in forests]
    calls: list[tuple[int, int, np.ndarray, TreeBatch, np.ndarray]] = []
    for slot in range(plan.num_slots):
        first = len(calls)
        for f, tokens in plan.microbatch(rank, slot):
            tokens = sorted_unique(tokens)
            if (owner[f][tokens] >= 0).any():
                raise ValueError(f"the plan computes some tokens of forest {f} twice on rank {rank}")
            batch = TreeBatch.from_forest(forests[f], tokens)  # on the host until its tables are built
            context = batch.global_index[: batch.num_context].numpy()
            if (owner[f][context] < 0).any():
                raise ValueError(
                    f"slot {slot} of rank {rank} reads context tokens of forest {f} that no earlier slot of "
                    "the rank computes: the plan does not match these forests"
                )
            owner[f][tokens] = len(calls)
            calls.append((slot, f, tokens, batch, context))
        held = tuple(sum(c[k].size for c in calls[first:]) for k in (2, 4))  # own tokens, context tokens
        if held != (plan.tokens[rank, slot], plan.context[rank, slot]):
            raise ValueError(
                f"slot {slot} of rank {rank} holds {held[0]} own and {held[1]} context tokens where the plan counted "
                f"{plan.tokens[rank, slot]} and {plan.context[rank, slot]}: the plan does not match these forests"
            )
    own = [(f, tokens) for _, f, tokens, _, _ in calls]
    # Context rows, per subset a layer reads: all (attention), a conv's halo, the replayed tokens.
    exports: list[dict[Hashable, np.ndarray]] = [{} for _ in calls]
    contexts: list[dict[Hashable, Gather]] = [{} for _ in calls]
    for key in [None, *context_subsets(builders)]:
        reads = [
            context if key is None else batch.global_index[batch.cached(key)].numpy()
            for _, _, _, batch, context in calls
        ]
        kept, sources = handoff_rows(forests, own, reads)
        for i, read in enumerate(reads):
            exports[i][key] = kept[i]
            if read.size:
                contexts[i][key] = Gather.of(sources[i], [k.size for k in kept], device)

    # Boundary states, per chunk grid: a unit's external paths start from states after context
    # tokens (``Rounds.external_tokens``), which their producers return (``TreeBatch.state_out``).
    state_out: list[dict[int, np.ndarray]] = [{} for _ in calls]
    states: list[dict[int, Gather]] = [{} for _ in calls]
    for C in chunk_sizes(builders):
        ext = [b.global_index[rounds_of(b, C).external_tokens].numpy() for _, _, _, b, _ in calls]
        out, source = handoff_rows(forests, own, ext)
        for i, (_, _, tokens, batch, _) in enumerate(calls):
            if out[i].size:
                state_out[i][C] = batch.num_context + np.searchsorted(tokens, out[i])
            if source[i].shape[1]:
                states[i][C] = Gather.of(source[i], [o.size for o in out], device)

    pairs_of = [np.zeros(0, dtype=np.int64)] * len(calls)
    for f, forest in enumerate(forests):
        pairs = np.flatnonzero((forest.prev >= 0) & (owner[f] >= 0))  # targets computed on this rank
        unit = owner[f][forest.prev[pairs]]
        order = np.argsort(unit, kind="stable")
        bounds = np.searchsorted(unit[order], np.arange(len(calls) + 1))
        for i in np.unique(unit):
            pairs_of[i] = pairs[order[bounds[i] : bounds[i + 1]]]

    return [
        _unit(
            i,
            slot,
            f,
            forests[f],
            batch.with_state_out(state_out[i]) if state_out[i] else batch,
            tokens,
            pairs_of[i],
            exports[i],
            contexts[i],
            states[i],
            builders,
            device,
        )
        for i, (slot, f, tokens, batch, _) in enumerate(calls)
    ]
