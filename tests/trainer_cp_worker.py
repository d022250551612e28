"""Worker of ``test_trainer_context_parallel.py`` under ``torchrun`` (gloo, CPU), stock then HARTS with
``harts_context_parallel=True`` under ``cp_plan_worker``'s budget, memory and cost models: ``grpo``,
``test_trainer_ddp``'s GRPO run on :func:`busy_rollout`'s rows (one trajectory three budgets long, short
rows on every rank), ``grpo-fsdp2`` the same with both trainers' models sharded by FSDP2 (``fsdp2_cpu``);
``rloo``, RLOO generating from :func:`rloo_prompts` (each step one prompt three budgets long, its group's
rows sharing it, and shorter ones), ``rloo-fsdp2`` the same sharded; ``sft`` and ``dpo`` (``-fsdp2``:
sharded), the fused-head trainers through ``test_trainer_fused_ddp``'s worker on :data:`FUSED`'s samples
(each step one row three budgets long, on the first rank then on the last). Saves each plan's
context-parallel groups."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import test_trainer_ddp as ddp
import test_trainer_exactness
import torch
import torch.distributed as dist
from cp_plan_worker import BUDGET, SPREAD_CHUNK, SPREAD_COST, busy_rows
from datasets import Dataset
from fsdp2_cpu import fsdp2_trainers

from harts_hf.trainers import step

CASE = "dapo-context-parallel-busy"
COMPLETION = 16
PER_RANK = {2: 2, 3: 4}
"""Rows per rank: every rank busy before the groups, with time to spare in the long row's slots for spans
that pay for a wavefront over the tiny model's 3 decoder layers (the plan prices the policy's own)."""


def overrides(world_size: int) -> dict:
    return {
        "loss_type": "dapo",
        "harts_context_parallel": True,
        "harts_cost_model": SPREAD_COST,
        "harts_chunk_size": SPREAD_CHUNK,
        "harts_max_tokens_per_microbatch": BUDGET,
        "harts_memory_model": {"token": 1.0, "context": 0.1},  # cp_plan_worker.SMALL_CONTEXT
        "per_device_train_batch_size": PER_RANK[world_size],
        "system": False,
    }


def busy_rollout(prompts: list[str], trainer) -> dict:
    """``cp_plan_worker.busy_rows`` of the launch, this rank's share: each row's last 16 tokens are
    its completion, the rest its prompt."""
    acc = trainer.accelerator
    rows = busy_rows(acc.num_processes, len(prompts))[acc.process_index * len(prompts) :][: len(prompts)]
    return {
        "prompt_ids": [row[:-COMPLETION] for row in rows],
        "completion_ids": [row[-COMPLETION:] for row in rows],
        "logprobs": [[0.0] * COMPLETION for _ in rows],
        "env_mask": [[1] * COMPLETION for _ in rows],
    }


def rloo_prompts(world_size: int) -> list[str]:
    """Without shuffling, each step's prompts, one a rank: one of 405 tokens (``test_trainer_rloo``'s
    system prompt five times and a task; its 4 rows share it), then on 2 ranks one of 2 tokens; on 3,
    one of about 330 and one of about 80 (their own trees: on 3 ranks a short third prompt would let
    the plan split the long tree over two ranks, each recomputing its prompt, rather than spread it)."""
    from test_trainer_rloo import SYSTEM  # here: that module sets an environment variable on import

    others = {2: ["ab"], 3: ["list: " + SYSTEM * 4, "ab " + SYSTEM]}[world_size]
    return [SYSTEM * 5 + "solve: 12+7=", *others] * 4


def sft_rows(world_size: int) -> Dataset:
    """Tokenized SFT samples, every token scored, two steps' worth in order: :func:`busy_rows` of the
    launch (``PER_RANK`` a rank), the long one on the first rank, then on the last."""
    rows = busy_rows(world_size, PER_RANK[world_size])
    return Dataset.from_dict({"input_ids": rows + rows[1:] + rows[:1]})


DPO_PROMPTS = {2: [440, 12, 12, 12], 3: [440, 380, 80]}
"""A DPO step's prompt lengths, rank-major, ``len // world`` pairs a rank: one prompt three budgets
long; on 3 ranks the others about 380 and 80 (two short ones let the plan split the long prompt's two
rows over two ranks, each recomputing the prompt, rather than spread it)."""


def dpo_pairs(world_size: int) -> Dataset:
    """Text preference pairs, two steps' worth in order: :data:`DPO_PROMPTS` (the agent tokenizer's
    tokens, a character each), the long prompt on the first rank, then the same reversed (on the last);
    the answers " yes" and " no", and an EOS."""
    rng = np.random.default_rng(0)
    lengths = DPO_PROMPTS[world_size]
    prompts = ["".join(rng.choice(list("abcdefghij "), n)) for n in lengths + lengths[::-1]]
    return Dataset.from_dict({"prompt": prompts, "chosen": [" yes"] * len(prompts), "rejected": [" no"] * len(prompts)})


FUSED = {"sft": sft_rows, "dpo": dpo_pairs}
"""The fused-head trainers' context-parallel case, ``test_trainer_fused_ddp``'s worker over each
trainer's test case ``FUSED_CASE``: two steps' samples in order, SGD."""
FUSED_CASE = "busy-context-parallel"


def _fused(out: Path, trainer: str) -> None:
    """``sft`` or ``dpo`` (``-fsdp2``: sharded), stock then HARTS: ``test_trainer_fused_ddp``'s worker
    on :data:`FUSED`'s samples; its records as ``<kind>-cp-stock.pt`` and ``<kind>-cp-harts.pt``."""
    import test_trainer_dpo
    import test_trainer_fused_ddp
    import test_trainer_sft

    kind, _, wrapper = trainer.partition("-")
    world = int(os.environ["WORLD_SIZE"])
    harts = {k: v for k, v in overrides(world).items() if k.startswith("harts_")}
    data = FUSED[kind](world)
    case = dict(
        data=data,
        per_device_train_batch_size=len(data) // (2 * world),
        max_steps=2,
        train_sampling_strategy="sequential",
        **harts,
    )
    (test_trainer_sft if kind == "sft" else test_trainer_dpo).CASES[FUSED_CASE] = case
    test_trainer_fused_ddp._worker(out, wrapper or "ddp", {f"{kind}-cp": FUSED_CASE})


