"""Run the benchmark: one process, one model, one batch of rollouts, interleaved repetitions.

Every repetition runs each mode once (the order rotates between repetitions, so drift in the
machine's speed spreads over all modes); the first ``warmup`` repetitions are not timed and the
medians of the rest are reported. Gradients are set to None before every step, so each step's
peak memory includes allocating them; on CPU, where tracking the allocator slows a step, peaks
come from the warm-up repetitions (none without one). Numerics come from the last repetition.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from ..forest import RolloutForest
from ..modeling import patch_model
from ..ops.rounds import rounds_of
from ..ops.tree_batch import TreeBatch
from ..sources import get_workload
from .config import BenchConfig
from .flops import FlopModel
from .loss import grpo_advantages
from .memory import PeakMemory
from .models import BenchModel, build_model
from .modes import (
    Batch,
    StepResult,
    StockMode,
    TreeMode,
    stock_rows,
    trajectory_logprobs,
)

__all__ = ["MODES", "PHASES", "BenchRun", "run_bench"]

MODES = ("stock", "unshared", "harts")
PHASES = ("forward", "backward", "step")


@dataclass
class BenchRun:
    """Everything one run measured; ``report.bench_record`` turns it into the JSON record."""

    config: BenchConfig
    bench_model: BenchModel
    forest: RolloutForest
    rounds: int
    flops: FlopModel
    stock_rows: int
    harts_microbatches: int
    samples: dict[str, list[StepResult]] = field(default_factory=dict)
    peak_bytes: dict[str, int | None] = field(default_factory=dict)
    numerics: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def median(self, mode: str, phase: str, clock: str = "") -> float:
        """Median over the timed repetitions; ``clock="cpu"`` for process CPU seconds."""
        suffix = "_cpu_s" if clock == "cpu" else "_s"
        return statistics.median(getattr(r, phase + suffix) for r in self.samples[mode])


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """All parameter gradients as one fp64 CPU vector (zeros where a parameter got none)."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double().cpu()
            for p in model.parameters()
        ]
    )


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))


def _numerics(
    forest: RolloutForest, last: dict[str, StepResult], grads: dict[str, torch.Tensor], single: torch.Tensor
) -> dict[str, float]:
    valid = torch.as_tensor(forest.padded(np.ones(forest.num_trajectory_tokens, dtype=bool), fill=False)[:, 1:])
    stock = last["stock"].logprobs

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.where(valid, (a - b).abs(), 0.0).max()) if valid.any() else 0.0

    return {
        "max_abs_logprob_diff": diff(last["harts"].logprobs, stock),
        "stock_self_diff": diff(stock, single),
        "grad_cosine": _cosine(grads["harts"], grads["stock"]),
        "unshared_max_abs_logprob_diff": diff(last["unshared"].logprobs, stock),
        "unshared_grad_cosine": _cosine(grads["unshared"], grads["stock"]),
        "harts_vs_unshared_max_abs_logprob_diff": diff(last["harts"].logprobs, last["unshared"].logprobs),
    }


def _planned_microbatches(mode: TreeMode, model: torch.nn.Module) -> int:
    """Plan ``mode`` before any step (the memory model's probe stays out of the measured peaks)."""
    patch_model(model)
    return mode.microbatches(model).num_slots


def run_bench(config: BenchConfig, *, progress: bool = True) -> BenchRun:
    """Time stock, unshared and harts training steps of ``config``'s model on its workload."""
    started = time.perf_counter()
    device = torch.device(config.device)
    bench_model = build_model(config.model, config.size, seed=config.seed, dtype=config.torch_dtype)
    model = bench_model.model.to(device)
    workload = get_workload(config.workload, **config.workload_arguments())
    t0 = time.perf_counter()
    forest = workload.forest()
    build_s = time.perf_counter() - t0
    unshared = RolloutForest.from_sequences(workload.sequences, workload.loss_masks, share_prefixes=False)
    batch = Batch(forest, grpo_advantages(workload.rewards, workload.groups))
    rows = stock_rows(forest.num_trajectories, forest.max_length, config.stock_tokens)
    modes = [
        StockMode(batch, device, rows, config.seed),
        TreeMode("unshared", batch, unshared, device),
        # harts' budget: the tokens of stock's padded microbatch (its memory), not stock_tokens' cap
        TreeMode("harts", batch, forest, device, max_tokens=rows * forest.max_length),
    ]
    run = BenchRun(
        config=config,
        bench_model=bench_model,
        forest=forest,
        rounds=rounds_of(TreeBatch.from_forest(forest), bench_model.arch.chunk).num_rounds,
        flops=FlopModel.of(model, bench_model.arch),
        stock_rows=rows,
        harts_microbatches=_planned_microbatches(modes[-1], model),
        samples={m.name: [] for m in modes},
        peak_bytes={m.name: None for m in modes},
    )
    total_reps = config.warmup + config.reps
    bar = tqdm(total=total_reps * len(modes) + 1, disable=not progress, desc="harts-hf bench", unit="step")
    last: dict[str, StepResult] = {}
    grads: dict[str, torch.Tensor] = {}
    for rep in range(total_reps):
        timed = rep >= config.warmup
        shift = rep % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            bar.set_postfix_str(f"{mode.name} {'rep ' + str(rep - config.warmup + 1) if timed else 'warm-up'}")
            model.zero_grad(set_to_none=True)
            memory = PeakMemory(device)
            tracked = memory.tracks(timed)
            with memory if tracked else contextlib.nullcontext():
                result = mode.step(model)
            if timed:
                run.samples[mode.name].append(result)
            if tracked:
                run.peak_bytes[mode.name] = max(run.peak_bytes[mode.name] or 0, memory.peak_bytes)
            if rep == total_reps - 1:
                last[mode.name] = result
                grads[mode.name] = _flat_grad(model)
            bar.update()
    bar.set_postfix_str("stock, trajectory by trajectory")
    single = trajectory_logprobs(model, forest, device)
    bar.update()
    bar.close()
    model.zero_grad(set_to_none=True)
    run.numerics = _numerics(forest, last, grads, single)
    run.seconds = {"forest_build": build_s, "total": time.perf_counter() - started}
    return run
