"""tree_logprobs / tree_forward: the chunked LM head, temperature, layout edge cases, refusals."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from tiny_models import VOCAB, as_layout, family_forest, tiny_model, trajectory_logprobs

from harts_hf.forest import RolloutForest
from harts_hf.modeling import patch_model, tree_forward, tree_logprobs


@pytest.fixture(scope="module")
def model():
    return patch_model(tiny_model("qwen3_5"))


@pytest.fixture(scope="module")
def seqs():
    return family_forest(np.random.default_rng(3))


def test_head_runs_in_bounded_chunks_over_unique_pairs(model, seqs):
    """Every LM-head call (forward and the backward recomputation) sees at most one chunk of
    rows, the rows are the N - roots (predictor, target) pairs once each, and the result does not
    depend on the chunk size."""
    forest = RolloutForest.from_sequences(seqs)
    rows: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[0]))
    try:
        results = {}
        for chunk in (7, 1 << 20):
            rows.clear()
            out = tree_forward(model, forest, return_entropy=True, head_chunk_tokens=chunk)
            forward_rows = sum(rows)
            (out.logprobs.sum() + out.entropy.sum()).backward()
            grad = model.lm_head.weight.grad.clone()
            model.zero_grad()
            results[chunk] = (out.logprobs.detach(), out.entropy.detach(), grad)
            assert max(rows) <= chunk
            assert forward_rows == forest.num_compact_tokens - forest.roots.size
            assert sum(rows) == 2 * forward_rows  # backward recomputes each chunk once
    finally:
        hook.remove()
    for small, large in zip(results[7], results[1 << 20]):  # only the summation order differs
        torch.testing.assert_close(small, large, rtol=0, atol=2e-5 * float(large.abs().max()))


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_temperature_scales_logits(model, seqs, temperature):
    forest = RolloutForest.from_sequences(seqs)
    with torch.no_grad():
        lp, ent = tree_logprobs(model, forest, temperature=temperature, return_entropy=True)
        for i, s in enumerate(seqs):
            ids = torch.tensor(s)[None]
            logp = (model(input_ids=ids).logits[0, :-1].float() / temperature).log_softmax(-1)
            n = len(s) - 1
            torch.testing.assert_close(lp[i, :n], logp.gather(-1, ids[0, 1:, None])[:, 0], rtol=0, atol=2e-5)
            torch.testing.assert_close(ent[i, :n], -(logp.exp() * logp).sum(-1), rtol=0, atol=2e-5)


def test_branch_point_predicts_each_child(model):
    """One prompt, 5 one-token children: 5 log-probs from the same hidden state, each its own."""
    prompt = [5, 9, 17, 33]
    seqs = [prompt + [t] for t in (3, 40, 41, 90, 127)]
    forest = RolloutForest.from_sequences(seqs)
    with torch.no_grad():
        lp = tree_logprobs(model, forest)
        ref = as_layout([r for r, _ in trajectory_logprobs(model, seqs)], forest.max_length - 1)
    torch.testing.assert_close(lp, ref, rtol=0, atol=2e-5)
    assert lp[:, -1].unique().numel() == len(seqs)


def test_single_token_trajectories_give_an_empty_layout(model):
    forest = RolloutForest.from_sequences([[3], [4], [3]])
    lp, ent = tree_logprobs(model, forest, return_entropy=True)
    assert lp.shape == ent.shape == (3, 0)
    model.zero_grad()
    lp.sum().backward()  # nothing to predict: zero gradients, as the stock model's empty loss gives
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_a_list_is_not_a_forest(model):
    with pytest.raises(TypeError, match="RolloutForest.from_sequences"):
        tree_logprobs(model, [[3, 4, 5]])


def test_out_of_vocabulary_ids_are_refused(model):
    with pytest.raises(ValueError, match="vocabulary"):
        tree_logprobs(model, RolloutForest.from_sequences([[3, 4, VOCAB]]))


def test_forest_deeper_than_the_model_is_refused(model):
    too_long = [3] * (model.config.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tree_logprobs(model, RolloutForest.from_sequences([too_long]))


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_non_positive_temperature_is_refused(model, temperature):
    with pytest.raises(ValueError, match="temperature"):
        tree_logprobs(model, RolloutForest.from_sequences([[3, 4]]), temperature=temperature)


@pytest.mark.parametrize("chunk", [0, -1])
def test_non_positive_head_chunk_is_refused(model, chunk):
    """A head chunk of no pairs would skip the head and give all-zero log-probs: refused up front."""
    with pytest.raises(ValueError, match="head_chunk_tokens"):
        tree_forward(model, RolloutForest.from_sequences([[3, 4, 5], [3, 4, 6]]), head_chunk_tokens=chunk)


def test_train_mode_noise_is_announced():
    """Dropout in train mode draws once per compact token, shared by the trajectories through it: said
    in a warning; eval mode (no draws) stays quiet."""
    noisy = patch_model(tiny_model("qwen3_5"))
    noisy.config.attention_dropout = 0.2
    forest = RolloutForest.from_sequences([[3, 4, 5], [3, 4, 6]])
    with pytest.warns(UserWarning, match="attention_dropout"):
        tree_logprobs(noisy.train(), forest)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tree_logprobs(noisy.eval(), forest)
