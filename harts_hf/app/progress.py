"""What a run prints (a ``TrainerCallback``, main process only): one opening line (model, data,
trainer, devices, budget), a progress bar and one line per logged step (reward, loss, compression,
speed), and a closing summary. TRL's full metrics still go to the configured loggers (``report_to``)."""

from __future__ import annotations

import statistics

import torch
from tqdm.auto import tqdm
from transformers import TrainerCallback

from ..planner.cost import cost_origin

__all__ = ["StepLine"]


def _mean(logs: list[dict], key: str) -> float | None:
    values = [h[key] for h in logs if key in h]
    return statistics.mean(values) if values else None


def _names(value: str | list[str]) -> str:
    return "+".join(value) if isinstance(value, list) else str(value)


class StepLine(TrainerCallback):
    """The console of a training run (module docstring). ``title`` names the model and the data
    (e.g. ``"builtin:qwen3_5-quick on the ledger tool environment"``), ``method`` the trainer's
    (``"GRPO"``, ``"SFT"``, ...); its loss type, the devices and the budget are read from the run's
    arguments."""

    bar = None
    first_step = 0

    def __init__(self, title: str = "", method: str = "GRPO") -> None:
        self.title, self.method = title, method

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        self.first_step = state.global_step  # past 0 when resumed from a checkpoint
        harts = getattr(args, "harts_enable", False)
        loss = getattr(args, "loss_type", None)  # RLOO has none, DPO a list
        what = f"{'HARTS' if harts else 'stock'} {self.method}" + (f" (loss {_names(loss)})" if loss else "")
        params = f", {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params" if model is not None else ""
        devices = f"{args.world_size} process{'es' if args.world_size > 1 else ''} on {args.device.type}"
        if args.device.type == "cpu":  # torch's default (one per core) contends on a busy machine
            threads = torch.get_num_threads()
            devices += f", {threads} thread{'s' if threads > 1 else ''} each (OMP_NUM_THREADS)"
        size = (
            f"{args.harts_max_tokens_per_microbatch:,} tokens"
            if args.harts_max_bytes_per_microbatch is None
            else f"{args.harts_max_bytes_per_microbatch / 2**20:,.0f} MiB"
        )
        budget = ""
        if harts:
            origin = cost_origin(args.harts_planner_cost_model)
            budget = f"; one plan per step, {size} per slot (predicted seconds: {origin})"
        rows = args.per_device_train_batch_size * args.gradient_accumulation_steps
        tqdm.write(
            f"{what}: {self.title}{params}; {state.max_steps} steps of {rows} rows per device, {devices}{budget}"
        )
        self.bar = tqdm(total=state.max_steps, desc="training", unit="step", dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is None or not logs or "loss" not in logs:
            return
        parts = [f"step {state.global_step:>3}/{state.max_steps}"]
        if "reward" in logs:  # RL trainers
            parts.append(f"reward {logs['reward']:.3f}")
        parts.append(f"loss {logs['loss']:+.4f}")
        if "harts/compression" in logs:
            parts.append(f"compression {logs['harts/compression']:.2f}x")
            parts.append(f"{logs['harts/tokens_per_second']:,.0f} traj tok/s in fwd+bwd")
            if "harts/microbatches" in logs:
                parts.append(f"{logs['harts/microbatches']:.0f} slot(s)")
            if args.world_size > 1:
                parts.append(f"rank imbalance {logs['harts/rank_imbalance']:.2f}")
        if "step_time" in logs:  # TRL's RL trainers time each step
            parts.append(f"step {logs['step_time']:.1f} s (incl. rollout)")
        tqdm.write("  ".join(parts))

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is None:
            return
        self.bar.close()
        logs = [h for h in state.log_history if "loss" in h and h.get("step", 0) > self.first_step]
        rewards = [h["reward"] for h in logs if "reward" in h]
        parts = [f"done: {state.global_step - self.first_step} steps"]
        if self.first_step:  # a resumed run: its own steps, not the restored history's
            parts[0] += f" ({self.first_step + 1}-{state.global_step}, resumed after step {self.first_step})"
        runtime = next((h["train_runtime"] for h in reversed(state.log_history) if "train_runtime" in h), None)
        if runtime is not None:
            parts[0] += f" in {runtime:.1f} s"
        if rewards:
            parts.append(f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f}")
        elif logs:
            parts.append(f"loss {logs[0]['loss']:.4f} -> {logs[-1]['loss']:.4f}")
        compression, speed = _mean(logs, "harts/compression"), _mean(logs, "harts/tokens_per_second")
        if compression is not None:
            parts.append(f"compression {compression:.2f}x (each shared token computed once)")
            parts.append(f"{speed:,.0f} traj tok/s in fwd+bwd; `harts-hf train-compare` measures stock beside it")
        tqdm.write("; ".join(parts))
