"""Every supported family in bf16: tree log-probs, entropies and gradients differ from the
trajectory-wise run no more than the trajectory-wise baseline varies by itself.

The baseline's variation is measured three ways and the largest counts: the same bf16 model run as
one padded batch instead of trajectory by trajectory (the issue's measure), right-padded and
left-padded (how TRL lays out prompts: every row ends at the last column, so RoPE sees shifted
positions, and linear-attention / conv layers a run of zero inputs first), and the bf16
trajectory-wise run against the same weights in fp32 (its own rounding error). CPU kernels are
row-deterministic, so both padded batches of the families without positions in attention
(kimi_linear's MLA, nemotron_h, zamba2) reproduce the per-trajectory run bit for bit, which says
nothing about how far another, equally valid summation order lands: there the fp32 measure binds. Log-probs and entropies are compared by their
mean absolute difference over real tokens and gradients by the relative L2 norm over all
parameters: in bf16 a near-tie in an MoE router's top-k flips under any reordering and moves
single tokens (and the experts they reach) far more than the rest, in the baseline too; the
routers are sharpened (``sharpen_routers``) so such ties do not occur.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tiny_models import (
    FAMILIES,
    Run,
    family_forest,
    loss_weights,
    oracle_run,
    padded_run,
    sharpen_routers,
    tiny_model,
    tree_run,
    variation,
)

from harts_hf.forest import RolloutForest
from harts_hf.modeling import patch_model

SLACK = 2.0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_within_baseline_variation(family):
    seqs = family_forest(np.random.default_rng(2), small=True)
    forest = RolloutForest.from_sequences(seqs)
    real = torch.as_tensor(np.arange(forest.max_length - 1)[None] < forest.lengths[:, None] - 1)
    weights = loss_weights(forest, seed=2)
    model = patch_model(sharpen_routers(tiny_model(family, dtype=torch.bfloat16)))
    ref = oracle_run(model, seqs, weights)
    wide = oracle_run(copy.deepcopy(model).float(), seqs, weights)
    baseline = np.maximum.reduce(
        [
            variation(ref, padded_run(model, seqs, weights), real),
            variation(ref, padded_run(model, seqs, weights, left=True), real),
            variation(ref, Run(wide.logprobs, [g.to(torch.bfloat16) for g in wide.grads], wide.entropy), real),
        ]
    )
    got = variation(ref, tree_run(model, forest, weights), real)
    for name, value, bound in zip(("mean log-prob", "mean entropy", "relative grad norm"), got, baseline):
        assert value <= SLACK * bound, f"{family}: {name} diff {value:.2e} > {SLACK} x baseline variation {bound:.2e}"
