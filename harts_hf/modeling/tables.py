"""One patched-model call over a compiled unit, and the tree tables a model's layers read.

:func:`model_tables` finds, once per model, backend choice and device, which tables the model's
tree layers build (the probe: one no-grad call over a 3-token tree, recording every
:meth:`TreeBatch.cached` builder); ``harts_hf.schedule`` then builds exactly those for every unit
before the model runs, so the layers only read them.
"""

from __future__ import annotations

import weakref

import torch

from ..forest import RolloutForest
from ..ops.backends import requested
from ..ops.tree_batch import TreeBatch
from ..schedule import Builders
from . import _compat
from .adapters import FamilyAdapter
from .kinds import TREE_KWARG

__all__ = ["model_tables", "run_base"]

_PROBE = ((0, 1, 2), (0, 1, 3))  # a root token, then a branch: every table kind gets built
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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


def model_tables(hf, adapter: FamilyAdapter) -> Builders:
    """The table builders ``hf``'s tree layers use (module docstring)."""
    weight = hf.get_output_embeddings().weight
    key = (requested(), weight.device, weight.dtype)
    per_model = _TABLES.setdefault(hf, {})
    if key not in per_model:
        forest = RolloutForest.from_sequences(_PROBE)
        probe = TreeBatch.from_forest(forest, device=weight.device)
        devices = [weight.device] if weight.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            run_base(hf, adapter, torch.as_tensor(forest.tokens, device=weight.device), probe)
        per_model[key] = probe.builders
    return per_model[key]
