"""One patched-model call over a compiled unit, and the tree tables a model's layers read.

:func:`model_tables` finds the tables a model's tree layers read without running it: it walks the
modules its family's adapter declares (attention classes, mixers calling kernel functions, mixers
whose forward is replaced), takes each module's tree-op calls from its layer kind
(``KernelKind.calls``, ``kinds.attention_calls``) and, for each call, the tables of the backend
the registry picks for it (``harts_hf.ops.backends.tables_of``: the choice the op makes when it
runs). ``harts_hf.schedule`` builds exactly those for every unit before the model runs, so the
layers only read them; a layer that reads another fails there, naming itself (``patch.py``).
"""

from __future__ import annotations

import torch

from ..ops.backends import Call, tables_of
from ..ops.tree_batch import TreeBatch
from ..schedule import Tables
from . import _compat
from .adapters import FamilyAdapter
from .kinds import KINDS, TREE_KWARG, attention_calls

__all__ = ["layer_calls", "model_tables", "run_base"]


def run_base(hf, adapter: FamilyAdapter, input_ids: torch.Tensor, batch: TreeBatch, **extra):
    """The base model over one unit's own tokens (``input_ids`` [N], DFS order, on the model's
    device) described by ``batch``: one packed row, the tree as the ``harts_tree`` kwarg, no mask,
    no cache."""
    masks = (
        {key: None for key in adapter.mask_keys}
        if adapter.mask_keys is not None
        else _compat.placeholder_mask(input_ids.device)
    )
    return hf.base_model(
        input_ids=input_ids[None],  # [1, N]
        position_ids=batch.position[batch.num_context :][None],  # [1, N]
        attention_mask=masks,
        use_cache=False,
        **{TREE_KWARG: batch},
        **extra,
    )


def layer_calls(hf, adapter: FamilyAdapter, device: torch.device) -> set[Call]:
    """Every tree-op call ``hf``'s layers make on ``device`` (module docstring)."""
    module = _compat.modeling_module(hf)
    kernels = [
        (KINDS[kind], _compat.defaults(vars(module)[name])) for name, kind in adapter.kernels.items()
    ]  # each declared mixer calls all of them
    calls: set[Call] = set()
    for layer in hf.modules():
        name = type(layer).__name__
        if name in adapter.attention:
            calls.update(attention_calls(layer, device))
        if name in adapter.mixers:
            for kind, defaults in kernels:
                calls.update(kind.calls(layer, defaults, device))
        if name in adapter.mixer_forwards:
            calls.update(KINDS[adapter.mixer_forwards[name]].calls(layer, {}, device))
    return calls


def model_tables(hf, adapter: FamilyAdapter) -> Tables:
    """The tables ``hf``'s tree layers read (module docstring)."""
    device = hf.get_output_embeddings().weight.device
    return frozenset(table for call in layer_calls(hf, adapter, device) for table in tables_of(call))