def _rloo(out: Path) -> None:
    """Stock RLOO, then HARTS, 2 steps each on :func:`rloo_prompts`; rank 0 saves the parameters after
    every step."""
    from datasets import Dataset
    from test_trainer_rloo import length_reward
    from trainer_args import Snapshots, sgd_args
    from trl import RLOOConfig, RLOOTrainer

    from harts_hf.sources.tokenizer import build_tokenizer
    from harts_hf.trainers import HARTSRLOOConfig, HARTSRLOOTrainer

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    harts = {k: v for k, v in overrides(world).items() if k.startswith("harts_")}
    for name, trainer_cls, config_cls, extra in (
        ("stock", RLOOTrainer, RLOOConfig, {}),
        ("harts", HARTSRLOOTrainer, HARTSRLOOConfig, harts),
    ):
        args = sgd_args(
            out / f"rloo-{name}",
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=8,
            max_steps=2,
            learning_rate=0.05,
            beta=0.0,
            shuffle_dataset=False,
        )
        trainer = trainer_cls(
            model=str(out / "qwen3_5"),
            reward_funcs=length_reward,
            args=config_cls(**args, **extra),
            processing_class=build_tokenizer(),
            train_dataset=Dataset.from_dict({"prompt": rloo_prompts(world)}),
        )
        snaps = Snapshots()
        trainer.add_callback(snaps)
        trainer.train()
        gathered = trainer.accelerator.gather(snaps.params[-1][None])
        if trainer.accelerator.is_main_process:
            record = {"params": snaps.params, "ranks_agree": bool((gathered == gathered[0]).all())}
            torch.save(record, out / f"{name}-rloo.pt")


if __name__ == "__main__":  # not on import: the test imports CASE into a process other tests share
    from harts_hf.trainers.teardown import end_distributed

    out, trainer = Path(sys.argv[1]), sys.argv[2]
    made, planner = [], step.plan

    def recorded(*args, **kwargs):
        made.append(planner(*args, **kwargs))
        return made[-1]

    step.plan = recorded
    if trainer.startswith(tuple(FUSED)):
        _fused(out, trainer)
    else:
        with (
            pytest.MonkeyPatch.context() as patch,
            fsdp2_trainers(patch) if trainer.endswith("-fsdp2") else contextlib.nullcontext(),
        ):
            if trainer.startswith("grpo"):
                ddp.CASES[CASE] = overrides(int(os.environ["WORLD_SIZE"]))
                test_trainer_exactness.branching_rollout = busy_rollout  # what ``ddp._worker`` imports for system=False
                ddp._worker(out, [CASE])
            else:
                _rloo(out)
    groups = [(p.groups, p.group_ranks, (p.tokens.sum(axis=1) > 0).tolist(), p.num_slots) for p in made]
    torch.save(groups, out / f"groups-{dist.get_rank()}.pt")
    end_distributed()
