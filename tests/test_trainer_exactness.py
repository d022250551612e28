"""HARTSGRPOTrainer == TRL's GRPOTrainer on the same rollouts: losses and parameters after every step.

Both trainers load the same tiny Qwen3.5-style hybrid (GDN + attention) from one directory (the
reference model of beta > 0 is reloaded from it, as TRL does), use the in-code tokenizer and a
deterministic ``rollout_func`` whose rows share prompts and completion prefixes and carry env masks
(tool tokens attended, not trained). fp32 on CPU. The optimiser is SGD: Adam divides each update
by the gradient's own magnitude, so parameters whose gradient is ~1e-9 would flip by 2 * lr on
rounding noise and hide what the test compares (the gradients' values).
"""

from __future__ import annotations

import os
from dataclasses import fields

import numpy as np
import pytest
import torch
from datasets import Dataset
from tiny_models import tiny_model
from trainer_args import saved_model, sgd_args
from trl import GRPOConfig, GRPOTrainer

from harts_hf.engine.offload import HostGraphs
from harts_hf.schedule import Schedule
from harts_hf.sources.tokenizer import build_tokenizer
from harts_hf.trainers import HARTSGRPOConfig, HARTSGRPOTrainer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

GROUP = 4
PROMPTS = ["solve: 12+7=", "list the files in /srv", "ab"]
TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return saved_model(tmp_path_factory.mktemp("tiny_qwen3_5"), build_tokenizer())


