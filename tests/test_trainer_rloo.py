"""HARTSRLOOTrainer == TRL's RLOOTrainer on the same generations: losses and parameters after every step.

RLOO (TRL 1.16) generates with the policy itself (no ``rollout_func``): both trainers sample the same
completions from the same weights and seed; a group's rows share its prompt (the system prompt
and the task), which the forest computes once. RLOO's loss is sequence-level (the clipped ratio
of summed log-probs), with old log-probs from a separate no-grad pass and, with beta > 0, a
reference model reloaded from the checkpoint. fp32, CPU, SGD (see test_trainer_exactness).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from datasets import Dataset
from test_trainer_exactness import TOL, max_param_diff
from tiny_models import tiny_model
from trainer_args import saved_model, sgd_args
from trl import RLOOConfig, RLOOTrainer

from harts_hf.sources.tokenizer import build_tokenizer
from harts_hf.trainers import HARTSRLOOConfig, HARTSRLOOTrainer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

SYSTEM = "you are a careful agent. read the task, plan, then answer with one short line. "
PROMPTS = [SYSTEM + "solve: 12+7=", SYSTEM + "list the files in /srv"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return saved_model(tmp_path_factory.mktemp("tiny_qwen3_5_rloo"), build_tokenizer())


def length_reward(completion_ids, **kwargs) -> list[float]:
    return [float(sum(c) % 7) / 7 for c in completion_ids]


def train(
    trainer_cls,
    config_cls,
    model_dir: str,
    tmp_path,
    *,
    callbacks=None,
    peft_config=None,
    eval_dataset=None,
    **overrides,
):
    args = sgd_args(
        tmp_path / trainer_cls.__name__,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=0.05,
    )
    trainer = trainer_cls(
        model=model_dir,
        reward_funcs=length_reward,
        args=config_cls(**(args | overrides)),
        processing_class=build_tokenizer(),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
        eval_dataset=eval_dataset,
        peft_config=peft_config,
        callbacks=callbacks,
    )
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(dict(beta=0.05, num_iterations=2), id="beta-mu2"),  # RLOO's default beta: a reference model
        pytest.param(  # two microbatches in one HARTS step, each forest cut into pieces
            dict(
                beta=0.0,
                gradient_accumulation_steps=2,
                per_device_train_batch_size=4,
                harts_max_tokens_per_microbatch=40,
            ),
            id="pieces-two-microbatches",
        ),
    ],
)
def test_same_losses_and_parameters_as_trl(overrides, model_dir, tmp_path):
    harts_only = {k: v for k, v in overrides.items() if k.startswith("harts_")}
    stock_overrides = {k: v for k, v in overrides.items() if k not in harts_only}
    stock, stock_losses = train(RLOOTrainer, RLOOConfig, model_dir, tmp_path, **stock_overrides)
    harts, harts_losses = train(HARTSRLOOTrainer, HARTSRLOOConfig, model_dir, tmp_path, **overrides)
    assert max_param_diff(stock.model, tiny_model("qwen3_5")) > 1e-3  # the steps moved the weights
    np.testing.assert_allclose(harts_losses, stock_losses, rtol=TOL, atol=TOL)
    assert max_param_diff(harts.model, stock.model) < TOL
    logged = lambda key: [h[key] for h in harts.state.log_history if key in h]
    assert logged("harts/compression") and min(logged("harts/compression")) > 1.5  # the prompts were shared
    step_rows = harts.args.per_device_train_batch_size * harts.args.gradient_accumulation_steps
    assert min(logged("harts/rows")) == step_rows  # one plan per optimizer step
    if "harts_max_tokens_per_microbatch" in overrides:
        assert min(logged("harts/microbatches")) >= 3
