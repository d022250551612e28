"""HARTSSFTTrainer == TRL's SFTTrainer on the same samples: parameters after every step, losses and
metrics (fp32, SGD; see test_trainer_exactness.py for why not Adam).

The samples are per-turn samples of conversations, as reasoning-agent SFT makes them: sample t + 1's
prompt is sample t's prompt and completion plus the next user turn, so a microbatch's samples share
long prefixes (one tree per conversation). Cases: agent conversations cut into per-turn samples
(``harts_hf.sources.turn_samples``: tool calls, tool results, reasoning; TRL's conversational format
and ``completion_only_loss``) under SFT's default gradient checkpointing, the same shape as plain
prompt-completion text, plain text (every token scored) with two microbatches per step, and the
MoE router aux loss of a MoE model through the same seam; the plain-text case also cuts each
microbatch's forest into pieces (a budget below it: the engine's units, replayed in TRL's backward).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset
from tiny_models import tiny_model
from trainer_args import Snapshots, eval_keys, pass_counts, sgd_args, spy_fused_outputs

from harts_hf.sources import agent_conversations, agent_tokenizer, turn_samples
from harts_hf.sources.tokenizer import build_tokenizer
from harts_hf.trainers import HARTSSFTConfig, HARTSSFTTrainer

TOL = 1e-5
EVAL = dict(eval=True, eval_strategy="steps", eval_steps=1, eval_on_start=True, per_device_eval_batch_size=4)
CASES = {
    "agent-conversations-checkpointing": dict(data="conversations", gradient_checkpointing=True),
    "prompt-completion": dict(data="prompt-completion"),
    "text-two-microbatches-pieces": dict(  # each step's forest cut into pieces; evaluated after every step
        data="text",
        gradient_accumulation_steps=2,
        per_device_train_batch_size=3,
        harts_max_tokens_per_microbatch=24,
        **EVAL,
    ),
    "moe-router-aux": dict(data="prompt-completion", model="qwen3_5_moe"),
    "moe-router-aux-pieces": dict(  # the router loss of forests above the budget: one HARTS step's recording
        data="prompt-completion",
        model="qwen3_5_moe",
        gradient_accumulation_steps=2,
        per_device_train_batch_size=3,
        harts_max_tokens_per_microbatch=24,
    ),
}


GENERATION_TEMPLATE = (  # harts_hf.sources's template with the assistant turns marked: assistant_only_loss's masks
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}{% generation %}"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}<|act|>{{ c['function']['name'] }}"
    "({{ c['function']['arguments']['row'] }}){% endfor %}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def per_turn_samples(conversations: int, turns: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, completion) per turn: the prompt is the whole history up to the turn's user message."""
    rng = np.random.default_rng(seed)
    word = lambda n: "".join(rng.choice(list("abcdefghij "), n))
    samples = []
    for _ in range(conversations):
        history = "sys:" + word(12)
        for _ in range(turns):
            history += " user:" + word(int(rng.integers(3, 8)))
            reply = " bot:" + word(int(rng.integers(4, 10)))
            samples.append((history, reply))
            history += reply
    return samples


def dataset(kind: str | Dataset) -> Dataset:
    """The samples a case's ``data`` names (or, a Dataset, gives)."""
    if isinstance(kind, Dataset):
        return kind
    if kind == "conversations":  # TRL's conversational prompt-completion format, tool calls and reasoning
        return Dataset.from_list(turn_samples(agent_conversations(3, turns=2, seed=0)))
    if kind == "messages":  # TRL's conversational language-modeling format: whole conversations
        return Dataset.from_list([{"messages": m} for m in agent_conversations(6, turns=2, seed=0)])
    samples = per_turn_samples(4, 3)
    if kind == "text":
        return Dataset.from_dict({"text": [p + c for p, c in samples]})
    return Dataset.from_dict({"prompt": [p for p, _ in samples], "completion": [c for _, c in samples]})


