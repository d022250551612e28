"""Every supported family in float64: tree log-probs, entropies and parameter gradients equal the
model's own forward run trajectory by trajectory to float64 rounding, for the whole forest and for
the planner's pieces over two ranks.

The fp32 tests stop at 2e-5, and a wrong term smaller than that hides in fp32 noise: the oracle's
own fp32 error against float64 reaches 3.5e-5 on a few hundred gated-delta tokens. Here every
upcast to float32 (in transformers' reference kernels, routers and softmaxes, and in our kernels'
accumulators) is the identity on float64 tensors. Both sides then compute in float64, so any
difference above ~1e-14 is a real one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine import assert_same, engine_run, per_token_loss
from tiny_models import (
    FAMILIES,
    family_forest,
    keep_float64,
    loss_weights,
    max_diffs,
    oracle_run,
    tiny_model,
    tree_run,
)

from harts_hf import RolloutForest, patch_model, plan

TOL = 1e-11  # float64 rounding: measured diffs are 1e-15 to 1e-14


@pytest.fixture
def float64_everywhere():
    with keep_float64():
        yield


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tree_equals_trajectories_in_float64(family, float64_everywhere):
    seqs = family_forest(np.random.default_rng(0))
    forest = RolloutForest.from_sequences(seqs)
    weights = loss_weights(forest).double()
    model = tiny_model(family, dtype=torch.float64)
    ref = oracle_run(model, seqs, weights)
    assert ref.logprobs.dtype == torch.float64
    patch_model(model)
    lp, ent, grad = max_diffs(ref, tree_run(model, forest, weights))
    assert max(lp, ent, grad) <= TOL, f"{family}: log-prob {lp:.1e}, entropy {ent:.1e}, relative grad {grad:.1e}"

    the_plan = plan(forest, world_size=2, max_tokens_per_microbatch=forest.max_length + 8)
    assert the_plan.num_pieces >= 3
    assert_same((ref.logprobs, ref.grads), engine_run(model, forest, the_plan, per_token_loss(weights)), tol=TOL)
