"""Units: the model calls one rank makes for its plan, one per (microbatch slot, forest).

A slot may hold pieces of several forests; each forest's share is one packed model call (a
:class:`~harts_hf.ops.tree_batch.TreeBatch` whose context is the ancestors computed in earlier
slots). Everything here is index bookkeeping, derived once per plan with numpy.

Legend: N a unit's own tokens, Nc its context tokens, P pairs (non-root compact tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..checks import is_integer
from ..forest import RolloutForest
from ..ops.tree_batch import TreeBatch
from ..planner.plan import Plan

__all__ = ["Unit", "handoff_rows", "rank_units"]


@dataclass(eq=False)
class Unit:
    """One model call of a rank.

    Args:
        index: position in the rank's call order (slot order; forests in order within a slot).
        slot, forest: where it comes from.
        tokens: [N] its own compact indices (sorted = DFS order).
        batch: its tree metadata (context = the ancestors that ran in earlier units).
        exports: [X] own compact indices that later units read as context (sorted).
        pairs: [p] compact indices j whose predictor ``prev[j]`` is an own token and whose target
            j is computed on this rank: the (predictor, target) log-probs this call produces.
        pair_rows: [p] row of each predictor in the call's own hidden states.
        context_source: [2, Nc] for each context token, the unit holding it and its row in that
            unit's ``exports``.
    """

    index: int
    slot: int
    forest: int
    tokens: np.ndarray
    batch: TreeBatch
    exports: np.ndarray
    pairs: np.ndarray
    pair_rows: torch.Tensor
    context_source: np.ndarray


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


def rank_units(forests: list[RolloutForest], plan: Plan, rank: int, device: torch.device) -> list[Unit]:
    """The units of ``rank``'s row of ``plan``, with their handoffs; refuses a plan whose context
    tokens were not computed in an earlier slot of the same rank (the engine never reads
    another rank's activations)."""
    if not is_integer(rank) or not 0 <= rank < plan.world_size:
        raise ValueError(f"rank must be an integer in [0, {plan.world_size}) (the plan's world size), got {rank!r}")
    owner = [np.full(f.num_compact_tokens, -1, dtype=np.int64) for f in forests]
    calls: list[tuple[int, int, np.ndarray, TreeBatch, np.ndarray]] = []
    for slot in range(plan.num_slots):
        for f, tokens in plan.microbatch(rank, slot):
            tokens = np.unique(tokens)
            if (owner[f][tokens] >= 0).any():
                raise ValueError(f"the plan computes some tokens of forest {f} twice on rank {rank}")
            batch = TreeBatch.from_forest(forests[f], tokens, device=device)
            context = batch.global_index[: batch.num_context].cpu().numpy()
            if (owner[f][context] < 0).any():
                raise ValueError(
                    f"slot {slot} of rank {rank} reads context tokens of forest {f} that no earlier slot of "
                    "the rank computes: the plan does not match these forests"
                )
            owner[f][tokens] = len(calls)
            calls.append((slot, f, tokens, batch, context))

    exports, sources = handoff_rows(forests, [(f, tokens) for _, f, tokens, _, _ in calls], [c[4] for c in calls])

    pairs_of = [None] * len(calls)
    for f, forest in enumerate(forests):
        pairs = np.flatnonzero((forest.prev >= 0) & (owner[f] >= 0))  # targets computed on this rank
        unit = owner[f][forest.prev[pairs]]
        order = np.argsort(unit, kind="stable")
        bounds = np.searchsorted(unit[order], np.arange(len(calls) + 1))
        for i in np.unique(unit):
            pairs_of[i] = pairs[order[bounds[i] : bounds[i + 1]]]

    units = []
    for i, (slot, f, tokens, batch, context) in enumerate(calls):
        prev = forests[f].prev
        pairs = pairs_of[i] if pairs_of[i] is not None else np.zeros(0, dtype=np.int64)
        units.append(
            Unit(
                index=i,
                slot=slot,
                forest=f,
                tokens=tokens,
                batch=batch,
                exports=exports[i],
                pairs=pairs,
                pair_rows=torch.as_tensor(np.searchsorted(tokens, prev[pairs]), device=device),
                context_source=sources[i],
            )
        )
    return units