def branching_rollout(prompts: list[str], trainer) -> dict:
    """Row k of a prompt's group: a completion prefix shared by pairs of rows, a tool call whose
    result (env_mask 0) the model attends but is not trained on, then a row-specific tail."""
    tok = trainer.processing_class
    out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
    seen: dict[str, int] = {}
    for prompt in prompts:
        k = seen.get(prompt, 0)
        seen[prompt] = k + 1
        ids = tok(prompt)["input_ids"]
        shared = np.random.default_rng([sum(ids), k // 2]).integers(8, 100, size=5).tolist()
        tail = np.random.default_rng([sum(ids), 99, k]).integers(8, 100, size=3 + k).tolist()
        completion = shared + [6] + tail[:2] + [2] + tail[2:] + [2]
        mask = [1] * len(shared) + [0] * 4 + [1] * (len(tail) - 2) + [1]
        out["prompt_ids"].append(ids)
        out["completion_ids"].append(completion)
        out["logprobs"].append([0.0] * len(completion))
        out["env_mask"].append(mask)
    return out


def id_reward(completion_ids, **kwargs) -> list[float]:
    return [float(sum(c) % 11) / 11 for c in completion_ids]


def config_kwargs(output_dir: str, **overrides) -> dict:
    """The settings both trainers share (fp32 CPU, SGD, 2 steps), with ``overrides``."""
    grpo = dict(per_device_train_batch_size=8, num_generations=GROUP, max_steps=2, max_completion_length=16)
    return sgd_args(output_dir, learning_rate=0.05, **(grpo | overrides))


def train(
    trainer_cls,
    config_cls,
    model_dir: str,
    tmp_path,
    *,
    peft_config=None,
    callbacks=None,
    eval_dataset=None,
    **overrides,
):
    args = config_kwargs(str(tmp_path / trainer_cls.__name__), **overrides)
    trainer = trainer_cls(
        model=model_dir,
        reward_funcs=id_reward,
        args=config_cls(**args),
        processing_class=build_tokenizer(),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
        eval_dataset=eval_dataset,
        rollout_func=branching_rollout,
        peft_config=peft_config,
        callbacks=callbacks,
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


CASES = [
    pytest.param(dict(loss_type="dapo"), id="dapo"),
    pytest.param(dict(loss_type="dapo", num_iterations=2, beta=0.1), id="dapo-mu2-beta"),
    pytest.param(dict(loss_type="dapo", gradient_checkpointing=True), id="dapo-checkpointing"),  # TRL's default
    pytest.param(dict(loss_type="grpo", beta=0.1), id="grpo-beta"),
    pytest.param(dict(loss_type="grpo", num_iterations=2), id="grpo-mu2"),
    pytest.param(dict(loss_type="dr_grpo", num_iterations=2, beta=0.1), id="dr_grpo-mu2-beta"),
    pytest.param(dict(loss_type="bnpo", beta=0.1), id="bnpo-beta"),
    pytest.param(dict(loss_type="bnpo", num_iterations=2), id="bnpo-mu2"),
    pytest.param(dict(loss_type="cispo", num_iterations=2, beta=0.1), id="cispo-mu2-beta"),
    pytest.param(dict(loss_type="sapo", num_iterations=2), id="sapo-mu2"),
    pytest.param(dict(loss_type="sapo", beta=0.1), id="sapo-beta"),
    pytest.param(dict(loss_type="grpo", importance_sampling_level="sequence", num_iterations=2), id="gspo-mu2"),
    pytest.param(
        dict(loss_type="dapo", importance_sampling_level="sequence", num_iterations=2, beta=0.1), id="seq-dapo-mu2-beta"
    ),
    pytest.param(  # two microbatches per optimizer step: one HARTS step computes both, TRL's loss runs per microbatch
        dict(loss_type="grpo", gradient_accumulation_steps=2, per_device_train_batch_size=4, num_iterations=2),
        id="grpo-two-microbatches",
    ),
    pytest.param(
        dict(loss_type="dapo", gradient_accumulation_steps=2, per_device_train_batch_size=4, beta=0.1),
        id="dapo-two-microbatches",
    ),
    pytest.param(  # bnpo divides by a microbatch's own token count: TRL's loss sees stock's microbatches
        dict(loss_type="bnpo", gradient_accumulation_steps=2, per_device_train_batch_size=4, beta=0.1),
        id="bnpo-two-microbatches",
    ),
    pytest.param(
        dict(loss_type="grpo", gradient_accumulation_steps=2, per_device_train_batch_size=4, top_entropy_quantile=0.5),
        id="top-entropy-two-microbatches",
    ),
    pytest.param(  # one optimizer step over two generation batches: a HARTS step per generation batch
        dict(loss_type="dapo", steps_per_generation=1, gradient_accumulation_steps=2, per_device_train_batch_size=4),
        id="dapo-step-over-two-generations",
    ),
    pytest.param(
        dict(loss_type="grpo", gradient_accumulation_steps=2, per_device_train_batch_size=4, entropy_coef=0.1),
        id="entropy-bonus-two-microbatches",
    ),
    pytest.param(  # one generation batch, two optimizer steps: each step trains the rows TRL's shuffle gives it
        dict(loss_type="grpo", steps_per_generation=2, per_device_train_batch_size=4),
        id="grpo-generation-over-two-steps",
    ),
    pytest.param(
        dict(
            loss_type="dapo",
            steps_per_generation=4,
            gradient_accumulation_steps=2,
            per_device_train_batch_size=4,
            beta=0.1,
        ),
        id="dapo-generation-over-two-steps-of-two",
    ),
]


@pytest.mark.parametrize("overrides", CASES)
def test_same_losses_and_parameters_as_trl(overrides, model_dir, tmp_path):
    stock, stock_losses = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path, **overrides)
    harts, harts_losses = train(HARTSGRPOTrainer, HARTSGRPOConfig, model_dir, tmp_path, **overrides)
    start = tiny_model("qwen3_5")
    assert max_param_diff(stock.model, start) > 1e-3  # the steps moved the weights
    np.testing.assert_allclose(harts_losses, stock_losses, rtol=TOL, atol=TOL)
    assert max_param_diff(harts.model, stock.model) < TOL
    compression = [h["harts/compression"] for h in harts.state.log_history if "harts/compression" in h]
    assert compression and min(compression) > 1.2  # the forests did share prefixes
    rows = [h["harts/rows"] for h in harts.state.log_history if "harts/rows" in h]  # one plan per optimizer step
    step_rows = harts.args.per_device_train_batch_size * min(  # (per generation batch where a step spans two)
        harts.args.gradient_accumulation_steps, harts.args.steps_per_generation
    )
    assert rows and min(rows) == step_rows, (rows, step_rows)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_trajectories_longer_than_the_budget(checkpointing, model_dir, tmp_path):
    """A budget below the longest row: every trajectory runs in pieces that read their ancestors
    as priced context, and the step still equals stock (a budget in bytes alike, the derived memory
    model's bytes of 16 tokens: the same slots)."""
    # Checkpointed tokens of a 32-wide model are cheap and its context K/V is not: the derived memory
    # model prices a context token at 0.7 own tokens there, so that run takes a lighter one.
    light = {"harts_memory_model": {"token": 1000.0, "context": 200.0}} if checkpointing else {}
    overrides = dict(loss_type="dapo", beta=0.1, gradient_checkpointing=checkpointing)
    stock, stock_losses = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path, **overrides)
    harts, harts_losses = train(
        HARTSGRPOTrainer, HARTSGRPOConfig, model_dir, tmp_path, harts_max_tokens_per_microbatch=16, **light, **overrides
    )
    rows = branching_rollout([p for p in PROMPTS for _ in range(GROUP)], harts)
    assert max(len(a) + len(b) for a, b in zip(rows["prompt_ids"], rows["completion_ids"])) > 16
    np.testing.assert_allclose(harts_losses, stock_losses, rtol=TOL, atol=TOL)
    assert max_param_diff(harts.model, stock.model) < TOL
    if checkpointing:
        return
    nbytes = float(harts._memory_model()(16))
    by_bytes, bytes_losses = train(
        HARTSGRPOTrainer,
        HARTSGRPOConfig,
        model_dir,
        tmp_path,
        harts_max_bytes_per_microbatch=nbytes,
        **light,
        **overrides,
    )
    np.testing.assert_allclose(bytes_losses, stock_losses, rtol=TOL, atol=TOL)
    slots = lambda t: [h["harts/microbatches"] for h in t.state.log_history if "harts/microbatches" in h]
    assert slots(by_bytes) == slots(harts) and min(slots(harts)) > 1


@pytest.mark.parametrize("budget", [65_536, 48], ids=["one-unit", "pieces"])
def test_lora_same_as_trl(budget, model_dir, tmp_path):
    """LoRA adapters (the reference pass runs with the adapter disabled) through the HARTS step."""
    from peft import LoraConfig

    lora = lambda: LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "in_proj_qkv"], lora_dropout=0.0)
    overrides = dict(loss_type="dapo", beta=0.1, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    stock, stock_losses = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path, peft_config=lora(), **overrides)
    harts, harts_losses = train(
        HARTSGRPOTrainer,
        HARTSGRPOConfig,
        model_dir,
        tmp_path,
        peft_config=lora(),
        harts_max_tokens_per_microbatch=budget,
        **overrides,
    )
    lora_params = lambda m: [p for n, p in m.named_parameters() if "lora_" in n]
    assert lora_params(stock.model) and max(p.abs().max().item() for p in lora_params(stock.model)) > 1e-3
    np.testing.assert_allclose(harts_losses, stock_losses, rtol=TOL, atol=TOL)
    diff = max((a - b).abs().max().item() for a, b in zip(lora_params(harts.model), lora_params(stock.model)))
    assert diff < TOL


