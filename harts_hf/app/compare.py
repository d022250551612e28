"""Step time of TRL's GRPOTrainer vs HARTSGRPOTrainer on the same agentic rollouts.

The built-in environment's episodes (per-turn samples by default) are generated once per task,
under a task-seeded RNG that leaves the trainers' own RNG untouched (a first, untimed HARTS run
records them), then replayed to both trainers: both train on identical rows, and the step time
(TRL's ``step_time``: rollout replay, log-prob forwards, backward, optimizer) is what HARTS
changes. Step times are taken as the minimum over the steps (robust to other load on the machine)
and the median beside it.
"""

from __future__ import annotations

import copy
import statistics

import torch
from trl import GRPOTrainer

from ..planner.cost import cost_origin
from ..sources import episode_rollout, ledger_dataset, sample_reward
from ..trainers.config import HARTSGRPOConfig
from ..trainers.grpo import HARTSGRPOTrainer
from .console import quiet_console
from .recipe import AgenticArguments, load_model

__all__ = ["compare", "format_comparison"]


class _Replay:
    """An episode runner that plays each task once (seeded by the task) and replays it after."""

    def __init__(self, runner):
        self.runner, self.cache = runner, {}

    def __call__(self, tasks, episodes_per_task, trainer):
        for task in tasks:
            if task not in self.cache:
                with torch.random.fork_rng():
                    torch.manual_seed(int(task))
                    self.cache[task] = self.runner([task], episodes_per_task, trainer)[0]
        return [self.cache[t] for t in tasks]


def _run(cls, args: HARTSGRPOConfig, model, tokenizer, rollout, script_args: AgenticArguments) -> dict:
    trainer = cls(
        model=copy.deepcopy(model),
        reward_funcs=sample_reward,
        args=args,
        train_dataset=ledger_dataset(script_args.num_tasks),
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    quiet_console(trainer, script_args.verbose)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"step_seconds": [h["step_time"] for h in logs], "losses": [h["loss"] for h in logs], "logs": logs}


def compare(script_args: AgenticArguments, training_args: HARTSGRPOConfig) -> dict:
    """Run both trainers for ``max_steps`` on replayed rollouts; step times, speedup, compression."""
    runner = script_args.runner()
    model, tokenizer = load_model(script_args)
    replay = _Replay(runner)
    rollout = episode_rollout(replay, runner.samples_per_episode)
    _run(HARTSGRPOTrainer, training_args, model, tokenizer, rollout, script_args)  # records the rollouts
    harts = _run(HARTSGRPOTrainer, training_args, model, tokenizer, rollout, script_args)
    stock_args = copy.deepcopy(training_args)
    stock_args.harts_enable = False
    stock = _run(GRPOTrainer, stock_args, model, tokenizer, rollout, script_args)
    t_stock, t_harts = min(stock["step_seconds"]), min(harts["step_seconds"])
    logs = harts["logs"]
    measured = statistics.median(h["harts/step_seconds"] for h in logs)
    predicted = statistics.median(h["harts/predicted_step_seconds"] for h in logs)
    return {
        "model": script_args.model_name_or_path,
        "env_mode": script_args.env_mode,
        "max_turns": script_args.max_turns,
        "rows_per_step": training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
        * training_args.world_size,
        "stock_microbatch_rows": training_args.per_device_train_batch_size,
        "harts_budget": next(iter(training_args.harts_budget.values())),
        "steps_timed": len(logs),
        "compression": statistics.mean(h["harts/compression"] for h in logs),
        "trajectory_tokens": statistics.mean(h["harts/trajectory_tokens"] for h in logs),
        "compact_tokens": statistics.mean(h["harts/compact_tokens"] for h in logs),
        "stock_step_seconds": t_stock,
        "harts_step_seconds": t_harts,
        "speedup": t_stock / t_harts,
        "stock_median_step_seconds": statistics.median(stock["step_seconds"]),
        "harts_median_step_seconds": statistics.median(harts["step_seconds"]),
        "harts_median_forward_seconds": statistics.median(h["harts/forward_seconds"] for h in logs),
        "harts_median_backward_seconds": statistics.median(h["harts/backward_seconds"] for h in logs),
        "processes": training_args.world_size,
        "harts_slots": statistics.mean(h["harts/microbatches"] for h in logs),
        "rank_imbalance": statistics.mean(h["harts/rank_imbalance"] for h in logs),
        "plan_rank_imbalance": statistics.mean(h["harts/plan_imbalance"] for h in logs),
        "median_fwd_bwd_seconds": measured,
        "predicted_fwd_bwd_seconds": predicted,
        "predicted_over_measured": predicted / measured,  # the plan's cost model against this machine
        # of the prediction, what a step spends outside its model calls (host work, gradient all-reduce)
        "predicted_outside_seconds": training_args.harts_planner_cost_model.outside(training_args.world_size),
        "predicted_from": cost_origin(training_args.harts_planner_cost_model),
        "speedup_of_compression": (t_stock / t_harts) / statistics.mean(h["harts/compression"] for h in logs),
        "max_loss_difference": max(abs(a - b) for a, b in zip(stock["losses"], harts["losses"])),
        "threads": torch.get_num_threads(),
    }


def format_comparison(record: dict) -> str:
    width = max(len(k) for k in record)
    lines = []
    for key, value in record.items():
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"{key.replace('_', ' '):<{width}}  {text}")
    return "\n".join(lines)
