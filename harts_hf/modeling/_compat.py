"""Every shim that depends on transformers / PEFT internals, in one place.

Checked against transformers 5.23 and 5.25 and PEFT 0.21. Each function names the internal it
relies on; when a release moves one, this is the only file to touch (adapters additionally refuse
a family whose modeling module matches none of their per-release layouts, see ``adapters.py``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import transformers
from peft import PeftModel
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = [
    "CACHE_PARAMETERS",
    "CHECKED_TRANSFORMERS",
    "PRIVATE_NAMES",
    "accelerate_hooks",
    "attention_function",
    "attention_name",
    "check_version",
    "decoder_layer_modules",
    "family_name",
    "forward_source",
    "hf_model",
    "is_quantized",
    "keep_checkpointing",
    "kernel_function",
    "load_balancing_loss",
    "mask_function",
    "model_class",
    "modeling_module",
    "module_eager_attention",
    "parameters",
    "placeholder_mask",
    "register_attention",
    "set_attention_name",
    "set_attention",
    "source",
    "version_advice",
]

logger = logging.getLogger(__name__)

CHECKED_TRANSFORMERS = ("5.23", "5.25")
"""The transformers releases whose modeling modules the adapters declare (setup.cfg's range)."""

CACHE_PARAMETERS = ("cache", "cache_params", "past_key_values")
"""The name a layer's cache parameter goes by: transformers 5.25 renamed the mixers' ``cache_params``
and ``past_key_values`` to ``cache`` (tree calls run without one; kinds only check it is None)."""

PRIVATE_NAMES = (
    "transformers.integrations.accelerate.force_accelerate_hooks",
    "transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS",
    "transformers.masking_utils.AttentionMaskInterface",
    "transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS",
    "transformers.modeling_layers.GradientCheckpointingLayer",
    "transformers.PretrainedConfig._attn_implementation",
)
"""The transformers internals these shims read (a test resolves each); a family's modeling module
and mixer sources are checked per family by its adapter (``adapters.py``)."""


def accelerate_hooks(children: list[str]) -> Callable[[Callable], Callable]:
    """transformers' ``force_accelerate_hooks`` (``transformers.integrations.accelerate``): a re-stated
    forward that reads these children's weights directly fires their accelerate (offload) hooks first,
    as the stock forward's decorator does."""
    from transformers.integrations.accelerate import force_accelerate_hooks

    return force_accelerate_hooks(children)


def _checked() -> bool:
    return transformers.__version__.startswith(tuple(release + "." for release in CHECKED_TRANSFORMERS))


@functools.cache
def check_version() -> None:
    """Warn once when transformers is not a release these shims were checked against."""
    if not _checked():
        logger.warning(
            "harts-hf: modeling patches were checked against transformers %s, found %s; "
            "run harts_hf.verify(model) before training",
            " and ".join(f"{release}.x" for release in CHECKED_TRANSFORMERS),
            transformers.__version__,
        )


def hf_model(model: nn.Module) -> PreTrainedModel:
    """The transformers model inside ``model`` (a PEFT wrapper keeps it at ``get_base_model()``)."""
    if isinstance(model, PreTrainedModel):
        return model
    if isinstance(model, PeftModel):
        return model.get_base_model()
    raise TypeError(f"expected a transformers PreTrainedModel (or a PEFT model around one), got {type(model).__name__}")


def model_class(model: PreTrainedModel) -> type:
    """The transformers class of ``model``: FSDP2's ``fully_shard`` swaps an instance's class for a
    generated ``FSDP<Name>(FSDPModule, <Name>)`` defined in torch."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def family_name(model: PreTrainedModel) -> str:
    """``qwen3_5`` for a class defined in ``transformers.models.qwen3_5.modeling_qwen3_5``."""
    module = model_class(model).__module__
    prefix, _, leaf = module.rpartition(".modeling_")
    return leaf if prefix.startswith("transformers.models.") else module


def kernel_function(fn: Callable) -> Callable:
    """The Python function behind a modeling module's kernel hook. transformers 5.25 (with
    ``kernels`` installed) turns a hub-replaceable function into an ``nn.Module`` instance whose
    ``forward`` closes over it as ``func``; 5.23 keeps the function (its decorators set
    ``__wrapped__``). Read so that a newer release is refused with its drift, not a TypeError."""
    if isinstance(fn, nn.Module):
        inner = inspect.getclosurevars(type(fn).forward).nonlocals.get("func")
        if callable(inner):
            return inner
    return fn


def parameters(fn: Callable) -> tuple[str, ...]:
    """Parameter names of a kernel function; hub-kernel decorators keep the torch function at
    ``__wrapped__``, which ``inspect.signature`` follows."""
    return tuple(inspect.signature(kernel_function(fn)).parameters)


def layer_name(module: nn.Module) -> str:
    """``module``'s class, and its decoder layer where it knows it (for messages)."""
    index = getattr(module, "layer_idx", None)
    return type(module).__name__ + ("" if index is None else f" (layer {index})")


