"""TRL's fused LM head (``model(..., labels=labels, fused_lm_head=True)``) on the forest of a padded batch.

TRL 1.16's SFT, DPO and RLOO trainers read per-token outputs of that call in the shifted layout
[B, S - 1] (column j scores ``labels[:, j + 1]`` from position j, 0 where the label is -100):
``log_probs``, ``entropy``, ``is_top1``, ``label_mask`` and, for MoE models, ``aux_loss``
(``trl.trainer.utils.FusedCausalLMOutput``). :func:`fused_outputs` computes them with one tree
pass over the batch's rows, every shared prefix once, and scatters them back
(``rows.to_shifted_layout``), so the trainer's own loss and metrics run unchanged.

Legend: B rows, S padded width.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import FusedCausalLMOutput

from ..forest import RolloutForest
from ..modeling import tree_forward
from .rows import to_shifted_layout

__all__ = ["FUSED_INPUTS", "fused_outputs"]

FUSED_INPUTS = frozenset({"input_ids", "attention_mask", "labels", "use_cache", "output_router_logits"})
"""The keywords of a fused-head call a forest can serve; any other (packing's position ids,
multimodal inputs, ...) takes TRL's own path."""


def fused_outputs(
    model: torch.nn.Module,
    forest: RolloutForest,
    input_ids: torch.Tensor,  # [B, S]
    attention_mask: torch.Tensor,  # [B, S]
    labels: torch.Tensor,  # [B, S], -100 where not scored
    *,
    output_router_logits: bool = False,
) -> FusedCausalLMOutput:
    """The fused head's outputs for the batch whose rows make ``forest`` (``rows.rows_forest``),
    from one pass of the patched ``model`` over it."""
    target = labels[:, 1:]
    label_mask = target != -100  # [B, S - 1]
    scored = label_mask & attention_mask[:, :-1].bool() & attention_mask[:, 1:].bool()
    if (label_mask != scored).any() or (target[label_mask] != input_ids[:, 1:][label_mask]).any():
        raise ValueError(
            "the labels must be the input ids (or -100) at real tokens for a forest to score them: compute the "
            "loss on shifted input ids as TRL's collators do, or pass harts_enable=False"
        )
    out = tree_forward(model, forest, return_entropy=True, return_top1=True, output_router_logits=output_router_logits)
    zero = lambda v: torch.zeros((), dtype=v.dtype, device=v.device)
    shifted = lambda v: torch.where(label_mask, to_shifted_layout(v, attention_mask), zero(v))
    log_probs = shifted(out.logprobs)
    loss = -log_probs.sum() / label_mask.sum().clamp(min=1)
    if out.aux_loss is not None:  # as TRL's fused forward: the config's coefficient
        loss = loss + getattr(model.config.get_text_config(), "router_aux_loss_coef", 0.0) * out.aux_loss
    return FusedCausalLMOutput(
        loss=loss,
        log_probs=log_probs,
        entropy=shifted(out.entropy),
        is_top1=shifted(out.is_top1),
        label_mask=label_mask,
        aux_loss=out.aux_loss,
    )