def test_harts_disabled_is_stock(model_dir, tmp_path):
    stock, stock_losses = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path, beta=0.1)
    off, off_losses = train(HARTSGRPOTrainer, HARTSGRPOConfig, model_dir, tmp_path, beta=0.1, harts_enable=False)
    assert off_losses == stock_losses
    assert max_param_diff(off.model, stock.model) == 0.0
    assert not any(k.startswith("harts/") for h in off.state.log_history for k in h)


def test_config_accepts_every_grpo_field():
    theirs = {f.name: f for f in fields(GRPOConfig)}
    ours = {f.name: f for f in fields(HARTSGRPOConfig)}
    assert set(theirs) <= set(ours)
    extra = set(ours) - set(theirs)
    assert extra and all(name.startswith("harts_") and ours[name].metadata.get("help") for name in extra)
    a, b = GRPOConfig("x", use_cpu=True), HARTSGRPOConfig("x", use_cpu=True)
    assert all(getattr(a, n) == getattr(b, n) for n in theirs if n not in ("output_dir", "logging_dir"))


@pytest.mark.parametrize(
    "bad",
    [
        dict(harts_max_tokens_per_microbatch=0),
        dict(harts_chunk_size=-1),
        dict(harts_cost_model={"flops": 1.0}),
        dict(harts_max_bytes_per_microbatch=-1.0),
        dict(harts_memory_model={"tokens": 1.0}),
        dict(harts_memory_model={"token": 1.0, "context": -1.0}),
        {"harts_max_host_bytes": -1.0},
    ],
)
def test_config_validation(bad):
    with pytest.raises(ValueError, match="harts_"):
        HARTSGRPOConfig("x", use_cpu=True, **bad)


