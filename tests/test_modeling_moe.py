"""MoE router statistics over a tree equal those of a padded batch of all trajectories (what
trajectory-wise training computes): load-balancing loss (and its gradient) and expert load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import FAMILIES, family_forest, tiny_model, trainable

from harts_hf.engine import TreeEngine
from harts_hf.forest import RolloutForest
from harts_hf.modeling import ADAPTERS, UnsupportedModelError, patch_model, tree_forward
from harts_hf.modeling.moe import router_aux_loss
from harts_hf.planner import MemoryModel, plan

MOE_FAMILIES = [name for name, adapter in ADAPTERS.items() if adapter.aux_loss and name in FAMILIES]


def _padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return ids, mask


def _expert_load(router_logits: tuple[torch.Tensor, ...], mask: torch.Tensor, top_k: int) -> torch.Tensor:
    """Reference: per layer, the mask-weighted fraction of top-k assignments per expert."""
    loads = []
    for logits in router_logits:  # [B * L, E]
        chosen = torch.nn.functional.one_hot(logits.softmax(-1).topk(top_k).indices, logits.shape[-1]).sum(1)
        loads.append((chosen * mask.reshape(-1, 1)).sum(0) / mask.sum())
    return torch.stack(loads).float()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_router_statistics_match_the_padded_batch(family):
    seqs = family_forest(np.random.default_rng(4))
    forest = RolloutForest.from_sequences(seqs)
    model = patch_model(tiny_model(family))
    params = trainable(model)
    ids, mask = _padded(seqs)
    ref = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    ref_grads = torch.autograd.grad(ref.aux_loss, params, allow_unused=True)
    got = tree_forward(model, forest, output_router_logits=True)
    got_grads = torch.autograd.grad(got.aux_loss, params, allow_unused=True)
    torch.testing.assert_close(got.aux_loss, ref.aux_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.expert_load, _expert_load(ref.router_logits, mask, model.num_experts_per_tok))
    scale = max(float(g.abs().max()) for g in ref_grads if g is not None)
    for a, b in zip(got_grads, ref_grads):
        assert (a is None) == (b is None)
        if b is not None:
            assert float((a - b).abs().max()) <= 2e-5 * scale


@pytest.mark.parametrize("family", ["qwen3_5_moe", "granitemoehybrid"])
def test_router_loss_of_a_subset_through_the_engines_pieces(family):
    """The engine's recorded router logits (a forest cut into pieces) give any subset of rows the
    router loss and gradient of their own padded batch: the family's function over every compact
    token, weighted by the subset's rows through it, backpropagated through the units."""
    seqs = family_forest(np.random.default_rng(5))
    forest = RolloutForest.from_sequences(seqs)
    model = patch_model(tiny_model(family))
    params = trainable(model)
    subset = np.arange(1, len(seqs), 2)
    ids, mask = _padded([seqs[i] for i in subset])
    ref = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    ref_grads = torch.autograd.grad(ref, params, allow_unused=True)
    pieces = plan(forest, world_size=1, max_tokens_per_microbatch=24, memory_model=MemoryModel(1.0, 0.2))
    assert pieces.num_slots >= 3
    recording = TreeEngine(model, forest, pieces).record(return_router_logits=True)
    logits = recording.router_logits[0].detach().requires_grad_()  # [layers, N, E]
    weights = torch.as_tensor(forest.multiplicity_of(subset), dtype=torch.float32)
    got = router_aux_loss(model, tuple(logits.unbind(0)), weights)
    got.backward()
    recording.backward([torch.zeros(forest.num_trajectories, forest.max_length - 1)], router_grads=[logits.grad])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=0)
    scale = max(float(g.abs().max()) for g in ref_grads if g is not None)
    for p, b in zip(params, ref_grads):
        a = p.grad
        assert float(((torch.zeros_like(p) if a is None else a) - (0 if b is None else b)).abs().max()) <= 2e-5 * scale


def test_families_without_a_router_loss_refuse_router_outputs():
    model = patch_model(tiny_model("llama"))
    with pytest.raises(UnsupportedModelError, match="router"):
        tree_forward(model, RolloutForest.from_sequences([[3, 4, 5]]), output_router_logits=True)
    with pytest.raises(UnsupportedModelError, match="router"):
        TreeEngine(model, RolloutForest.from_sequences([[3, 4, 5]])).record(return_router_logits=True)
