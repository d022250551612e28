"""The places where the harts-hf trainers touch TRL internals (checked against trl 1.16.0).

1. The tree pass runs as the model's own forward, the way TRL installs its fused LM head
   (``trl.trainer.utils.add_fused_lm_head`` replaces ``model.forward`` on the instance):
   ``model(harts_forest=forest, harts_options={...})`` returns a :class:`~harts_hf.TreeOutput`,
   and ``model(harts_call=run)`` runs one of the engine's unit calls. Called through whatever wraps
   the model (DDP, FSDP2, PEFT), the wrapper sees an ordinary forward, so its gradient
   synchronisation and parameter gathering work unchanged.
2. ``GRPOTrainer._prepare_inputs`` (and ``RLOOTrainer``'s, the same code) keeps the generation
   batch's ``steps_per_generation`` microbatches in ``_buffered_inputs`` and hands out
   ``_buffered_inputs[_step % steps_per_generation]``: a HARTS step reads the rest of its
   optimizer step's microbatches there (``step.py``).
3. ``GRPOTrainer.training_step`` (and ``RLOOTrainer``'s) times each microbatch into ``step_time``
   before the HARTS step's backward runs, which :func:`add_step_time` adds.
4. ``GRPOTrainer._compute_loss`` backpropagates through the entropies for the entropy bonus
   (:func:`entropy_bonus_enabled`) and through the router logits for the aux loss
   (``aux_loss_enabled``; the HARTS step returns each microbatch's, ``HARTSStep.aux_loss``);
   ``RLOOTrainer._compute_loss`` reads the same seam (no entropy bonus).
5. TRL's trainers keep their metric lists in ``_metrics`` and the router aux-loss switch in
   ``aux_loss_enabled`` (:func:`metrics`, :func:`router_loss_enabled`).
6. ``SFTTrainer.compute_loss`` reads ``model(**inputs, fused_lm_head=True)``'s per-token fields
   (``add_fused_lm_head``'s ``FusedCausalLMOutput``): :func:`add_tree_fused_head` answers that call.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import trl
from trl.trainer.utils import FusedCausalLMOutput  # the fused head's output type (fused.py)

from ..modeling import tree_forward

__all__ = [
    "CHECKED_TRL",
    "TRAINER_ATTRIBUTES",
    "FOREST_KWARG",
    "FusedCausalLMOutput",
    "add_step_time",
    "add_tree_forward",
    "add_tree_fused_head",
    "buffered_block",
    "entropy_bonus_enabled",
    "metrics",
    "router_loss_enabled",
]

CHECKED_TRL = "1.16.0"
FOREST_KWARG = "harts_forest"

if not trl.__version__.startswith("1.16."):
    raise ImportError(f"harts_hf.trainers overrides private seams of trl {CHECKED_TRL}; found trl {trl.__version__}")

_ROLLOUT_STATE = ("_buffered_inputs", "_step", "_metrics", "aux_loss_enabled", "_current_train_step_time")
TRAINER_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "GRPOTrainer": (*_ROLLOUT_STATE, "_entropy_bonus_enabled"),
    "RLOOTrainer": _ROLLOUT_STATE,
    "SFTTrainer": ("_metrics", "aux_loss_enabled"),
    "DPOTrainer": ("_metrics", "aux_loss_enabled"),
}
"""The private state of TRL's trainers the HARTS trainers read (a test checks each trainer still
sets it), besides the seams above."""


def add_tree_forward(model: torch.nn.Module) -> None:
    """Let ``model(harts_forest=forest, harts_options=kwargs)`` run ``tree_forward(model, forest, **kwargs)``
    and ``model(harts_call=run)`` run ``run()`` (the engine's unit calls, seen by DDP / FSDP2 as the
    wrapped model's forward); any other call goes to the forward the model had (TRL's fused head,
    generation)."""
    previous = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, harts_forest=None, harts_options=None, harts_call=None, **kwargs):
        if harts_call is not None:
            return harts_call()
        if harts_forest is None:
            return previous(*args, **kwargs)
        return tree_forward(self, harts_forest, **(harts_options or {}))  # PEFT's None input kwargs are dropped

    model.forward = types.MethodType(forward, model)


def add_tree_fused_head(model: torch.nn.Module, fused: Callable[[torch.nn.Module, dict], Any]) -> None:
    """Let ``model(..., fused_lm_head=True)`` (TRL's fused head, which SFT, DPO and RLOO call for
    their per-token outputs) return ``fused(model, kwargs)`` where that is not None; any other call,
    and one ``fused`` declines, goes to the forward the model had."""
    previous = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, **kwargs):
        if fused_lm_head and not args and (out := fused(self, kwargs)) is not None:
            return out
        return previous(*args, fused_lm_head=fused_lm_head, **kwargs)

    model.forward = types.MethodType(forward, model)


def add_step_time(trainer, seconds: float) -> None:
    """Count ``seconds`` of work done after ``GRPOTrainer.training_step`` timed the microbatch (the
    HARTS step's backward) into TRL's ``step_time``: GRPO adds each microbatch's time to
    ``_current_train_step_time`` and, once ``_step`` reaches the end of an optimizer step, appends
    it to ``_metrics["train"]["step_time"]`` and resets it."""
    if trainer._step % trainer.current_gradient_accumulation_steps == 0:
        trainer._metrics["train"]["step_time"][-1] += seconds
    else:
        trainer._current_train_step_time += seconds


def buffered_block(trainer, inputs: dict, length: Callable[[int, int, int], int]) -> list[dict]:
    """The microbatches of ``inputs``' optimizer step that TRL's generation buffer holds from it on
    (``_buffered_inputs[_step % steps_per_generation]`` is ``inputs``; ``length(step, accumulation,
    steps_per_generation)`` of them), or ``[inputs]`` when TRL did not hand it out of the buffer."""
    spg, step, buffer = trainer.args.steps_per_generation, trainer._step, trainer._buffered_inputs
    k = step % spg
    if buffer is None or buffer[k] is not inputs:
        return [inputs]
    return buffer[k : k + length(step, trainer.current_gradient_accumulation_steps, spg)]


def metrics(trainer, mode: str = "train") -> dict[str, list[float]]:
    """TRL's per-mode metric lists (``_metrics[mode]``), averaged into each logged line."""
    return trainer._metrics[mode]


def router_loss_enabled(trainer) -> bool:
    """Whether TRL adds the MoE router's aux loss (``aux_loss_enabled``, set from the model config)."""
    return trainer.aux_loss_enabled


def entropy_bonus_enabled(trainer) -> bool:
    """Whether the loss has TRL's entropy bonus (a static ``entropy_coef`` or adaptive control; TRL
    fixes it at init, while ``entropy_coef`` itself moves under adaptive control)."""
    return trainer._entropy_bonus_enabled
