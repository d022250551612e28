"""The two places where HARTSGRPOTrainer touches TRL internals (checked against trl 1.16.0).

1. The tree pass runs as the model's own forward, the way TRL installs its fused LM head
   (``trl.trainer.utils.add_fused_lm_head`` replaces ``model.forward`` on the instance):
   ``model(harts_forest=forest, harts_options={...})`` returns a :class:`~harts_hf.TreeOutput`.
   Called through whatever wraps the model (DDP, FSDP2, DeepSpeed, PEFT), the wrapper sees an
   ordinary forward, so its gradient synchronisation and parameter gathering work unchanged.
2. ``GRPOTrainer._prepare_inputs`` shuffles the generation batch with the module global
   ``trl.trainer.grpo_trainer.shuffle_sequence_dict`` before ``split_tensor_dict`` cuts it into
   ``steps_per_generation`` microbatches. :func:`replace_row_shuffle` swaps that global for the
   duration of one call, so the rows can be arranged by prefix instead (``arrange.py``).
3. ``GRPOTrainer._compute_loss`` normalises some terms by a microbatch's own token count or
   statistics, so they change when rows are regrouped (:func:`grouping_dependent_options`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import trl
from trl.trainer import grpo_trainer

from ..modeling import tree_forward

__all__ = [
    "CHECKED_TRL",
    "FOREST_KWARG",
    "add_tree_forward",
    "entropy_bonus_enabled",
    "grouping_dependent_options",
    "replace_row_shuffle",
]

CHECKED_TRL = "1.16.0"
FOREST_KWARG = "harts_forest"

if not trl.__version__.startswith("1.16."):
    raise ImportError(f"harts_hf.trainers overrides private seams of trl {CHECKED_TRL}; found trl {trl.__version__}")


def add_tree_forward(model: torch.nn.Module) -> None:
    """Let ``model(harts_forest=forest, harts_options=kwargs)`` run ``tree_forward(model, forest, **kwargs)``;
    any other call goes to the forward the model had (TRL's fused head, generation)."""
    previous = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, harts_forest=None, harts_options=None, **kwargs):
        if harts_forest is None:
            return previous(*args, **kwargs)
        return tree_forward(self, harts_forest, **(harts_options or {}))  # PEFT's None input kwargs are dropped

    model.forward = types.MethodType(forward, model)


@contextmanager
def replace_row_shuffle(arrange: Callable[[dict], dict]) -> Iterator[None]:
    """Within the block, TRL's generation-batch shuffle is ``arrange``."""
    original = grpo_trainer.shuffle_sequence_dict
    grpo_trainer.shuffle_sequence_dict = arrange
    try:
        yield
    finally:
        grpo_trainer.shuffle_sequence_dict = original


def entropy_bonus_enabled(trainer) -> bool:
    """Whether the loss has TRL's entropy bonus (a static ``entropy_coef`` or adaptive control; TRL
    fixes it at init, while ``entropy_coef`` itself moves under adaptive control)."""
    return trainer._entropy_bonus_enabled


def grouping_dependent_options(trainer) -> list[str]:
    """The settings of a GRPOTrainer whose loss depends on which rows share a microbatch (trl 1.16
    ``_compute_loss``): bnpo divides by the microbatch's token count, the entropy bonus is a
    microbatch mean, ``top_entropy_quantile`` takes its threshold over the microbatch, the MoE aux
    loss is the microbatch's. Every other loss type normalises by a global count or by the row
    count of equally sized microbatches."""
    found = []
    if trainer.loss_type == "bnpo":
        found.append("loss_type='bnpo'")
    if entropy_bonus_enabled(trainer):
        found.append("the entropy bonus (entropy_coef / use_adaptive_entropy)")
    if trainer.top_entropy_quantile < 1.0:
        found.append(f"top_entropy_quantile={trainer.top_entropy_quantile}")
    if trainer.aux_loss_enabled:
        found.append("the router aux loss (router_aux_loss_coef)")
    return found
