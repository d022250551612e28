"""TreeBatch: the tree metadata one microbatch of compact tokens needs, derived once.

A microbatch is either a whole forest or a *piece* of one (a subset of its compact tokens that
the planner cut out). A piece's tokens may descend from tokens that ran in an earlier
microbatch: those ancestors are its *context*. Layers read context through explicit inputs
(ancestor K/V, recurrent states plus replay inputs, conv halos) passed next to the piece's own.

Index spaces: "combined" = ``cat([context, piece])`` (context first, both in DFS order);
``num_context`` = len(context). For a whole forest the context is empty and combined == piece.
Per-kind structures (attention blocks, linear-attention rounds, conv gather tables) are tables:
each is named by a typed key, a :class:`Table` (a frozen dataclass of what it is built from, e.g.
the chunk size), that builds it, and the op modules read them through :meth:`TreeBatch.cached`,
once per batch, not once per layer. ``harts_hf.schedule`` builds the tables a model's layers
declare on the host before the model runs and moves them to the device with :meth:`TreeBatch.to`;
the layers then only read, and a layer reading a table nobody declared fails (:class:`MissingTable`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from ..forest import RolloutForest, sorted_unique
from ..runs import Runs, context_runs

__all__ = ["MissingTable", "Table", "TreeBatch"]


class Table:
    """The typed key of one tree table of a batch, and its builder: subclasses are frozen
    dataclasses whose fields are what the table is built from (a chunk size, a conv width), so two
    keys are equal iff they name the same table. ``build`` may read the batch (and other tables, each
    then built too) and the key's fields only: it runs on any batch, ahead of the layers."""

    context_subset: ClassVar[bool] = False
    """The table is [R] combined indices (ascending) of the context tokens one kind of layer reads:
    the rows a unit's handoff delivers to it (a conv's halo, the tokens linear attention replays)."""
    state_dependent: ClassVar[bool] = False
    """The table depends on ``TreeBatch.state_out`` (:meth:`TreeBatch.with_state_out` drops it)."""

    def build(self, batch: TreeBatch) -> Any:
        raise NotImplementedError

    @property
    def reach(self) -> int:
        """How far above a piece's entry tokens (own tokens whose parent is context) the context
        tokens a context subset (or a state grid's boundary states) lie, in levels: a rank's compile
        finds another rank's readers of its tokens by it (``harts_hf.schedule.units``)."""
        raise NotImplementedError(f"{type(self).__name__} names no context tokens")


class MissingTable(LookupError):
    """A layer read a table its batch does not hold, on a batch whose tables were built ahead.
    ``call``: the kernel or attention call that read it, ``layer``: the module making that call
    (filled in on the way up by the callers that know them, ``harts_hf.modeling``)."""

    def __init__(self, table: Table, call: str | None = None, layer: str | None = None):
        super().__init__(table, call, layer)
        self.table, self.call, self.layer = table, call, layer

    def __str__(self) -> str:
        who = " of ".join(part for part in (self.call, self.layer) if part) or "a layer"
        return (
            f"{who} read the tree table {self.table}, which was not built before the model ran: its layer kind "
            "does not declare it (the tables harts_hf.modeling.tables.model_tables finds for this model are wrong)"
        )