def defaults(fn: Callable) -> dict[str, Any]:
    """The parameter defaults of a kernel function (``parameters``' signature)."""
    params = inspect.signature(kernel_function(fn)).parameters
    return {name: p.default for name, p in params.items() if p.default is not p.empty}


def version_advice() -> str:
    """What to do when a family's internals moved under another transformers release."""
    if _checked():
        return ""
    return (
        f"; found transformers {transformers.__version__}: install a release harts-hf supports, "
        f"pip install 'transformers~={CHECKED_TRANSFORMERS[-1]}.0'"
    )


def modeling_module(model: PreTrainedModel) -> ModuleType:
    """The generated ``modeling_<family>.py`` module the model class lives in."""
    return sys.modules[model_class(model).__module__]


def forward_source(cls: type) -> str:
    """Source of ``cls.forward``: adapters check that the mixer still calls the functions they wrap."""
    return source(cls.forward)


@functools.cache
def source(fn: Callable) -> str:
    """Source of a (possibly wrapped) function: the original's, once harts-hf wrapped it."""
    return inspect.getsource(inspect.unwrap(kernel_function(fn)))


def attention_function(name: str) -> Callable | None:
    """The registered attention function ``name`` (None for "eager": each module has its own)."""
    if name == "eager":
        return None
    return ALL_ATTENTION_FUNCTIONS[name]


def mask_function(name: str) -> Callable:
    """The mask builder transformers uses for attention implementation ``name``."""
    return ALL_MASK_ATTENTION_FUNCTIONS[name]


def register_attention(name: str, attention: Callable, mask: Callable) -> None:
    """Register ``name`` globally for attention and for mask creation (masking_utils only builds
    masks for names its ``AttentionMaskInterface`` knows)."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)


def module_eager_attention(module: nn.Module) -> Callable:
    """The ``eager_attention_forward`` of the modeling module that defines ``module``'s class:
    transformers resolves "eager" to this per-family function, not to a registered one."""
    return sys.modules[type(module).__module__].eager_attention_forward


def set_attention(model: PreTrainedModel, name: str) -> None:
    """Switch the model (and its sub-models) to attention implementation ``name`` at once."""
    model.set_attn_implementation(name)


def attention_name(model: PreTrainedModel) -> str:
    return model.config._attn_implementation


def set_attention_name(config: transformers.PretrainedConfig, name: str) -> None:
    """Set attention implementation ``name`` on a config before its model is built."""
    config._attn_implementation = name


def is_quantized(config: transformers.PretrainedConfig) -> bool:
    """transformers' own test in the mixers (``hasattr(config, "_is_quantized")``): a quantizer loaded the weights."""
    return hasattr(config, "_is_quantized")


def keep_checkpointing(owner: ModuleType | type, fn: Callable, replace: Callable[[Callable], Callable]) -> Callable:
    """``replace(fn)`` as ``owner``'s attribute, keeping a decoder layer's gradient checkpointing.

    ``GradientCheckpointingLayer.__init_subclass__`` wraps every decoder layer's ``forward`` in one that
    checkpoints only while it is the class's own ``forward``: replaced whole, the layer would stop
    checkpointing. So the layer's own forward (the wrapper's ``__wrapped__``) is replaced, and the same
    hook, run on a throwaway subclass, puts a new checkpointing wrapper around it.
    """
    if not (isinstance(owner, type) and issubclass(owner, GradientCheckpointingLayer)):
        return replace(fn)
    inner = replace(fn.__wrapped__)
    return vars(type(owner.__name__, (GradientCheckpointingLayer,), {"forward": inner}))["forward"]


def decoder_layer_modules(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer of ``model`` in order: transformers' decoder layers subclass
    ``GradientCheckpointingLayer`` (the unit its gradient checkpointing wraps)."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def placeholder_mask(device: torch.device) -> torch.Tensor:
    """A 4-D empty tensor: ``create_causal_mask`` returns a 4-D mask unchanged and the recurrent
    mask builder ignores it, so tree calls build no O(N^2) mask (tree attention ignores it)."""
    return torch.zeros(1, 1, 0, 0, device=device)


def load_balancing_loss(model: PreTrainedModel) -> Callable:
    """The family's ``load_balancing_loss_func`` (its CausalLM calls it with a [B, L] row mask)."""
    return modeling_module(model).load_balancing_loss_func
