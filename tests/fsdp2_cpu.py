"""TRL's trainers under FSDP2 on CPU (gloo), for tests that launch them with ``torchrun``.

accelerate's FSDP plugin does not shard on CPU, so :func:`fsdp2_trainers` shards the models the
way it does on GPU and lets the trainers run on them: ``fully_shard`` on every decoder layer and on
the model (:func:`shard`), done where accelerate would do it (``Accelerator.prepare``: the policy,
the optimizer moved onto its sharded parameters; ``Accelerator.prepare_model``: DPO's reference
model, which TRL shards too under FSDP2), and ``Accelerator.no_sync`` taking accelerate's FSDP2
branch (``set_requires_gradient_sync``). ``unwrap_model`` returns an FSDP2 module itself (it shards
in place: no wrapper) and ``clip_grad_norm_`` reaches ``torch.nn.utils.clip_grad_norm_``, which
takes the sharded gradients (``trainer_args.flat_parameters`` gathers the sharded parameters).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from accelerate import Accelerator
from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = ["fsdp2_trainers", "hook_gathers", "shard", "without_gradient_sync"]


def shard(model: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    """Shard ``model`` in place (each decoder layer, then the model); {id of an old parameter: its
    sharded replacement} (empty if it was sharded already)."""
    if isinstance(model, FSDPModule):
        return {}
    before = dict(model.named_parameters())
    for layer in model.base_model.layers:
        fully_shard(layer)
    fully_shard(model)
    return {id(before[name]): p for name, p in model.named_parameters()}


@contextlib.contextmanager
def without_gradient_sync(model: FSDPModule) -> Iterator[None]:
    """accelerate's FSDP2 ``no_sync``: no reduce-scatter of gradients within it."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@contextlib.contextmanager
def hook_gathers() -> Iterator[list[int]]:
    """Within it, ``[n]``: the parameter gathers FSDP2 starts from a layer's own forward or backward
    hook (a collective inside the call), not those made before it."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    count, unshard = [0], FSDPParamGroup.unshard

    def counted(self, *args, **kwargs):
        in_hook = self._training_state in (TrainingState.FORWARD, TrainingState.PRE_BACKWARD)
        count[0] += in_hook and not self.is_unsharded and self._all_gather_result is None
        return unshard(self, *args, **kwargs)

    FSDPParamGroup.unshard = counted
    try:
        yield count
    finally:
        FSDPParamGroup.unshard = unshard


@contextlib.contextmanager
def fsdp2_trainers(monkeypatch):
    """Within it, every trainer's models are sharded with FSDP2 (module docstring)."""
    prepare = Accelerator.prepare

    def sharded_prepare(self, *args, **kwargs):
        moved = {}
        for obj in args:
            if isinstance(obj, torch.nn.Module):
                moved |= shard(obj)
        for obj in args:
            if isinstance(obj, torch.optim.Optimizer):
                for group in obj.param_groups:
                    group["params"] = [moved.get(id(p), p) for p in group["params"]]
        return prepare(self, *args, **kwargs)

    def sharded_prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if not isinstance(model, FSDPModule):
            shard(model)
        return model

    def no_sync(self, model):
        return without_gradient_sync(model)

    monkeypatch.setattr(Accelerator, "prepare", sharded_prepare)
    monkeypatch.setattr(Accelerator, "prepare_model", sharded_prepare_model)
    monkeypatch.setattr(Accelerator, "no_sync", no_sync)
    yield