def test_a_budget_below_one_chunk_is_warned_about():
    with pytest.warns(UserWarning, match="harts_max_tokens_per_microbatch=4 is below one 64-token chunk"):
        HARTSGRPOConfig("x", use_cpu=True, harts_max_tokens_per_microbatch=4)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(dict(loss_type="dapo", beta=0.1), id="dapo-beta"),
        pytest.param(dict(loss_type="grpo", importance_sampling_level="sequence", num_iterations=2), id="gspo-mu2"),
        pytest.param(dict(loss_type="dapo", num_iterations=2, beta=0.1), id="dapo-mu2-beta"),
    ],
)
def test_engine_pieces_same_as_trl(overrides, model_dir, tmp_path, monkeypatch):
    """Microbatch forests above the budget run as planned pieces (policy, old policy, reference);
    the reference pass reuses the old-policy pass's schedule (the same rows)."""
    stock, stock_losses = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path, **overrides)
    served = []
    serves = Schedule.serves
    monkeypatch.setattr(Schedule, "serves", lambda self, *a: served.append(serves(self, *a)) or served[-1])
    harts, harts_losses = train(
        HARTSGRPOTrainer, HARTSGRPOConfig, model_dir, tmp_path, harts_max_tokens_per_microbatch=40, **overrides
    )
    both = overrides.get("num_iterations", 1) > 1 and overrides.get("beta", 0) > 0  # an old-policy and a reference pass
    assert any(served) == both, served
    microbatches = [h["harts/microbatches"] for h in harts.state.log_history if "harts/microbatches" in h]
    assert microbatches and min(microbatches) >= 3  # the engine split every forest
    np.testing.assert_allclose(harts_losses, stock_losses, rtol=TOL, atol=TOL)
    assert max_param_diff(harts.model, stock.model) < TOL


def test_host_graphs_same_as_trl(model_dir, tmp_path, monkeypatch):
    """``harts_max_host_bytes``: the slots the budget cannot keep record with grad, their saved tensors
    in host memory, and none reruns; the losses and weights are stock TRL's. Refused on CPU, where
    the host's memory is the budget's; here the refusal is lifted to run the GPU's path (whose
    copies on CPU are copies in the same memory)."""
    with pytest.raises(ValueError, match="harts_max_host_bytes keeps .* a CPU run"):
        train(HARTSGRPOTrainer, HARTSGRPOConfig, model_dir, tmp_path, harts_max_host_bytes=1e9)
    overrides = {"loss_type": "dapo", "beta": 0.1}
    stock, stock_losses = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path, **overrides)
    reruns = train(HARTSGRPOTrainer, HARTSGRPOConfig, model_dir, tmp_path, harts_max_tokens_per_microbatch=40)[0]
    assert min(h["harts/reruns"] for h in reruns.state.log_history if "harts/reruns" in h) > 0  # without host memory
    monkeypatch.setattr(HARTSGRPOTrainer, "_check_host_graphs", lambda self: None)
    saving, calls = HostGraphs.saving, []
    monkeypatch.setattr(HostGraphs, "saving", lambda self: calls.append(torch.is_grad_enabled()) or saving(self))
    harts, harts_losses = train(
        HARTSGRPOTrainer,
        HARTSGRPOConfig,
        model_dir,
        tmp_path,
        harts_max_tokens_per_microbatch=40,
        harts_max_host_bytes=1e9,
        **overrides,
    )
    assert calls and all(calls)  # the recordings with grad kept graphs in host memory
    logged = lambda key: [h[key] for h in harts.state.log_history if key in h]
    assert min(logged("harts/host_graphs")) > 0 and max(logged("harts/reruns")) == 0
    np.testing.assert_allclose(harts_losses, stock_losses, rtol=TOL, atol=TOL)
    assert max_param_diff(harts.model, stock.model) < TOL


def test_entropy_bonus_on_pieces_same_as_trl(model_dir, tmp_path):
    """The entropy bonus backpropagates through the entropies: the HARTS step replays the units
    with the entropies' gradients too, on forests cut into pieces."""
    overrides = dict(loss_type="grpo", entropy_coef=0.1, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    stock, stock_losses = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path, **overrides)
    harts, harts_losses = train(
        HARTSGRPOTrainer, HARTSGRPOConfig, model_dir, tmp_path, harts_max_tokens_per_microbatch=40, **overrides
    )
    microbatches = [h["harts/microbatches"] for h in harts.state.log_history if "harts/microbatches" in h]
    assert microbatches and min(microbatches) >= 3
    np.testing.assert_allclose(harts_losses, stock_losses, rtol=TOL, atol=TOL)
    assert max_param_diff(harts.model, stock.model) < TOL
