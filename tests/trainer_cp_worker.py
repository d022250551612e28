"""Worker of ``test_trainer_context_parallel.py`` under ``torchrun`` (gloo, CPU): ``test_trainer_ddp``'s
stock-then-HARTS GRPO run on :func:`busy_rollout`'s rows (one trajectory three budgets long, short rows
on every rank), HARTS with ``harts_context_parallel=True`` under ``cp_plan_worker``'s budget, memory and
cost models; saves each step's plan's context-parallel groups."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import test_trainer_ddp as ddp
import test_trainer_exactness
import torch
import torch.distributed as dist
from cp_plan_worker import BUDGET, SPREAD_CHUNK, SPREAD_COST, busy_rows

from harts_hf.trainers import step

CASE = "dapo-context-parallel-busy"
COMPLETION = 16
PER_RANK = {2: 4, 3: 8}
"""Rows per rank: as in ``test_planner_groups.test_free_time_forms_groups``, every rank busy before the groups."""


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


if __name__ == "__main__":  # not on import: the test imports CASE into a process other tests share
    from harts_hf.trainers.teardown import end_distributed

    ddp.CASES[CASE] = overrides(int(os.environ["WORLD_SIZE"]))
    test_trainer_exactness.branching_rollout = busy_rollout  # what ``ddp._worker`` imports for system=False

    out = Path(sys.argv[1])
    made, planner = [], step.plan

    def recorded(*args, **kwargs):
        made.append(planner(*args, **kwargs))
        return made[-1]

    step.plan = recorded
    ddp._worker(out, [CASE])
    groups = [(p.groups, p.group_ranks, (p.tokens.sum(axis=1) > 0).tolist()) for p in made]
    torch.save(groups, out / f"groups-{dist.get_rank()}.pt")
    end_distributed()
