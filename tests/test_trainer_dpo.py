"""HARTSDPOTrainer == TRL's DPOTrainer on the same multi-turn preference pairs: parameters after every
step, losses and metrics (fp32, SGD; see test_trainer_exactness.py for why not Adam).

A pair is an agent conversation's history (system prompt, tool calls, tool results, reasoning: the
built-in ``harts_hf.sources.agent_conversations``) with its last assistant message as the chosen
answer and another as the rejected one; TRL's batch is the chosen rows then the rejected rows,
so each optimizer step's forest computes a pair's whole history once, for the policy (one HARTS step
over the step's microbatches) and once more for the reference model, which TRL reloads from the
checkpoint (one no-grad step on the same forest, plan and schedule).
"""

from __future__ import annotations

import numpy as np
import pytest
from datasets import Dataset
from trainer_args import Snapshots, eval_keys, pass_counts, saved_model, sgd_args, spy_fused_outputs
from trl import DPOConfig, DPOTrainer

from harts_hf.sources import agent_conversations, agent_tokenizer
from harts_hf.trainers import HARTSDPOConfig, HARTSDPOTrainer

TOL = 1e-5
EVAL = dict(eval=True, eval_strategy="steps", eval_steps=1, eval_on_start=True)  # 4 pairs: one batch of 8 rows
CASES = {
    "sigmoid-checkpointing": dict(gradient_checkpointing=True),  # TRL's defaults
    "ipo-wpo-ld_alpha-two-microbatches-pieces": dict(  # IPO's squared loss has large gradients: a smaller step
        loss_type=["ipo"],
        use_weighting=True,
        ld_alpha=0.5,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=2,
        learning_rate=0.05,
        harts_max_tokens_per_microbatch=64,  # each forest in pieces: policy and reference through the engine
        **EVAL,
    ),
}
METRICS = ["loss", "rewards/chosen", "rewards/margins", "logps/rejected", "logits/chosen", "entropy"]


def preference_pairs(n: int) -> Dataset:
    """TRL's conversational preference format: a multi-turn history, the last assistant message
    chosen, a wrong final answer rejected."""
    pairs = []
    for messages in agent_conversations(n, turns=2, seed=1):
        final = messages[-1]
        rejected = {"role": "assistant", "content": "Done: " + final["content"][::-1]}
        pairs.append({"prompt": messages[:-1], "chosen": [final], "rejected": [rejected]})
    return Dataset.from_list(pairs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return saved_model(tmp_path_factory.mktemp("tiny_qwen3_5_dpo"), agent_tokenizer())


def train(case: str, harts: bool, model_dir: str, tmp_path, **overrides) -> dict:
    config_cls, trainer_cls = (HARTSDPOConfig, HARTSDPOTrainer) if harts else (DPOConfig, DPOTrainer)
    options = {k: v for k, v in (CASES[case] | overrides).items() if harts or not k.startswith("harts_")}
    peft_config, evaluate = options.pop("peft_config", None), options.pop("eval", False)
    data = options.pop("data", None)  # the case's own pairs, else preference_pairs(8)
    args = sgd_args(tmp_path / f"{case}-{harts}", per_device_train_batch_size=4, max_steps=2, learning_rate=0.5)
    snaps = Snapshots()
    trainer = trainer_cls(
        model=model_dir,
        args=config_cls(**(args | options)),
        processing_class=agent_tokenizer(),
        train_dataset=preference_pairs(8) if data is None else data,
        eval_dataset=preference_pairs(4) if evaluate else None,
        peft_config=peft_config() if peft_config else None,
        callbacks=[snaps],
    )
    trainer.train()
    logged = trainer.state.log_history
    return {
        "params": snaps.params,
        "history": [h for h in logged if "loss" in h],
        "evals": [h for h in logged if "eval_loss" in h],
        "ref_model": trainer.ref_model,
        "model": trainer.model,
    }


@pytest.mark.parametrize("case", list(CASES))
def test_dpo_matches_stock(case, model_dir, tmp_path, monkeypatch):
    forests, slots, steps = spy_fused_outputs(monkeypatch)
    stock, harts = train(case, False, model_dir, tmp_path), train(case, True, model_dir, tmp_path)
    microbatches = CASES[case].get("gradient_accumulation_steps", 1)
    rows = 2 * CASES[case].get("per_device_train_batch_size", 4)  # chosen and rejected of a microbatch
    # per optimizer step, one HARTS step over its microbatches for the policy and one no-grad step for the
    # reference on its forest, plan and schedule; per eval batch, a no-grad step for each on one forest
    passes, evals = pass_counts(forests, steps), len(harts["evals"])
    assert passes["per_microbatch"] == 0 and passes["no_grad"] == 2 + 2 * evals and passes["reused"] == 2 + evals
    assert [s.forest.num_trajectories for s in steps if s.grad] == [rows * microbatches] * 2
    assert min(slots) > 1 if "harts_max_tokens_per_microbatch" in CASES[case] else max(slots) == 1
    assert min(f.num_trajectory_tokens / f.num_compact_tokens for f in forests) > 1.5  # the histories were shared
    assert len(stock["evals"]) == evals == (3 if CASES[case].get("eval") else 0)  # at the start, after each step
    for a, b in zip(stock["evals"], harts["evals"], strict=True):
        np.testing.assert_allclose([b[k] for k in eval_keys(a)], [a[k] for k in eval_keys(a)], rtol=TOL, atol=1e-6)
    assert (stock["params"][-1] - stock["params"][0]).abs().max() > 1e-3  # the steps moved the weights
    for step, (a, b) in enumerate(zip(stock["params"], harts["params"], strict=True)):
        assert (a - b).abs().max().item() < TOL, f"step {step} differs by {(a - b).abs().max().item()}"
    compression = [h["harts/compression"] for h in harts["history"]]
    assert len(compression) == 2 and min(compression) > 1.5  # logged every step: the histories were shared
    for a, b in zip(stock["history"], harts["history"], strict=True):
        np.testing.assert_allclose([b[k] for k in METRICS], [a[k] for k in METRICS], rtol=TOL, atol=1e-6)
