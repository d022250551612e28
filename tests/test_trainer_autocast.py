"""Every HARTS trainer under TRL's default mixed precision (``bf16=True``: fp32 weights, bf16
autocast; ``fp16=True`` with its grad scaler too) tracks stock TRL under the same precision over
several steps: parameters after the last step, and every logged loss, differ from stock's by no
more than stock's own rounding (stock under autocast against stock in fp32), with LoRA, gradient
checkpointing, pieces whose replay runs after TRL leaves autocast, a reference model and
several iterations; no run leaves autocast on behind it (accelerate's mixed-precision forward is
not re-entrant). The runs reuse each trainer's exactness test (its data, model and SGD)."""

from __future__ import annotations

import numpy as np
import pytest
import test_trainer_dpo as dpo
import test_trainer_exactness as grpo
import test_trainer_rloo as rloo
import test_trainer_sft as sft
import torch
from trainer_args import Snapshots
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from harts_hf.trainers import HARTSGRPOConfig, HARTSGRPOTrainer, HARTSRLOOConfig, HARTSRLOOTrainer

SLACK = 2.0
TOL = 1e-5  # the fp32 exactness tests' tolerance: accelerate's fp16 on CPU runs without autocast
BF16 = dict(bf16=True, max_steps=3)
FP32 = dict(bf16=False, fp16=False)


def _rollout_run(kind: str, harts: bool, model_dir: str, tmp_path, **overrides):
    """(parameters before and after every step, losses) of a GRPO / RLOO exactness run."""
    module, classes = {
        "grpo": (grpo, ((GRPOTrainer, GRPOConfig), (HARTSGRPOTrainer, HARTSGRPOConfig))),
        "rloo": (rloo, ((RLOOTrainer, RLOOConfig), (HARTSRLOOTrainer, HARTSRLOOConfig))),
    }[kind]
    if not harts:
        overrides = {k: v for k, v in overrides.items() if not k.startswith("harts_")}
    peft_config = overrides.pop("peft_config", None)
    extra = {} if peft_config is None else {"peft_config": peft_config()}
    snaps = Snapshots()
    _, losses = module.train(*classes[harts], model_dir, tmp_path, callbacks=[snaps], **extra, **overrides)
    return snaps.params, losses


def _fused_run(kind: str, harts: bool, case: str, tmp_path, model_dir: str, **overrides):
    """(parameters before and after every step, losses) of an SFT / DPO exactness run."""
    if kind == "sft":
        out = sft.train(case, harts, tmp_path, **overrides)
    else:
        out = dpo.train(case, harts, model_dir, tmp_path, **overrides)
    return out["params"], [h["loss"] for h in out["history"]]


def _assert_tracks(harts, stock, wide) -> None:
    """``harts`` (parameters at every step, losses) lies within SLACK x stock's autocast rounding of
    ``stock`` (``wide``: stock without autocast): the parameters after every step, and the first
    loss, within the largest loss difference stock's rounding makes over the run (a mean over many
    tokens can cancel most of the rounding at one step; DPO's first loss is log 2 at any precision
    where policy and reference run alike). Later losses are taken at parameters that already
    differ by that rounding and amplify it through the loss's curvature: the parameters after
    each step measure that drift."""
    moved = float((stock[0][-1] - stock[0][0]).abs().max())
    assert moved > 1e-3, f"the steps did not move the weights ({moved:.1e})"
    assert len(harts[0]) == len(stock[0]) == len(wide[0]) > 2
    for step, (h, s, w) in enumerate(zip(harts[0], stock[0], wide[0])):
        rounding, diff = float((s - w).abs().max()), float((h - s).abs().max())
        assert diff <= SLACK * rounding + TOL, (
            f"step {step}: parameters differ by {diff:.2e} > {SLACK} x {rounding:.2e}"
        )
    rounding, diff = np.abs(np.subtract(stock[1], wide[1])).max(), abs(harts[1][0] - stock[1][0])
    assert diff <= SLACK * rounding + TOL, f"first loss differs by {diff:.2e} > {SLACK} x {rounding:.2e}"
    assert not torch.is_autocast_enabled("cpu"), "a run left autocast on"


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "in_proj_qkv"], lora_dropout=0.0)


ROLLOUT_CASES = [
    pytest.param("grpo", dict(loss_type="dapo", beta=0.1), id="grpo-dapo-beta"),
    pytest.param(  # TRL's default checkpointing; pieces: the engine's replay runs after TRL's autocast ends
        "grpo",
        dict(loss_type="grpo", num_iterations=2, gradient_checkpointing=True, harts_max_tokens_per_microbatch=16),
        id="grpo-mu2-checkpointing-pieces",
    ),
    pytest.param(
        "grpo",
        dict(
            loss_type="dapo", beta=0.1, gradient_accumulation_steps=2, per_device_train_batch_size=4, peft_config=_lora
        ),
        id="grpo-lora-two-microbatches",
    ),
    pytest.param("grpo", dict(loss_type="dapo", bf16=False, fp16=True), id="grpo-fp16-grad-scaler"),
    pytest.param("rloo", dict(beta=0.05, num_iterations=2), id="rloo-beta-mu2"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "overrides"), ROLLOUT_CASES)
def test_rollout_trainers_track_stock_under_autocast(kind, overrides, tmp_path):
    model_dir = grpo.saved_model(tmp_path / "model", grpo.build_tokenizer())
    precision = BF16 | overrides
    runs = [
        _rollout_run(kind, harts, model_dir, tmp_path / name, **(precision | extra))
        for name, harts, extra in (("harts", True, {}), ("stock", False, {}), ("fp32", False, FP32))
    ]
    _assert_tracks(*runs)


FUSED_CASES = [
    pytest.param("sft", "agent-conversations-checkpointing", id="sft-conversations-checkpointing"),
    pytest.param("sft", "text-two-microbatches-pieces", id="sft-text-pieces"),
    pytest.param("dpo", "sigmoid-checkpointing", id="dpo-sigmoid-checkpointing"),
    pytest.param("dpo", "ipo-wpo-ld_alpha-two-microbatches-pieces", id="dpo-ipo-pieces"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "case"), FUSED_CASES)
def test_fused_head_trainers_track_stock_under_autocast(kind, case, tmp_path):
    model_dir = dpo.saved_model(tmp_path / "model", dpo.agent_tokenizer()) if kind == "dpo" else ""
    runs = [
        _fused_run(kind, harts, case, tmp_path / name, model_dir, **extra)
        for name, harts, extra in (("harts", True, BF16), ("stock", False, BF16), ("fp32", False, BF16 | FP32))
    ]
    _assert_tracks(*runs)
