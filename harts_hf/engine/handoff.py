"""Handoffs: what a unit gives later units, and the gradients they send back.

Every tree-aware layer call of a unit (``modeling/kinds.py``, ``modeling/attention.py``) asks the
unit's :class:`Handoff` (the :class:`~harts_hf.modeling.calls.LayerHandoff` its tree kwarg carries)
for the context rows of its inputs (K/V, conv inputs, linear-attention inputs for the replay) and
for the recurrent states its external paths start from, and hands over the same inputs at the
unit's export rows and the states after its state-export tokens (``batch.state_out``); every row
and state address is compiled with the unit (``harts_hf.schedule.units``). A call is named
``(module, kind, n)`` by the view its module takes when its forward starts (``calls.called_by``),
so gradient checkpointing's recomputation, which reruns the same forwards, finds the same names.

Recording (no grad) stores detached values in the rank's :class:`Store`, by the producing unit's
step-wide number; a unit of another rank reaches them through the block its rank is sent
(``harts_hf.engine.exchange``), stored under the producer's number too, so a unit gathers its
context the same way whichever rank kept it. In the backward pass a unit reruns with grad: the
context it reads are fresh leaves over the stored values, whose gradients go back to their
producers (through the exchange for another rank's); its own exports are kept live so the engine
can backpropagate the gradients its consumers sent. A unit that keeps its graph from the recording
(``grad`` and ``recording``) does both at once: it stores its exports for later units and keeps
them live, and reads its context as leaves.

Within a context-parallel group (spans of one slot on several ranks) the values its readers read
stream as they are kept, and their gradients come back inside the backward (``stream``).

Legend: Nc context tokens, X export rows, E external states, S state exports, C chunk size.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from collections.abc import Hashable, Mapping

import torch
from torch import nn

from ..modeling.calls import LayerHandoff
from ..ops.rounds import RoundsTable
from ..schedule import Gather, Unit
from .store import Key, Store
from .stream import Inbox, Outbox, Streams

__all__ = ["Handoff", "Store"]


class Handoff(LayerHandoff):
    """One run of one unit: its layer calls' context in, boundary values out (module docstring).
    Every address comes compiled with the unit (``harts_hf.schedule.units``)."""

    def __init__(
        self, store: Store, unit: Unit, *, grad: bool, recording: bool = False, streams: Streams | None = None
    ):
        self.store = store
        self.unit = unit
        self.grad = grad
        self.recording = recording or not grad  # stores its boundary values for later units
        self.streams = streams  # the handoffs of its context-parallel group, if any (``stream``)
        self.module: nn.Module | None = None
        self.leaves: dict[Key, torch.Tensor] = {}
        self.live: dict[Key, torch.Tensor] = {}
        self.markers: dict[Key, torch.Tensor] = {}  # roots of its backward that receive its group's gradients
        self._boxes: dict[int, Inbox | Outbox | None] = {}  # by producer: its own (Inbox), its group's (Outbox)
        self._calls: Counter = Counter()

    def at(self, module: nn.Module) -> Handoff:
        """The view ``module``'s calls use during one run of its forward (records shared)."""
        view = copy.copy(self)
        view.module, view._calls = module, Counter()
        return view

    def call(self, kind: str) -> Hashable:
        if self.module is None:
            raise RuntimeError(
                f"a tree {kind!r} call ran outside any module that names its calls (an attention module or a "
                "mixer the family adapter declares): the adapter does not match this model's modeling code"
            )
        n = self._calls[kind]
        self._calls[kind] += 1
        return (self.module, kind, n)

    def context(
        self, call: Hashable, values: Mapping[str, torch.Tensor], rows: Hashable = None
    ) -> dict[str, torch.Tensor] | None:
        """Keep ``values`` ([N, ...] each) at the rows later units read for ``rows`` (all context,
        or a table's subset such as a conv halo); return this unit's such context rows."""
        keep = self.unit.export_rows.get(rows)
        if keep is not None:
            for field, value in values.items():
                self._keep((self.unit.number, call, field), value.index_select(0, keep), rows)
        source = self.unit.context.get(rows)
        if source is None:
            return None
        return {field: self._gather(call, field, source) for field in values}

    def initial_states(self, call: Hashable, chunk_size: int) -> torch.Tensor | None:
        """[E, ...] states after ``rounds_of(batch, chunk_size).external_tokens``, None if E = 0."""
        source = self.unit.states.get(chunk_size)
        return None if source is None else self._gather(call, "state", source)

    def keep_states(self, call: Hashable, chunk_size: int, states: torch.Tensor | None) -> None:
        if states is not None:
            self._keep((self.unit.number, call, "state"), states, RoundsTable(chunk_size))

    def _keep(self, key: Key, value: torch.Tensor, subset: Hashable) -> None:
        if self.grad and key in self.live:  # a checkpoint recomputation must not replace the first
            return
        if self.recording:
            if key in self.store.values:
                module, kind, _ = key[1]
                raise RuntimeError(
                    f"{type(module).__name__} ran its {kind!r} call twice in one forward (a module shared between "
                    "layers): its context cannot be handed between microbatches; raise the microbatch budget so "
                    "each forest runs in one microbatch"
                )
            self.store.values[key] = value.detach()
            self.store.subsets[key] = subset
            if self.streams is not None:
                self.streams.keep(key, value, subset, self.store)
        if self.grad:
            self.live[key] = value
            inbox = self._box(self.unit.number)
            marker = None if inbox is None else inbox.marker(key, value, subset)
            if marker is not None:
                self.markers[key] = marker

    def _leaf(self, key: Key) -> torch.Tensor:
        outbox = self._box(key[0])
        if outbox is not None and key not in self.store.values:
            self.streams.fetch(key, self.store)
        if key not in self.store.values:
            module, kind, n = key[1]
            raise RuntimeError(
                f"unit {key[0]} recorded no {key[2]!r} for {type(module).__name__}'s {kind!r} call {n}: the model "
                "ran different layers in different microbatches"
            )
        if not self.grad:
            return self.store.values[key]
        if key not in self.leaves:
            self.leaves[key] = self.store.values[key].detach().requires_grad_(True)
            if outbox is not None:
                self.leaves[key].register_hook(functools.partial(outbox.arrived, key))
        return self.leaves[key]

    def _box(self, producer: int) -> Inbox | Outbox | None:
        """The streams of the unit's group for ``producer``'s values: this unit's own (the
        gradients its group sends back), or the one it reads in its group; None if not streamed."""
        if self.streams is None:
            return None
        if producer not in self._boxes:
            if producer == self.unit.number:
                box = self.streams.inbox(self.unit, self.store)
            else:
                box = (
                    None
                    if self.streams.peer(self.unit, producer) is None
                    else self.streams.outbox(producer, self.store, self.leaves)
                )
            self._boxes[producer] = box
        return self._boxes[producer]

    def start_backward(self) -> None:
        """Before the unit's backward: send its group's producers the gradients due ahead of the
        first value it reads, known now (values later slots read, or none: a model's layer kinds
        may keep no value of a subset the plan sends). A producer waits for them in its backward
        in that order: sent only as this unit's leaves receive theirs, they would wait on layers
        that may first meet in a collective (FSDP2's reduce-scatter) or, where it reads none,
        never come."""
        if self.streams is not None and self.grad:
            for producer in self.streams.producers(self.unit):
                self._box(producer).start()

    def finish(self) -> None:
        """After the unit's backward: settle its group's streams (what no gradient asked for), and
        drop the records of the producers it read in its group (it is their last reader here)."""
        for producer, box in self._boxes.items():
            if isinstance(box, Outbox):
                box.flush()
                self.store.release(producer)
                self.store.received.pop(producer, None)
            elif box is not None:
                box.drain()

    def _gather(self, call: Hashable, field: str, source: Gather) -> torch.Tensor:
        """The rows ``source`` addresses among the values its producers kept for ``(call, field)``."""
        parts = [self._leaf((p, call, field)) for p in source.producers]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).index_select(0, source.index)
