"""The rank's recorded boundary values, by the number of the unit that kept them: what one unit
hands later units (``handoff``), what the wire carries between ranks (``exchange``, ``stream``)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch

__all__ = ["Key", "Store"]

Key = tuple[int, Hashable, str]  # (unit number, call name (module, kind, n), field)


class Store:
    """The rank's recorded boundary values (detached) and the gradients sent back to them, by the
    number of the unit that kept them (``Unit.number``): this rank's units, and the blocks units
    of other ranks sent it (``harts_hf.engine.exchange``). ``subsets``: the context subset (or
    ``RoundsTable(C)`` for states) each kept value holds rows of; ``sent`` and ``received``: the
    keys of the blocks sent to (unit, rank) and received from a unit, in wire order."""

    def __init__(self) -> None:
        self.values: dict[Key, torch.Tensor] = {}
        self.grads: dict[Key, torch.Tensor] = {}
        self.subsets: dict[Key, Hashable] = {}
        self.sent: dict[tuple[int, int], list[Key]] = {}
        self.received: dict[int, list[Key]] = {}

    def add_grads(self, leaves: Mapping[Key, torch.Tensor]) -> None:
        for key, leaf in leaves.items():
            if leaf.grad is not None:
                self.grads[key] = self.grads[key] + leaf.grad if key in self.grads else leaf.grad

    def release(self, number: int) -> None:
        """Drop the records of unit ``number`` once nobody reads them any more (its backward is
        done, or, for a block of another rank's, its gradients are sent back)."""
        for table in (self.values, self.grads, self.subsets):
            for key in [k for k in table if k[0] == number]:
                del table[key]
