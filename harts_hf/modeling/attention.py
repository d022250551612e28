"""Tree attention through transformers' ``AttentionInterface`` (no monkeypatching).

For each original implementation ("sdpa", "eager") one name is registered ("harts_sdpa",
"harts_eager") together with the original's mask builder, so a patched model called without a
tree builds the same masks and runs the same attention as before. A call that carries
``harts_tree`` goes to :func:`harts_hf.ops.attention.tree_attention` instead: ancestor-or-self
attention over the compact tokens, with the layer's scaling, softcap, sliding window and sinks.

Legend: N compact tokens, Hq / Hkv query / key-value heads, D qk head dim, Dv value head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..ops.attention import tree_attention
from ..ops.tree_batch import MissingTable, TreeBatch
from . import _compat
from .calls import called_by, context_of
from .errors import UnsupportedModelError
from .kinds import TREE_KWARG

__all__ = ["PREFIX", "original_attention_name", "tree_attention_name"]

PREFIX = "harts_"
ORIGINALS = ("sdpa", "eager")
_REGISTERED: set[str] = set()


def _tree_call(query, key, value, batch: TreeBatch, kwargs: dict) -> tuple[torch.Tensor, None]:
    if query.shape[0] != 1:
        raise ValueError(f"harts-hf tree calls run one packed row, got batch size {query.shape[0]}")
    scaling = kwargs.get("scaling")
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [N, Hkv, D], [N, Hkv, Dv]
    context = context_of(batch, "attention", {"k": k, "v": v})
    o = tree_attention(
        query[0].transpose(0, 1),  # [N, Hq, D]
        k,
        v,
        batch,
        context_kv=None if context is None else (context["k"], context["v"]),
        scale=query.shape[-1] ** -0.5 if scaling is None else scaling,
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
        dropout=kwargs.get("dropout", 0.0),
        sliding_window=kwargs.get("sliding_window"),
    )  # [N, Hq, Dv]
    return o.unsqueeze(0), None  # [1, N, Hq, Dv]: the layout attention functions return


def _dispatcher(original: str) -> Callable:
    registered = _compat.attention_function(original)

    def attention(module: nn.Module, query, key, value, attention_mask, *args, **kwargs):
        batch = kwargs.get(TREE_KWARG)
        if batch is None:
            fn = registered if registered is not None else _compat.module_eager_attention(module)
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        if args:
            raise TypeError("harts-hf tree attention expects keyword arguments after attention_mask")
        try:
            return _tree_call(query, key, value, called_by(batch, module), kwargs)
        except MissingTable as err:
            err.call, err.layer = "tree attention", _compat.layer_name(module)
            raise

    attention.__name__ = f"{PREFIX}{original}_attention"
    return attention


def tree_attention_name(original: str) -> str:
    """Register (once) and return the tree-aware implementation name that wraps ``original``."""
    if original.startswith(PREFIX):
        return original
    if original not in ORIGINALS:
        raise UnsupportedModelError(
            f"attention implementation {original!r} cannot take trees; load the model with "
            f"attn_implementation in {list(ORIGINALS)} (tree calls never use it, calls without a tree do)"
        )
    name = PREFIX + original
    if name not in _REGISTERED:
        _compat.register_attention(name, _dispatcher(original), _compat.mask_function(original))
        _REGISTERED.add(name)
    return name


def original_attention_name(name: str) -> str:
    return name.removeprefix(PREFIX)
