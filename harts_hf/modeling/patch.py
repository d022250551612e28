"""The one patching mechanism every family adapter shares.

``patch_model`` (in place, idempotent, reversible with ``unpatch_model``):
1. picks the family's declaration the model's modeling module matches (one per transformers
   layout, ``FamilyAdapter.layout``), refusing drifted internals;
2. replaces each declared module-level kernel function by a wrapper that calls the original when
   the call carries no ``harts_tree`` and the kernel kind's tree implementation otherwise, and
   each declared mixer's ``forward`` by one that names its tree calls after the mixer (a replaced
   decoder layer ``forward`` stays inside transformers' gradient checkpointing wrapper);
3. switches the model to the tree-aware attention name registered for its original attention.

Kernel wrappers are process-wide but transparent: a call without a tree reaches the original
function with the original arguments, so unpatched instances of the family behave as before.
The tree itself only ever travels as a forward kwarg (gradient checkpointing recomputes layers
outside any context manager, so nothing is held in globals or context variables).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType

from torch import nn
from transformers import AutoModelForCausalLM

from ..ops.tree_batch import MissingTable
from . import _compat
from .adapters import FamilyAdapter, adapter_for, supported_families
from .attention import original_attention_name, tree_attention_name
from .calls import called_by
from .errors import UnsupportedModelError
from .kinds import KINDS, TREE_KWARG, KernelKind
from .registry import KERNELS, LAYOUTS, MODELS, ORIGINAL_ATTENTION, is_patched, kernel_key
from .verify import verify as run_verify

__all__ = ["from_pretrained", "patch_model", "unpatch_model"]


def _wrap_kernel(original: Callable, kind: KernelKind) -> Callable:
    """``original`` (a function, or the module transformers 5.25 makes of it) unchanged on calls
    without a tree; its arguments, bound by name, to the kind's tree call on calls with one."""
    function = _compat.kernel_function(original)
    signature = inspect.signature(function)

    @functools.wraps(function)
    def kernel(*args, **kwargs):
        batch = kwargs.get(TREE_KWARG)
        if batch is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        layer = bound.arguments.get("self", bound.arguments.get("module"))
        if "self" in bound.arguments:  # a re-stated forward: its calls are named after its module
            batch = called_by(batch, layer)
        try:
            return kind.tree_call(batch, bound.arguments)
        except MissingTable as err:
            if err.call is None:  # not read by a call inside this one
                err.call = f"{function.__qualname__} (layer kind {kind.name!r})"
            if err.layer is None and layer is not None:
                err.layer = _compat.layer_name(layer)
            raise

    return kernel


def _wrap_mixer(forward: Callable) -> Callable:
    """A mixer's own ``forward``, its tree calls named after the mixer (``calls.called_by``)."""

    @functools.wraps(forward)
    def mixer_forward(self, *args, **kwargs):
        batch = kwargs.get(TREE_KWARG)
        if batch is None:
            return forward(self, *args, **kwargs)
        kwargs[TREE_KWARG] = called_by(batch, self)
        try:
            return forward(self, *args, **kwargs)
        except MissingTable as err:  # read by one of its kernel calls, which do not see the mixer
            if err.layer is None:
                err.layer = _compat.layer_name(self)
            raise

    return mixer_forward


def _patch_module(module: ModuleType, adapter: FamilyAdapter) -> None:
    for owner, name, kind in adapter.targets(module):
        current, key = vars(owner)[name], kernel_key(owner, name)
        if key in KERNELS and current is KERNELS[key][1]:
            continue
        wrap = _wrap_mixer if kind is None else functools.partial(_wrap_kernel, kind=KINDS[kind])
        KERNELS[key] = (current, _compat.keep_checkpointing(owner, current, wrap))
        setattr(owner, name, KERNELS[key][1])


def _unpatch_module(module: ModuleType, adapter: FamilyAdapter) -> None:
    for owner, name, _ in adapter.targets(module):
        original, wrapper = KERNELS.pop(kernel_key(owner, name), (None, None))
        if original is not None and vars(owner)[name] is wrapper:
            setattr(owner, name, original)


def patch_model(model: nn.Module, *, verify: bool = False, **verify_kwargs) -> nn.Module:
    """Make ``model`` (a transformers causal LM, or a PEFT model around one) accept rollout trees.

    In place and idempotent (a second call re-checks and re-applies what was undone); returns
    ``model``. Calls without ``harts_tree`` behave exactly as before. With ``verify=True`` a probe
    forest runs both ways first (``harts_hf.verify``) and a model that fails it is unpatched and
    refused.

    Raises:
        UnsupportedModelError: the family is not supported, or its modeling code drifted.
    """
    hf = _compat.hf_model(model)
    _compat.check_version()
    family = adapter_for(hf)
    module = _compat.modeling_module(hf)
    try:
        adapter = family.layout(module)
        adapter.check(hf)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{err}; supported families: {supported_families()}") from None
    current = _compat.attention_name(hf)
    name = tree_attention_name(current)
    _patch_module(module, adapter)
    LAYOUTS[module.__name__] = adapter
    if current != name or not is_patched(hf):
        setattr(hf, ORIGINAL_ATTENTION, original_attention_name(current))
    if current != name:
        _compat.set_attention(hf, name)
    MODELS.add(hf)
    if verify:
        report = run_verify(model, **verify_kwargs)
        if not report.ok:
            unpatch_model(model)
            raise UnsupportedModelError(f"{type(hf).__name__} failed harts-hf verification: {report}")
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model`: the model's original attention, and the family's original kernel
    functions once no other patched model of that family is alive."""
    hf = _compat.hf_model(model)
    if not is_patched(hf):
        return model
    _compat.set_attention(hf, getattr(hf, ORIGINAL_ATTENTION))
    delattr(hf, ORIGINAL_ATTENTION)
    MODELS.discard(hf)
    module = _compat.modeling_module(hf)
    if not any(_compat.modeling_module(other) is module for other in MODELS):
        _unpatch_module(module, LAYOUTS.pop(module.__name__))
    return model


def from_pretrained(name: str, *, verify: bool = False, **kwargs) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(name, **kwargs)``, patched for trees."""
    return patch_model(AutoModelForCausalLM.from_pretrained(name, **kwargs), verify=verify)
