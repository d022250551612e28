"""Worker of ``test_trainer_handoffs.py`` under ``torchrun`` (gloo, CPU): ``test_trainer_ddp``'s
stock-then-HARTS GRPO run on :func:`task_rollout`'s rows, HARTS with ``harts_handoffs=True`` and a cost
model where moving a chain costs nothing (so the plans hand the task prompts over); saves each step's
plan's handoffs."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import test_trainer_ddp as ddp
import test_trainer_exactness
import torch
import torch.distributed as dist

from harts_hf.trainers import step

FREE_COMM = {"token": 1e-5, "pair": 0.0, "round": 0.0, "microbatch": 0.0, "byte": 0.0, "message": 0.0}
CASE = "dapo-handoffs-tasks"
OVERRIDES = {
    "loss_type": "dapo",
    "harts_handoffs": True,
    "harts_cost_model": FREE_COMM,
    "per_device_train_batch_size": 4,
    "system": False,
}


def task_rollout(prompts: list[str], trainer) -> dict:
    """``handoff_plan_worker.tasks_forest``'s shape from the step's 8 rows (4 a rank): a 5-token
    system prompt and a 60-token task, the first for rows 0-5, the second for rows 6-7, then 14 prompt
    and 16 completion tokens of the row's own."""
    rng = np.random.default_rng(0)
    system, tasks = rng.integers(8, 100, 5).tolist(), [rng.integers(8, 100, 60).tolist() for _ in range(2)]
    out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
    for j in range(len(prompts)):
        row = trainer.accelerator.process_index * len(prompts) + j
        own = np.random.default_rng([1, row]).integers(8, 100, 30).tolist()
        out["prompt_ids"].append(system + tasks[row >= 6] + own[:14])
        out["completion_ids"].append(own[14:])
        out["logprobs"].append([0.0] * 16)
        out["env_mask"].append([1] * 16)
    return out


if __name__ == "__main__":  # not on import: the test imports CASE into a process other tests share
    from harts_hf.trainers.teardown import end_distributed

    ddp.CASES[CASE] = OVERRIDES
    test_trainer_exactness.branching_rollout = task_rollout  # what ``ddp._worker`` imports for system=False

    out = Path(sys.argv[1])
    made, planner = [], step.plan

    def recorded(*args, **kwargs):
        made.append(planner(*args, **kwargs))
        return made[-1]

    step.plan = recorded
    ddp._worker(out, [CASE])
    torch.save([p.handoffs for p in made], out / f"handoffs-{dist.get_rank()}.pt")
    end_distributed()
