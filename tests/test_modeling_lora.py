"""Every supported family with a PEFT LoRA adapter on all linear layers (the linear-attention /
SSM / conv mixers' projections included): tree log-probs and LoRA gradients equal the PEFT
model's own forward run trajectory by trajectory (fp32, gradient checkpointing on)."""

from __future__ import annotations

import numpy as np
import peft
import pytest
from tiny_models import FAMILIES, family_forest, loss_weights, max_diffs, oracle_run, tiny_model, tree_run

from harts_hf.forest import RolloutForest
from harts_hf.modeling import ADAPTERS, patch_model

LOGPROB_TOL = 2e-5
GRAD_TOL = 2e-5  # relative to the largest reference gradient


def _lora(family: str) -> peft.PeftModel:
    # Random B (init_lora_weights=False): a zero B would hide the adapter from the forward. PEFT
    # refuses LoRA on a Mamba mixer's out_proj (fused-kernel compatibility), so it is left out.
    kinds = {kind for layout in ADAPTERS[family].layouts() for kind in layout.kernels.values()}
    mamba = "mamba2_scan" in kinds or family in ("mamba", "falcon_mamba")
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules="all-linear",
        exclude_modules=["out_proj"] if mamba else None,
        init_lora_weights=False,
    )
    return peft.get_peft_model(tiny_model(family), config)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_tree_equals_trajectories(family):
    seqs = family_forest(np.random.default_rng(1), small=True)
    forest = RolloutForest.from_sequences(seqs)
    weights = loss_weights(forest, seed=1)
    model = patch_model(_lora(family))
    mixers = ADAPTERS[family].mixers
    adapted = {
        type(m).__name__
        for m in model.modules()
        if any(isinstance(c, peft.tuners.lora.LoraLayer) for c in m.children())
    }
    assert set(mixers) <= adapted, f"LoRA should reach the {mixers} projections, reached {adapted}"
    ref = oracle_run(model, seqs, weights)
    model.base_model.model.activation_checkpointing_enable()
    model.train()
    got = tree_run(model, forest, weights)
    lp, ent, grad = max_diffs(ref, got)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert lp <= LOGPROB_TOL, f"{family}: log-prob diff {lp:.2e}"
    assert ent <= LOGPROB_TOL, f"{family}: entropy diff {ent:.2e}"
    assert grad <= GRAD_TOL, f"{family}: relative LoRA grad diff {grad:.2e}"
