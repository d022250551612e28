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
from datasets import Dataset
from trainer_args import Snapshots, flat_parameters
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from harts_hf.trainers import HARTSGRPOConfig, HARTSGRPOTrainer, HARTSRLOOConfig, HARTSRLOOTrainer

SLACK = 2.0
TOL = 1e-5  # the fp32 exactness tests' tolerance: accelerate's fp16 on CPU runs without autocast
BF16 = dict(bf16=True, max_steps=3)
FP32 = dict(bf16=False, fp16=False, model_init_kwargs=None)  # fp32 weights too
BF16_WEIGHTS = dict(model_init_kwargs={"dtype": "bfloat16"})  # TRL loads the model (and reference) in bf16
FP16_WEIGHTS = dict(model_init_kwargs={"dtype": "float16"})  # fp16 weights under bf16 autocast (TRL's suites do)
EVAL = dict(eval=True, eval_strategy="steps", eval_steps=1, eval_on_start=True)  # at the start and every step
EVAL_KEYS = ("eval_loss", "eval_kl", "eval_entropy", "eval_logps/chosen", "eval_logps/rejected")
"""The eval metrics compared where a trainer logs them (RLOO's eval loss is ~0: its KL and entropy speak)."""


def _rollout_run(kind: str, harts: bool, model_dir: str, tmp_path, **overrides):
    """(parameters before and after every step, losses, eval metrics, the reference's parameters at
    the end) of a GRPO / RLOO exactness run; ``eval=True``: its prompts as eval data too."""
    module, classes = {
        "grpo": (grpo, ((GRPOTrainer, GRPOConfig), (HARTSGRPOTrainer, HARTSGRPOConfig))),
        "rloo": (rloo, ((RLOOTrainer, RLOOConfig), (HARTSRLOOTrainer, HARTSRLOOConfig))),
    }[kind]
    if not harts:
        overrides = {k: v for k, v in overrides.items() if not k.startswith("harts_")}
    peft_config = overrides.pop("peft_config", None)
    extra = {} if peft_config is None else {"peft_config": peft_config()}
    if overrides.pop("eval", False):
        extra["eval_dataset"] = Dataset.from_dict({"prompt": module.PROMPTS * 2})
    snaps = Snapshots()
    trainer, losses = module.train(*classes[harts], model_dir, tmp_path, callbacks=[snaps], **extra, **overrides)
    return snaps.params, losses, _eval_metrics(trainer.state.log_history), _flat(trainer.ref_model)


def _fused_run(kind: str, harts: bool, case: str, tmp_path, model_dir: str, **overrides):
    """(parameters before and after every step, losses, eval metrics, the reference's parameters at
    the end) of an SFT / DPO exactness run."""
    if kind == "sft":
        out = sft.train(case, harts, tmp_path, **overrides)
    else:
        out = dpo.train(case, harts, model_dir, tmp_path, **overrides)
    losses = [h["loss"] for h in out["history"]]
    return out["params"], losses, _eval_metrics(out["evals"]), _flat(out.get("ref_model"))


def _flat(model: torch.nn.Module | None) -> torch.Tensor | None:
    """A reference model's parameters, flat (None without one: LoRA, beta=0, SFT)."""
    return None if model is None else flat_parameters(model, trained=False)


def _eval_metrics(log_history: list[dict]) -> list[dict[str, float]]:
    """The :data:`EVAL_KEYS` of every eval line of a run's log."""
    return [{k: h[k] for k in EVAL_KEYS if k in h} for h in log_history if "eval_loss" in h]


def _assert_tracks(harts, stock, wide) -> None:
    """``harts`` (parameters at every step, losses, eval metrics, the reference model's parameters at
    the end) lies within SLACK x stock's autocast rounding of ``stock`` (``wide``: stock without
    autocast): the parameters after every step and the reference's (moved by sync_ref_model); the
    first loss and the eval metrics at the start within the largest difference stock's rounding
    makes in them over the run (a mean over many tokens can cancel most of the rounding at one step;
    DPO's first loss is log 2 at any precision where policy and reference run alike). Later losses
    and evals are taken at parameters that already differ by that rounding and amplify it through
    the loss's curvature: the parameters after each step measure that drift."""
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
    assert len(harts[2]) == len(stock[2]) == len(wide[2])  # the eval metrics, where the run evaluated
    for key in stock[2][0] if stock[2] else ():  # the eval at the start, like the first loss
        h, s, w = ([line[key] for line in run[2]] for run in (harts, stock, wide))
        rounding, diff = np.abs(np.subtract(s, w)).max(), abs(h[0] - s[0])
        assert diff <= SLACK * rounding + TOL, f"{key} differs by {diff:.2e} > {SLACK} x {rounding:.2e}"
    assert (harts[3] is None) == (stock[3] is None) == (wide[3] is None)
    if stock[3] is not None:
        rounding, diff = float((stock[3] - wide[3]).abs().max()), float((harts[3] - stock[3]).abs().max())
        assert diff <= SLACK * rounding + TOL, f"reference models differ by {diff:.2e} > {SLACK} x {rounding:.2e}"
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
    pytest.param(  # graphs recorded under autocast wait in host memory (refused on CPU: lifted here)
        "grpo",
        dict(loss_type="dapo", harts_max_tokens_per_microbatch=16, harts_max_host_bytes=1e9),
        id="grpo-pieces-host-graphs",
    ),
    pytest.param("rloo", dict(beta=0.05, num_iterations=2), id="rloo-beta-mu2"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "overrides"), ROLLOUT_CASES)
