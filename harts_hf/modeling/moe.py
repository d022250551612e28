"""MoE router statistics of a tree pass, weighted by token multiplicity.

Trajectory-wise training averages the router loss over every (trajectory, position) row of a
padded batch. A compact token stands for ``multiplicity`` identical rows (same prefix, hence the
same hidden state and, with deterministic no-drop routing, the same routing), so weighting each
compact row by its multiplicity reproduces those averages exactly. transformers' own
``load_balancing_loss_func`` already accepts a float row weight as its attention mask, so the
family's function is reused unchanged.

Legend: N compact tokens, E experts, k experts per token.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from . import _compat

__all__ = ["expert_load", "router_aux_loss"]


def router_aux_loss(
    model: PreTrainedModel, router_logits: tuple[torch.Tensor, ...], weights: torch.Tensor
) -> torch.Tensor:
    """The family's load-balancing loss over a tree; ``weights`` [N] are the multiplicities."""
    loss_fn = _compat.load_balancing_loss(model)
    return loss_fn(router_logits, model.num_experts, model.num_experts_per_tok, weights[None])


def expert_load(router_logits: tuple[torch.Tensor, ...], weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """[layers, E] weighted fraction of top-k assignments each expert receives (the
    ``tokens_per_expert`` of the load-balancing loss, per MoE layer)."""
    loads = []
    for logits in router_logits:  # [N, E]
        chosen = logits.float().softmax(-1).topk(top_k, dim=-1).indices  # [N, k]
        load = torch.zeros(logits.shape[-1], device=logits.device).index_add_(
            0, chosen.reshape(-1), weights.to(logits.device).repeat_interleave(top_k)
        )
        loads.append(load / weights.sum())
    return torch.stack(loads)
