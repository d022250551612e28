"""Which models and kernel functions harts-hf has patched: the state ``patch.py`` writes and every
tree entry point (``tree_forward``, ``verify``, the engine) checks before it runs a tree.

Kept apart from ``patch.py`` so that the tree path reads it without importing the patcher (which
runs ``verify``, which runs the tree path).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import ModuleType

from torch import nn
from transformers import PreTrainedModel

from . import _compat
from .adapters import FamilyAdapter
from .attention import PREFIX
from .errors import UnsupportedModelError

__all__ = [
    "KERNELS",
    "LAYOUTS",
    "MODELS",
    "ORIGINAL_ATTENTION",
    "is_patched",
    "kernel_key",
    "kernels_wrapped",
    "patched_adapter",
]

# The model remembers its original attention implementation in this attribute (deep copies,
# e.g. TRL's reference model, stay patched); the registry only decides when a module's kernels
# may be restored.
ORIGINAL_ATTENTION = "_harts_original_attention"

# (owner's qualified name, attribute) -> (original function, its wrapper); owners are modeling
# modules (kernel functions) or mixer classes (forward methods)
KERNELS: dict[tuple[str, str], tuple[Callable, Callable]] = {}
MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# modeling module name -> the family declaration its kernels were wrapped by (the layout it matched)
LAYOUTS: dict[str, FamilyAdapter] = {}


def kernel_key(owner: ModuleType | type, name: str) -> tuple[str, str]:
    qualified = f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__
    return qualified, name


def kernels_wrapped(module: ModuleType, adapter: FamilyAdapter) -> bool:
    return all(
        kernel_key(owner, name) in KERNELS and vars(owner)[name] is KERNELS[kernel_key(owner, name)][1]
        for owner, name, _ in adapter.targets(module)
    )


def is_patched(model: nn.Module) -> bool:
    return ORIGINAL_ATTENTION in vars(_compat.hf_model(model))


def patched_adapter(model: nn.Module) -> tuple[PreTrainedModel, FamilyAdapter]:
    """The transformers model inside ``model`` and its adapter; refuses a model whose patch is
    not (or no longer) in place, because a tree would then reach unpatched kernels silently."""
    hf = _compat.hf_model(model)
    if not is_patched(hf):
        raise UnsupportedModelError(f"{type(hf).__name__} is not patched: call harts_hf.patch_model(model) first")
    module = _compat.modeling_module(hf)
    adapter = LAYOUTS.get(module.__name__)
    if adapter is None or not kernels_wrapped(module, adapter):
        raise UnsupportedModelError(
            f"the kernel functions of {module.__name__} are no longer harts-hf's (unpatched or replaced); "
            "call harts_hf.patch_model(model) again"
        )
    if not _compat.attention_name(hf).startswith(PREFIX):
        raise UnsupportedModelError(
            f"{type(hf).__name__} switched its attention to {_compat.attention_name(hf)!r} after patching; "
            "call harts_hf.patch_model(model) again"
        )
    return hf, adapter
