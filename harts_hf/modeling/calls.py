"""Layer calls: how a tree call of a layer finds the context an earlier unit handed over.

A whole forest runs with no handoff (``TreeBatch.handoff`` is None). A unit run by the engine
carries its handoff on the tree kwarg; every module that makes tree calls (an attention module,
a mixer the adapter declares, a re-stated mixer) takes a view of it named after itself when its
forward starts (:func:`called_by`), so each call is named ``(module, kind, n)``: the n-th call of
that kind in this run of the module. Gradient checkpointing's recomputation reruns the module's
forward, so it takes a fresh view and finds the same names; nothing is hooked or mutated.

Legend: N own tokens, Nc context tokens, E external states.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Protocol

import torch
from torch import nn

from ..ops.rounds import ReplayTable
from ..ops.tree_batch import Table, TreeBatch

__all__ = ["LayerHandoff", "called_by", "context_of", "linear_call"]


class LayerHandoff(Protocol):
    """What tree layer calls ask of a unit's handoff (``harts_hf.engine.handoff.Handoff``)."""

    def at(self, module: nn.Module) -> LayerHandoff:
        """The view ``module``'s calls use during one run of its forward."""

    def call(self, kind: str) -> Hashable:
        """The name of this module's next ``kind`` call."""

    def context(
        self, call: Hashable, values: Mapping[str, torch.Tensor], rows: Table | None = None
    ) -> dict[str, torch.Tensor] | None:
        """Keep ``values`` ([N, ...] each) where later units read them; their context rows: all Nc
        (``rows`` None), or the subset the batch table ``rows`` holds (e.g. a conv's halo)."""

    def initial_states(self, call: Hashable, chunk_size: int) -> torch.Tensor | None:
        """[E, ...] the states the unit's external paths start from (None: E = 0)."""

    def keep_states(self, call: Hashable, chunk_size: int, states: torch.Tensor | None) -> None:
        """Keep the states after ``batch.state_out[chunk_size]`` (later units start from them)."""


def called_by(batch: TreeBatch, module: nn.Module) -> TreeBatch:
    """``batch`` as ``module``'s forward sees it: its handoff named after ``module``."""
    return batch if batch.handoff is None else batch.with_handoff(batch.handoff.at(module))


def context_of(
    batch: TreeBatch, kind: str, values: Mapping[str, torch.Tensor], rows: Table | None = None
) -> dict[str, torch.Tensor] | None:
    """The context rows of this call's inputs ``values`` ([N, ...] each) for a unit run by the
    engine (which also keeps the rows later units read): all of them, or the subset the table
    ``rows`` holds; None for a whole forest."""
    handoff = batch.handoff
    return None if handoff is None else handoff.context(handoff.call(kind), values, rows)


def linear_call(
    batch: TreeBatch,
    kind: str,
    values: Mapping[str, torch.Tensor],
    chunk_size: int,
    run: Callable[[dict | None, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]],
) -> torch.Tensor:
    """``run(context, initial_states) -> (o, states)`` with the unit's handoff: context inputs and
    boundary states in, the states later units start from (``batch.state_out``) kept."""
    handoff = batch.handoff
    if handoff is None:
        return run(None, None)[0]
    call = handoff.call(kind)
    context = handoff.context(call, values, ReplayTable(chunk_size))  # the context tokens its paths replay
    o, states = run(context, handoff.initial_states(call, chunk_size))
    handoff.keep_states(call, chunk_size, states)
    return o
