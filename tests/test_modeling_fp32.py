"""Every supported family, fp32: tree log-probs, entropies and parameter gradients equal the
model's own forward run trajectory by trajectory, with gradient checkpointing off and on."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import (
    FAMILIES,
    family_forest,
    loss_weights,
    max_diffs,
    oracle_run,
    padding_is_zero,
    tiny_model,
    tree_run,
)

from harts_hf.forest import RolloutForest
from harts_hf.modeling import patch_model

LOGPROB_TOL = 2e-5
GRAD_TOL = 2e-5  # relative to the largest reference gradient


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tree_equals_trajectories(family):
    seqs = family_forest(np.random.default_rng(0))
    forest = RolloutForest.from_sequences(seqs)
    weights = loss_weights(forest)
    model = patch_model(tiny_model(family))
    ref = oracle_run(model, seqs, weights)
    for checkpointing in (False, True):
        if checkpointing:
            model.activation_checkpointing_enable()
            model.train()
        got = tree_run(model, forest, weights)
        lp, ent, grad = max_diffs(ref, got)
        assert lp <= LOGPROB_TOL, f"{family} checkpointing={checkpointing}: log-prob diff {lp:.2e}"
        assert ent <= LOGPROB_TOL, f"{family} checkpointing={checkpointing}: entropy diff {ent:.2e}"
        assert grad <= GRAD_TOL, f"{family} checkpointing={checkpointing}: relative grad diff {grad:.2e}"
        assert padding_is_zero(forest, got)
