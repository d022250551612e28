"""The Schedule: one rank's pass over a plan, compiled once, that the engine runs.

Everything the engine reads while the model runs comes compiled here, before it: the rank's
units in call order (``rank_units``: token ids, tree tables, log-prob pairs, handoff addresses),
the padding call a rank with fewer units makes so that every rank makes as many model calls,
which trajectories' losses this rank owns, and the gathers that put each unit's pair values and
token values back in forest order and TRL's row layout. Legend: P_f pairs of forest f, N_f its
compact tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..forest import RolloutForest
from ..planner.plan import Plan
from ..planner.plan import plan as make_plan
from .rows import TrajectoryRows
from .tables import Tables
from .units import Unit, forest_unit, rank_units

__all__ = ["Schedule"]


@dataclass(frozen=True, eq=False)
class Schedule:
    """One rank's row of a plan over its forests, compiled on the device (:meth:`compile`); the
    engine that runs it keeps the forests and the plan.

    Args:
        units: the rank's model calls, in slot order.
        calls: the model calls every pass makes (>= ``len(units)``: the rest are ``padding``).
        padding: a two-token chain that records nothing any unit reads (None without padding calls).
        owned: per forest [B_f] bool, the trajectories whose loss this rank computes.
        rows: per forest, pair values -> TRL's ``[B_f, L_f - 1]`` layout.
        num_pairs: per forest P_f.
        pair_index: per unit, the forest-order numbers of the pairs it produces.
        token_index: per unit, its compact tokens (device).
        tables: the tree tables every unit carries (those the model's layers declare).
        plan, rank: what it was compiled from (None for a whole forest's schedule).
    """

    units: tuple[Unit, ...]
    calls: int
    padding: Unit | None
    owned: tuple[torch.Tensor, ...]
    rows: tuple[TrajectoryRows, ...]
    num_pairs: tuple[int, ...]
    pair_index: tuple[torch.Tensor, ...]
    token_index: tuple[torch.Tensor, ...]
    tables: Tables
    plan: Plan | None
    rank: int

    @classmethod
    def compile(
        cls,
        forests: Sequence[RolloutForest],
        plan: Plan,
        rank: int,
        tables: Tables,
        device: torch.device,
        calls: int = 0,
    ) -> Schedule:
        """``rank``'s schedule of ``plan`` over ``forests`` on ``device``; ``calls``: at least this many
        model calls per pass (padding)."""
        units = rank_units(list(forests), plan, rank, tables, device)
        owned = [np.asarray(t == rank) for t in plan.traj_rank]
        return cls._assemble(forests, units, owned, tables, device, max(calls, len(units)), plan, rank)

    @classmethod
    def whole(cls, forest: RolloutForest, tables: Tables, device: torch.device | str) -> Schedule:
        """The one-unit schedule of a whole forest: every token and pair in one model call, no
        handoff, every trajectory owned (what ``tree_forward`` runs)."""
        device = torch.device(device)
        units = [forest_unit(forest, tables, device)]
        owned = [np.ones(forest.num_trajectories, dtype=bool)]
        return cls._assemble([forest], units, owned, tables, device, 1, None, 0)

    @classmethod
    def _assemble(
        cls,
        forests: Sequence[RolloutForest],
        units: list[Unit],
        owned: list[np.ndarray],
        tables: Tables,
        device: torch.device,
        calls: int,
        plan: Plan | None,
        rank: int,
    ) -> Schedule:
        return cls(
            units=tuple(units),
            calls=calls,
            padding=_padding_unit(tables, device) if calls > len(units) else None,
            owned=tuple(torch.as_tensor(o, device=device) for o in owned),
            rows=tuple(TrajectoryRows.of(f, device) for f in forests),
            num_pairs=tuple(int((f.prev >= 0).sum()) for f in forests),
            pair_index=tuple(torch.as_tensor(forests[u.forest].pair_number[u.pairs], device=device) for u in units),
            token_index=tuple(torch.as_tensor(u.tokens, device=device) for u in units),
            tables=frozenset(tables),
            plan=plan,
            rank=rank,
        )

    def serves(self, plan: Plan, rank: int, tables: Tables, calls: int, device: torch.device) -> bool:
        """Whether this is ``rank``'s schedule of ``plan`` for a model whose layers read ``tables``, with
        at least ``calls`` model calls per pass, on ``device``: another pass over the same plan (the
        reference model after the old policy) reuses it instead of compiling."""
        on = self.units[0].input_ids.device if self.units else None
        return (
            self.plan is plan
            and self.rank == rank
            and self.tables == frozenset(tables)
            and self.calls == max(calls, len(self.units))
            and on in (None, device)
        )

    def call_order(self) -> list[Unit]:
        """Every model call of a pass: the units, then the padding calls."""
        return [*self.units, *[self.padding] * (self.calls - len(self.units))]


def _padding_unit(tables: Tables, device: torch.device) -> Unit:
    """A two-token chain in one unit: what a rank runs for a model call it has no unit for."""
    forest = RolloutForest.from_sequences([[0, 0]])
    return rank_units([forest], make_plan(forest, world_size=1, max_tokens_per_microbatch=2), 0, tables, device)[0]
