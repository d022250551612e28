"""The Schedule: one rank's pass over a plan, compiled once, that the engine runs.

Everything the engine reads while the model runs comes compiled here, before it: the rank's
units in call order (``compile_rank``: token ids, tree tables, log-prob pairs, handoff addresses,
the cross-rank handoffs it sends and receives), the padding calls a rank with fewer units makes
so that every rank makes as many model calls (and, with cross-rank handoffs, starts each slot at
the same call),
which trajectories' losses this rank owns, and the gathers that put each unit's pair values and
token values back in forest order and TRL's row layout. Legend: P_f pairs of forest f, N_f its
compact tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..forest import RolloutForest
from ..planner.plan import Plan
from ..planner.plan import plan as make_plan
from .crossrank import Exchange, Transfers
from .rows import TrajectoryRows
from .tables import Tables
from .units import Unit, compile_rank, forest_unit, rank_units

__all__ = ["Schedule"]


@dataclass(frozen=True, eq=False)
class Schedule:
    """One rank's row of a plan over its forests, compiled on the device (:meth:`compile`); the
    engine that runs it keeps the forests and the plan.

    Args:
        units: the rank's units, in slot order.
        order: the model calls every pass makes: per call, the index of its unit or -1 (``padding``).
        min_calls: the calls the plan needs (the units, and the padding that aligns slots across
            ranks where units read other ranks'); ``order`` pads to the calls asked, if more.
        padding: a two-token chain that records nothing any unit reads (None without padding calls).
        owned: per forest [B_f] bool, the trajectories whose loss this rank computes.
        rows: per forest, pair values -> TRL's ``[B_f, L_f - 1]`` layout.
        num_pairs: per forest P_f.
        pair_index: per unit, the forest-order numbers of the pairs it produces.
        token_index: per unit, its compact tokens (device).
        tables: the tree tables every unit carries (those the model's layers declare).
        plan, rank: what it was compiled from (None for a whole forest's schedule).
        transfers: the step's cross-rank handoffs (``crossrank.Transfers``; empty without).
        exchange: the rank's share of them, by call (``crossrank.Exchange``; empty without).
        pair_home: with cross-rank handoffs, per forest [P_f] bool (device): the pairs this rank
            answers for when the ranks share pair values and their gradients (a trajectory's
            pairs then run on several ranks); None without.
    """

    units: tuple[Unit, ...]
    order: tuple[int, ...]
    min_calls: int
    padding: Unit | None
    owned: tuple[torch.Tensor, ...]
    rows: tuple[TrajectoryRows, ...]
    num_pairs: tuple[int, ...]
    pair_index: tuple[torch.Tensor, ...]
    token_index: tuple[torch.Tensor, ...]
    tables: Tables
    plan: Plan | None
    rank: int
    transfers: Transfers
    exchange: Exchange
    pair_home: tuple[torch.Tensor, ...] | None = None

    @property
    def calls(self) -> int:
        """Model calls per pass, padding included."""
        return len(self.order)

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
        compiled = compile_rank(list(forests), plan, rank, tables, device)
        owned = [np.asarray(t == rank) for t in plan.traj_rank]
        order = compiled.calls + (-1,) * (calls - len(compiled.calls))
        schedule = cls._assemble(
            forests,
            compiled.units,
            owned,
            tables,
            device,
            order,
            len(compiled.calls),
            plan,
            rank,
            compiled.transfers,
            compiled.exchange,
        )
        if compiled.pair_home is None:
            return schedule
        return dataclasses.replace(
            schedule, pair_home=tuple(torch.as_tensor(h, device=device) for h in compiled.pair_home)
        )

    @classmethod
    def whole(cls, forest: RolloutForest, tables: Tables, device: torch.device | str) -> Schedule:
        """The one-unit schedule of a whole forest: every token and pair in one model call, no
        handoff, every trajectory owned (what ``tree_forward`` runs)."""
        device = torch.device(device)
        units = [forest_unit(forest, tables, device)]
        owned = [np.ones(forest.num_trajectories, dtype=bool)]
        return cls._assemble([forest], units, owned, tables, device, (0,), 1, None, 0, Transfers.of([]), Exchange())

    @classmethod
    def _assemble(
        cls,
        forests: Sequence[RolloutForest],
        units: list[Unit],
        owned: list[np.ndarray],
        tables: Tables,
        device: torch.device,
        order: tuple[int, ...],
        min_calls: int,
        plan: Plan | None,
        rank: int,
        transfers: Transfers,
        exchange: Exchange,
    ) -> Schedule:
        return cls(
            units=tuple(units),
            order=order,
            min_calls=min_calls,
            padding=_padding_unit(tables, device) if -1 in order else None,
            owned=tuple(torch.as_tensor(o, device=device) for o in owned),
            rows=tuple(TrajectoryRows.of(f, device) for f in forests),
            num_pairs=tuple(f.num_pairs for f in forests),
            pair_index=tuple(torch.as_tensor(forests[u.forest].pair_number(u.pairs), device=device) for u in units),
            token_index=tuple(torch.as_tensor(u.tokens, device=device) for u in units),
            tables=frozenset(tables),
            plan=plan,
            rank=rank,
            transfers=transfers,
            exchange=exchange,
        )

    def serves(self, plan: Plan, rank: int, tables: Tables, calls: int, device: torch.device) -> bool:
        """Whether this is ``rank``'s schedule of ``plan`` for a model whose layers read ``tables``, with at least ``calls`` model calls per pass, on ``device``: another pass over
        the same plan (the reference model after the old policy) reuses it instead of compiling."""
        on = self.units[0].input_ids.device if self.units else None
        return (
            self.plan is plan
            and self.rank == rank
            and self.tables == frozenset(tables)
            and self.calls == max(calls, self.min_calls)
            and on in (None, device)
        )

    def graph_calls(self) -> int:
        """How many of the last model calls keep their graphs from the recording to their backward
        (the engine then does not rerun them): the calls of the last ``plan.graph_slots[rank]`` slots,
        which the plan found the byte budget holds alive together (``planner.graphs``), and the
        padding calls among and after them (two tokens each). A whole forest's schedule: 1."""
        if self.plan is None:
            return min(self.calls, 1)
        first = self.plan.num_slots - int(self.plan.graph_slots[self.rank])  # the first slot kept
        for kept, index in enumerate(reversed(self.order)):
            if index >= 0 and self.units[index].slot < first:
                return kept
        return self.calls

    def host_calls(self) -> frozenset[int]:
        """The model calls whose graphs wait in host memory for their backward (the engine then does
        not rerun them): the units of the slots ``plan.host_graphs`` marks on this rank (padding
        calls rerun). A whole forest's schedule: none."""
        if self.plan is None:
            return frozenset()
        host = self.plan.host_graphs[self.rank]
        return frozenset(i for i, index in enumerate(self.order) if index >= 0 and host[self.units[index].slot])

    def call_order(self) -> list[Unit]:
        """Every model call of a pass, in order: units and padding calls."""
        return [self.padding if i < 0 else self.units[i] for i in self.order]


def _padding_unit(tables: Tables, device: torch.device) -> Unit:
    """A two-token chain in one unit: what a rank runs for a model call it has no unit for."""
    forest = RolloutForest.from_sequences([[0, 0]])
    return rank_units([forest], make_plan(forest, world_size=1, max_tokens_per_microbatch=2), 0, tables, device)[0]