@dataclass(eq=False)
class TreeBatch:
    """Tree metadata of one microbatch (combined index space, see module docstring).

    Args:
        position: [Nc + N] absolute depth of each token (its RoPE position and chunk-grid index).
        prev: [Nc + N] combined index of the previous token on the root path, -1 at a root.
        global_index: [Nc + N] compact index in the forest (DFS pre-order).
        global_end: [Nc + N] exclusive end of the token's subtree, in forest indices: k is an
            ancestor-or-self of q iff ``global_index[k] <= global_index[q] < global_end[k]``.
        num_context: Nc, the leading tokens that ran in earlier microbatches.
        state_out: per linear-attention chunk size C, the combined indices (host, sorted) of the
            own tokens whose recurrent states the linear ops return (later pieces start from
            them; each sits just before a chunk boundary); absent: none.
        handoff: for a piece run by ``harts_hf.engine``, the object that gives each layer call its
            context inputs and keeps the boundary outputs later pieces read (the modeling kinds
            call it); None for a whole forest. Set on a per-run view (:meth:`with_handoff`).
        built_ahead: the batch holds every table its model's layers declare (``harts_hf.schedule``
            built them before the model runs): reading another raises :class:`MissingTable`
            instead of building it while the model runs.
    """

    position: torch.Tensor
    prev: torch.Tensor
    global_index: torch.Tensor
    global_end: torch.Tensor
    num_context: int = 0
    state_out: Mapping[int, np.ndarray] = field(default_factory=dict)
    handoff: Any = None
    built_ahead: bool = False
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_forest(
        cls,
        forest: RolloutForest,
        tokens: np.ndarray | None = None,
        device: torch.device | str | None = None,
    ) -> TreeBatch:
        """The batch of a whole forest, or of the piece made of the compact indices ``tokens``."""
        n = forest.num_compact_tokens
        if tokens is None:
            combined = np.arange(n)
            num_context = 0
            prev = forest.prev
        else:
            tokens = sorted_unique(tokens)
            if tokens.size == 0 or tokens[0] < 0 or tokens[-1] >= n:
                raise ValueError(f"piece tokens must be non-empty compact indices in [0, {n})")
            context = _context(forest, tokens)
            combined = np.concatenate((context, tokens))
            num_context = int(context.size)
            # The parent of a combined token is combined (or -1): its row among the sorted combined.
            order = np.argsort(combined, kind="stable")
            parent = forest.prev[combined]
            prev = np.where(parent >= 0, order[np.searchsorted(combined[order], np.maximum(parent, 0))], -1)
        as_t = lambda a: torch.as_tensor(a, dtype=torch.long, device=device)
        return cls(
            position=as_t(forest.position[combined]),
            prev=as_t(prev),
            global_index=as_t(combined),
            global_end=as_t(forest.subtree_end[combined]),
            num_context=num_context,
        )

    @property
    def num_tokens(self) -> int:
        """N, the piece's own tokens (context excluded)."""
        return self.position.numel() - self.num_context

    @property
    def device(self) -> torch.device:
        return self.position.device

    def cached(self, table: Table) -> Any:
        """The ``table`` of this batch, built once (``table.build(self)``) on first use; on a batch
        whose tables were built ahead (``built_ahead``) a table it lacks is an error."""
        if table not in self._cache:
            if self.built_ahead:
                raise MissingTable(table)
            self._cache[table] = table.build(self)
        return self._cache[table]

    @property
    def tables(self) -> frozenset[Table]:
        """The tables built so far (what the layers that ran read, or what was built ahead)."""
        return frozenset(self._cache)

    def with_state_out(self, state_out: Mapping[int, np.ndarray]) -> TreeBatch:
        """The same tokens returning the states after ``state_out``: the tables built so far, but
        for those that depend on it (``Table.state_dependent``)."""
        state_out = {int(c): np.asarray(t, dtype=np.int64) for c, t in state_out.items()}
        cache = {table: value for table, value in self._cache.items() if not table.state_dependent}
        return dataclasses.replace(self, state_out=state_out, handoff=None, _cache=cache)

    def with_handoff(self, handoff: Any) -> TreeBatch:
        """A view for one run of the engine: the same tables, this ``handoff``."""
        return dataclasses.replace(self, handoff=handoff)

    def to(self, device: torch.device | str) -> TreeBatch:
        """The batch and its tables on ``device`` (fields named ``*_cpu`` and numpy arrays stay)."""
        device = torch.device(device)
        if device == self.device:  # built where it runs (a CPU model): nothing to move
            return dataclasses.replace(self, handoff=None, _cache=dict(self._cache))
        memo: dict[int, Any] = {}
        move = lambda x: _to_device(x, device, memo)
        fields = {f: move(getattr(self, f)) for f in ("position", "prev", "global_index", "global_end")}
        cache = {key: move(value) for key, value in self._cache.items()}
        return dataclasses.replace(self, **fields, handoff=None, _cache=cache)


def _context(forest: RolloutForest, tokens: np.ndarray) -> np.ndarray:
    """The ancestors of the piece ``tokens`` (sorted) outside it, sorted (``runs.context_runs``:
    root paths as runs, each ancestor node climbed once). Never touches the rest of the forest, so
    a rank's units cost their own size, not the forest's."""
    return context_runs(forest, Runs.of_tokens(tokens)).tokens()


def _to_device(x: Any, device: torch.device, memo: dict[int, Any]) -> Any:
    """``x`` with every tensor it holds (dataclass fields, tuples, lists, dicts) on ``device``;
    an object reached twice is moved once."""
    if id(x) in memo:
        return memo[id(x)]
    if isinstance(x, torch.Tensor):
        out = x.to(device)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        changes = {
            f.name: _to_device(getattr(x, f.name), device, memo)
            for f in dataclasses.fields(x)
            if f.init and not f.name.endswith("_cpu")
        }
        out = dataclasses.replace(x, **changes)
    elif isinstance(x, (list, tuple)):
        items = [_to_device(v, device, memo) for v in x]
        out = type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    elif isinstance(x, dict):
        out = {k: _to_device(v, device, memo) for k, v in x.items()}
    else:
        out = x
    memo[id(x)] = out
    return out