def test_rollout_trainers_track_stock_under_autocast(kind, overrides, tmp_path, monkeypatch):
    if "harts_max_host_bytes" in overrides:  # the GPU's path, its copies in the same memory
        monkeypatch.setattr(HARTSGRPOTrainer, "_check_host_graphs", lambda self: None)
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


DPO_LOSSES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)  # fmt: skip
"""Every DPO loss type HARTSDPOConfig accepts: TRL sums them (weighted) in one run, each its own
function of the same per-token log-probs."""


VARIANT_CASES = [  # (kind, the exactness module's case for SFT / DPO, overrides): two steps, bf16 autocast unless said
    *(
        pytest.param("grpo", None, dict(loss_type=loss, num_iterations=2) | extra, id=f"grpo-{loss}-mu2")
        for loss, extra in (
            ("dr_grpo", dict(beta=0.1)),
            ("bnpo", dict(gradient_accumulation_steps=2, per_device_train_batch_size=4)),  # per-microbatch tokens
            ("cispo", {}),
            ("sapo", {}),
            ("luspo", dict(importance_sampling_level="sequence")),  # TRL's setting for it
            ("vespo", {}),
        )
    ),
    pytest.param(  # the reference moved toward the policy after every step; eval (no-grad HARTS steps) every step
        "grpo",
        None,
        dict(loss_type="dapo", beta=0.1, sync_ref_model=True, ref_model_sync_steps=1) | EVAL,
        id="grpo-sync-ref-eval",
    ),
    pytest.param("grpo", None, dict(loss_type="dapo", beta=0.1) | BF16_WEIGHTS, id="grpo-bf16-weights"),
    pytest.param("grpo", None, dict(loss_type="dapo", beta=0.1) | FP16_WEIGHTS, id="grpo-fp16-weights"),
    pytest.param(
        "rloo",
        None,
        dict(beta=0.0, normalize_advantages=True, reward_clip_range=(0.1, 0.8)),
        id="rloo-normalized-clipped",
    ),
    pytest.param("rloo", None, dict(beta=0.05, peft_config=_lora), id="rloo-lora"),
    pytest.param(
        "rloo", None, dict(beta=0.05, sync_ref_model=True, ref_model_sync_steps=1) | EVAL, id="rloo-sync-ref-eval"
    ),
    pytest.param("rloo", None, dict(beta=0.05) | BF16_WEIGHTS, id="rloo-bf16-weights"),
    pytest.param(  # DFT weighs each token's loss by its probability (~1/vocab here): a larger step
        "sft", "prompt-completion", dict(loss_type="dft", learning_rate=2.0), id="sft-completion-only-dft"
    ),
    pytest.param(  # whole conversations, the assistant turns trained (a template with generation markers)
        "sft",
        "prompt-completion",
        dict(data="messages", assistant_only_loss=True, per_device_eval_batch_size=3) | EVAL,
        id="sft-assistant-only-eval",
    ),
    pytest.param("sft", "prompt-completion", dict(peft_config=_lora), id="sft-lora"),
    pytest.param("sft", "prompt-completion", BF16_WEIGHTS, id="sft-bf16-weights"),
    pytest.param("sft", "prompt-completion", FP16_WEIGHTS, id="sft-fp16-weights"),
    pytest.param(  # squared losses (ipo, sppo_hard) weighted down so that no loss drowns the others
        "dpo",
        "sigmoid-checkpointing",
        dict(
            loss_type=list(DPO_LOSSES),
            loss_weights=[0.05 if loss in ("ipo", "sppo_hard") else 1.0 for loss in DPO_LOSSES],
            label_smoothing=0.1,  # exo_pair's epsilon, robust's and aot's flip probability
            learning_rate=0.1,
            gradient_checkpointing=False,
        ),
        id="dpo-every-loss-type",
    ),
    pytest.param("dpo", "sigmoid-checkpointing", dict(peft_config=_lora, learning_rate=0.1), id="dpo-lora"),
    pytest.param(
        "dpo",
        "sigmoid-checkpointing",
        dict(sync_ref_model=True, ref_model_sync_steps=1, gradient_checkpointing=False) | EVAL,
        id="dpo-sync-ref-eval",
    ),
    pytest.param("dpo", "sigmoid-checkpointing", BF16_WEIGHTS, id="dpo-bf16-weights"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "case", "overrides"), VARIANT_CASES)
def test_variants_track_stock_under_autocast(kind, case, overrides, tmp_path):
    """Every loss type and trainer option under bf16 autocast, LoRA, eval (its losses compared too),
    a synced reference model, bf16 and fp16 weights (rounding: stock in bf16 / fp16 against stock in
    fp32): HARTS within stock's own rounding."""
    precision = BF16 | dict(max_steps=2) | overrides
    wide = precision | FP32
    if kind in ("grpo", "rloo"):
        model_dir = grpo.saved_model(tmp_path / "model", grpo.build_tokenizer())
        run = lambda name, harts, options: _rollout_run(kind, harts, model_dir, tmp_path / name, **options)
    else:
        model_dir = dpo.saved_model(tmp_path / "model", dpo.agent_tokenizer()) if kind == "dpo" else ""
        run = lambda name, harts, options: _fused_run(kind, harts, case, tmp_path / name, model_dir, **options)
    runs = run("harts", True, precision), run("stock", False, precision), run("fp32", False, wide)
    _assert_tracks(*runs)
    if overrides.get("sync_ref_model"):  # the reference moved toward the policy: what the sync did was compared
        assert float((runs[1][3] - runs[1][0][0]).abs().max()) > 1e-3
