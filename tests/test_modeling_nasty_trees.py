"""Every nasty tree of the kernel tests through whole models, one family per layer kind: GDN +
conv + gated attention (qwen3_5), KDA + MLA (kimi_linear), Mamba2 SSD (nemotron_h), short conv
(lfm2), sliding-window + softcapped eager attention (gemma2), Mamba v1 (jamba; mamba, whose block and
model forwards harts-hf re-states). fp32 log-probs and gradients equal the trajectory-wise run."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import in_vocab, loss_weights, max_diffs, oracle_run, padding_is_zero, tiny_model, tree_run
from trees import NASTY_TREES

from harts_hf.forest import RolloutForest
from harts_hf.modeling import patch_model

REPRESENTATIVES = ["qwen3_5", "kimi_linear", "nemotron_h", "lfm2", "gemma2", "jamba", "mamba"]
LOGPROB_TOL = 2e-5
GRAD_TOL = 2e-5


@pytest.fixture(scope="module", params=REPRESENTATIVES)
def model(request):
    return patch_model(tiny_model(request.param))


@pytest.mark.parametrize("tree", list(NASTY_TREES))
def test_nasty_tree(model, tree):
    seqs = in_vocab(NASTY_TREES[tree](np.random.default_rng(5)))
    forest = RolloutForest.from_sequences(seqs)
    weights = loss_weights(forest, seed=5)
    ref = oracle_run(model, seqs, weights)
    got = tree_run(model, forest, weights)
    lp, ent, grad = max_diffs(ref, got)
    assert lp <= LOGPROB_TOL and ent <= LOGPROB_TOL, f"log-prob diff {lp:.2e}, entropy diff {ent:.2e}"
    assert grad <= GRAD_TOL, f"relative grad diff {grad:.2e}"
    assert padding_is_zero(forest, got)
