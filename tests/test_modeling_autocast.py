"""Every supported family under autocast (TRL's default ``bf16=True``: fp32 weights, bf16 compute;
fp16 autocast and bf16 weights too): tree log-probs, entropies and gradients differ from the
unpatched model run trajectory by trajectory under the same autocast no more than that model varies
by itself (``test_modeling_bf16``'s measures: right- and left-padded batches, and the same weights
in fp32 without autocast, its own rounding), for whole forests, planned pieces and the replay.

The tree's attention and conv run in the autocast dtype as sdpa and ``F.conv1d`` do; its linear
attention / SSM recurrences run in fp32, as fla's kernels do (transformers' CPU fallback multiplies
in bf16), so for the hybrid families the fp32 measure binds. Routers are sharpened (32x where the
weights or the autocast are bf16): under autocast the router logits themselves are low precision,
and a near-tie flips an expert between any two summation orders (the baseline's too); fp16 keeps
the bf16 test's 8x (32x overflows KDA's fp16 gradients in the unpatched model itself).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine import dfs_cut_plan, per_token_loss
from tiny_models import (
    FAMILIES,
    Run,
    family_forest,
    loss_weights,
    oracle_run,
    padded_run,
    sharpen_routers,
    tiny_model,
    trainable,
    tree_run,
    variation,
)

from harts_hf.engine import TreeEngine
from harts_hf.forest import RolloutForest
from harts_hf.modeling import patch_model

SLACK = 2.0
NAMES = ("mean log-prob", "mean entropy", "relative grad norm")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = [  # (weights, autocast)
    pytest.param("fp32", "bf16", id="fp32-weights-bf16-autocast"),  # TRL's default
    pytest.param("fp32", "fp16", id="fp32-weights-fp16-autocast"),
    pytest.param("bf16", "bf16", id="bf16-weights-bf16-autocast"),
]


def _autocast(dtype: str):
    return torch.autocast("cpu", dtype=DTYPES[dtype])


def _case(family: str, weights: str, autocast: str, seed: int = 2):
    seqs = family_forest(np.random.default_rng(seed), small=True)
    forest = RolloutForest.from_sequences(seqs)
    real = torch.as_tensor(np.arange(forest.max_length - 1)[None] < forest.lengths[:, None] - 1)
    sharpen = 32.0 if "bf16" in (weights, autocast) else 8.0
    model = patch_model(sharpen_routers(tiny_model(family, dtype=DTYPES[weights]), sharpen))
    return seqs, forest, real, loss_weights(forest, seed=seed), model


def _baseline(model, seqs, weights, real, ref: Run, autocast: str) -> np.ndarray:
    """The unpatched model's own variation under ``autocast`` around ``ref`` (its per-trajectory run)."""
    with _autocast(autocast):
        padded = [padded_run(model, seqs, weights, left=left) for left in (False, True)]
    dtype = next(model.parameters()).dtype
    full = oracle_run(model.float(), seqs, weights)
    model.to(dtype)
    full = Run(full.logprobs, [g.to(r.dtype) for g, r in zip(full.grads, ref.grads)], full.entropy)
    return np.maximum.reduce([variation(ref, run, real) for run in (*padded, full)])


def _assert_within(label: str, got: np.ndarray, bound: np.ndarray) -> None:
    for name, value, limit in zip(NAMES, got, bound):
        assert value <= SLACK * limit, f"{label}: {name} diff {value:.2e} > {SLACK} x baseline variation {limit:.2e}"


@pytest.mark.parametrize(("weights", "autocast"), PRECISIONS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_autocast_within_baseline_variation(family, weights, autocast):
    seqs, forest, real, loss, model = _case(family, weights, autocast)
    with _autocast(autocast):
        ref = oracle_run(model, seqs, loss)
        got = tree_run(model, forest, loss)
    assert all(g.dtype == DTYPES[weights] for g in got.grads)
    _assert_within(family, variation(ref, got, real), _baseline(model, seqs, loss, real, ref, autocast))


def _engine_run(model, forest, the_plan, weights) -> Run:
    """One rank's engine, its loss and backward inside autocast (as a training step)."""
    for p in trainable(model):
        p.grad = None
    engine = TreeEngine(model, forest, the_plan)
    lp, ent = engine.logprobs(return_entropy=True)
    engine.backward(per_token_loss(weights))
    return Run(lp[0], [p.grad.clone() for p in trainable(model)], ent[0])


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear", "nemotron_h"])
def test_planned_pieces_under_autocast(family, checkpointing):
    """Pieces cut mid-node and mid-chunk hand bf16 K/V and fp32 states across slots under autocast."""
    seqs, forest, real, loss, model = _case(family, "fp32", "bf16")
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    the_plan = dfs_cut_plan(forest, np.array([17, 63, 64, 66, 71]))
    with _autocast("bf16"):
        ref = oracle_run(model, seqs, loss)
        got = _engine_run(model, forest, the_plan, loss)
    _assert_within(family, variation(ref, got, real), _baseline(model, seqs, loss, real, ref, "bf16"))


def test_replay_runs_under_the_recordings_autocast():
    """A recording made under autocast and backpropagated outside it (TRL calls ``backward()`` after
    leaving ``accelerator.autocast()``) replays its units in bf16, as the one-call backward does."""
    _, forest, _, loss, model = _case("qwen3_5", "fp32", "bf16")
    the_plan = dfs_cut_plan(forest, np.array([40, 70]))
    with _autocast("bf16"):
        inside = _engine_run(model, forest, the_plan, loss)
        recording = TreeEngine(model, forest, the_plan).record()
    for p in trainable(model):
        p.grad = None
    recording.backward([loss])
    outside = [p.grad for p in trainable(model)]
    for a, b in zip(outside, inside.grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * max(float(g.abs().max()) for g in inside.grads))
    for p in trainable(model):
        p.grad = None
    TreeEngine(model, forest, the_plan).record().backward([loss])  # recorded in fp32: another result
    assert max(float((p.grad - g).abs().max()) for p, g in zip(trainable(model), inside.grads)) > 1e-4