def train(case: str, harts: bool, tmp_path, **overrides) -> dict:
    from trl import SFTConfig, SFTTrainer

    options = {k: v for k, v in (CASES[case] | overrides).items() if harts or not k.startswith("harts_")}
    data, family = options.pop("data"), options.pop("model", "qwen3_5")
    dtype = getattr(torch, (options.pop("model_init_kwargs", None) or {}).get("dtype", "float32"))  # as TRL loads
    peft_config = options.pop("peft_config", None)
    evaluate = options.pop("eval", False)  # the training data as eval data too, evaluated as options say
    config_cls, trainer_cls = (HARTSSFTConfig, HARTSSFTTrainer) if harts else (SFTConfig, SFTTrainer)
    args = sgd_args(
        tmp_path / f"{case}-{harts}",
        per_device_train_batch_size=6,
        max_steps=3,
        learning_rate=0.1,
        dataloader_drop_last=True,
    )
    snaps, tokenizer = Snapshots(), agent_tokenizer()
    if options.get("assistant_only_loss"):
        tokenizer.chat_template = GENERATION_TEMPLATE
    trainer = trainer_cls(
        model=tiny_model(family, seed=0, dtype=dtype),
        args=config_cls(**(args | options)),
        processing_class=tokenizer,
        train_dataset=dataset(data),
        eval_dataset=dataset(data) if evaluate else None,
        peft_config=peft_config() if peft_config else None,
        callbacks=[snaps],
    )
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    return {"params": snaps.params, "history": history, "evals": evals, "model": trainer.model}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sft_matches_stock(case, tmp_path, monkeypatch):
    forests, _, steps = spy_fused_outputs(monkeypatch)
    stock, harts = train(case, False, tmp_path), train(case, True, tmp_path)
    rows = CASES[case].get("gradient_accumulation_steps", 1) * CASES[case].get("per_device_train_batch_size", 6)
    passes = pass_counts(forests, steps)
    assert passes["per_microbatch"] == 0  # every pass a HARTS step
    trained = [s.forest for s in steps if s.grad]
    assert len(trained) == 3  # one forest per optimizer step: its microbatches' rows together
    assert all(f.num_trajectories == rows for f in trained)
    pieces = "harts_max_tokens_per_microbatch" in CASES[case]
    assert min(passes["trained"]) > 1 if pieces else max(passes["trained"]) == 1
    assert sum(f.num_trajectory_tokens for f in trained) > 1.02 * sum(f.num_compact_tokens for f in trained)
    # evaluation (at the start and after every step): each eval batch (12 samples, 4 a batch) one no-grad step
    assert passes["no_grad"] == 3 * len(harts["evals"])
    assert len(harts["evals"]) == len(stock["evals"]) == (4 if CASES[case].get("eval") else 0)
    for a, b in zip(stock["evals"], harts["evals"], strict=True):
        np.testing.assert_allclose([b[k] for k in eval_keys(a)], [a[k] for k in eval_keys(a)], rtol=TOL, atol=1e-7)
    assert len(stock["params"]) == len(harts["params"]) == 4  # the start, then after each of the 3 steps
    assert (stock["params"][-1] - stock["params"][0]).abs().max() > 1e-3  # the steps moved the weights
    for step, (a, b) in enumerate(zip(stock["params"], harts["params"])):
        assert (a - b).abs().max().item() < TOL, f"step {step} differs by {(a - b).abs().max().item()}"
    sharing = [h["harts/trajectory_tokens"] / h["harts/compact_tokens"] for h in harts["history"]]
    assert len(sharing) == 3 and min(sharing) > 1.02  # logged every step, as the rollout trainers log it
    keys = ["loss", "entropy", "mean_token_accuracy", "num_tokens"] + (["aux_loss"] if "moe" in case else [])
    for a, b in zip(stock["history"], harts["history"]):
        np.testing.assert_allclose([b[k] for k in keys], [a[k] for k in keys], rtol=TOL, atol=1e-7)


def test_per_turn_samples_share_their_history():
    """The workload shares what the tests say it does: each conversation's samples are one tree."""
    from harts_hf.forest import RolloutForest

    tok = build_tokenizer()
    samples = per_turn_samples(4, 3)
    forest = RolloutForest.from_sequences([tok(p + c)["input_ids"] for p, c in samples])
    assert len(forest.roots) == 1 and forest.compression > 1.8  # every sample starts "sys:"


def test_labels_that_are_not_the_inputs_are_refused():
    from harts_hf.modeling import patch_model
    from harts_hf.trainers.fused import fused_outputs
    from harts_hf.trainers.rows import rows_forest

    model = patch_model(tiny_model("qwen3_5"))
    ids = torch.tensor([[3, 4, 5, 6], [3, 4, 7, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    labels = ids.masked_fill(mask == 0, -100)
    forest = rows_forest(ids, mask)
    out = fused_outputs(model, forest, ids, mask, labels, statistics=("is_top1", "mean_logits"))
    assert out.log_probs.shape == (2, 3) and out.label_mask.sum() == 5 and out.is_top1.dtype == torch.bool
    assert out.entropy is None and out.mean_logits.shape == (2, 3)  # what was asked, as TRL's head
    with pytest.raises(ValueError, match="labels must be the input ids"):
        fused_outputs(model, forest, ids, mask, labels.masked_fill(labels == 5, 9))


@pytest.mark.parametrize("strategy", ["random", "sequential"])
def test_a_sampler_that_loses_the_sharing_is_warned_about(strategy, tmp_path, monkeypatch):
    """Measured on the data: TRL's default random sampler spreads each conversation's per-turn samples
    over microbatches (1.32x sharing where the dataset order has 1.87x here): one warning at init."""
    import harts_hf.trainers.fused as fused

    said = []
    monkeypatch.setattr(fused.logger, "warning", said.append)
    args = sgd_args(tmp_path, per_device_train_batch_size=4, max_steps=1, train_sampling_strategy=strategy)
    HARTSSFTTrainer(
        model=tiny_model("qwen3_5"),
        args=HARTSSFTConfig(**args),
        processing_class=agent_tokenizer(),
        train_dataset=Dataset.from_list(turn_samples(agent_conversations(8, turns=3))),
    )
    warned = [line for line in said if "random sampler" in line]
    assert len(warned) == (strategy == "random")
    if warned:
        assert "train_sampling_strategy='sequential'" in warned[0] and "1.87x" in warned[0]
