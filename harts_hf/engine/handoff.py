"""Handoffs: what a unit gives the later units of its rank, and the gradients they send back.

Every tree-aware layer call of a unit (``modeling/kinds.py``, ``modeling/attention.py``) asks its
:class:`Handoff` for the context rows of its inputs (K/V, conv inputs, linear-attention inputs for
the replay) and for the recurrent states its external paths start from, and hands over the same
inputs at the unit's export rows and the states after its state-export tokens (``batch.state_out``);
every row and state address is compiled with the unit (``harts_hf.schedule.units``). A call is named
``(module, kind, n)``: the n-th call of that kind since the base-model module ``module`` was
entered (the engine's pre-hooks say which), so gradient checkpointing's recomputation, which
reruns the same modules, finds the same names.

Recording (no grad) stores detached values in the rank's :class:`Store`. In the backward pass a
unit reruns with grad: the context it reads are fresh leaves over the stored values, whose
gradients go back to their producers; its own exports are kept live so the engine can
backpropagate the gradients its consumers sent.

Legend: Nc context tokens, X export rows, E external states, S state exports, C chunk size.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping

import torch

from ..schedule import Gather, Unit

__all__ = ["Handoff", "Store"]

Key = tuple[int, Hashable, str]  # (unit, call name, field)


class Store:
    """The rank's recorded boundary values (detached) and the gradients sent back to them."""

    def __init__(self) -> None:
        self.values: dict[Key, torch.Tensor] = {}
        self.grads: dict[Key, torch.Tensor] = {}

    def add_grads(self, leaves: Mapping[Key, torch.Tensor]) -> None:
        for key, leaf in leaves.items():
            if leaf.grad is not None:
                self.grads[key] = self.grads[key] + leaf.grad if key in self.grads else leaf.grad

    def release(self, unit: Unit) -> None:
        """Drop a unit's records once nobody reads them any more (its backward is done)."""
        for table in (self.values, self.grads):
            for key in [k for k in table if k[0] == unit.index]:
                del table[key]


class Handoff:
    """One run of one unit: its layer calls' context in, boundary values out (module docstring).
    Every address comes compiled with the unit (``harts_hf.schedule.units``)."""

    def __init__(self, store: Store, unit: Unit, *, grad: bool):
        self.store = store
        self.unit = unit
        self.grad = grad
        self.module = ""
        self.leaves: dict[Key, torch.Tensor] = {}
        self.live: dict[Key, torch.Tensor] = {}
        self._calls: Counter = Counter()

    def enter(self, module: str) -> None:
        self.module = module
        self._calls.clear()

    def call(self, name: str) -> Hashable:
        """The name of the current module's next ``name`` call."""
        n = self._calls[name]
        self._calls[name] += 1
        return (self.module, name, n)

    def context(self, call: Hashable, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Keep ``values`` ([N, ...] each) at the export rows; return their context rows [Nc, ...]."""
        if self.unit.exports.size:
            for field, value in values.items():
                self._keep((self.unit.index, call, field), value.index_select(0, self.unit.export_rows))
        if self.unit.context is None:
            return None
        return {field: self._gather(call, field, self.unit.context) for field in values}

    def initial_states(self, call: Hashable, chunk_size: int) -> torch.Tensor | None:
        """[E, ...] states after ``rounds_of(batch, chunk_size).external_tokens``, None if E = 0."""
        source = self.unit.states.get(chunk_size)
        return None if source is None else self._gather(call, "state", source)

    def keep_states(self, call: Hashable, states: torch.Tensor | None) -> None:
        if states is not None:
            self._keep((self.unit.index, call, "state"), states)

    def _keep(self, key: Key, value: torch.Tensor) -> None:
        if not self.grad:
            self.store.values[key] = value.detach()
        elif key not in self.live:  # a checkpoint recomputation must not replace the first
            self.live[key] = value

    def _leaf(self, key: Key) -> torch.Tensor:
        if key not in self.store.values:
            raise RuntimeError(
                f"unit {key[0]} recorded no {key[2]!r} for layer call {key[1]}: the model ran different layers "
                "in different microbatches"
            )
        if not self.grad:
            return self.store.values[key]
        if key not in self.leaves:
            self.leaves[key] = self.store.values[key].detach().requires_grad_(True)
        return self.leaves[key]

    def _gather(self, call: Hashable, field: str, source: Gather) -> torch.Tensor:
        """The rows ``source`` addresses among the values its producers kept for ``(call, field)``."""
        parts = [self._leaf((p, call, field)) for p in source.producers]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).index_select(0, source.index)
