"""The three ways the benchmark trains one batch of rollouts, each timed as forward + backward.

- ``stock``: the unpatched model on padded microbatches of trajectories, the way TRL's GRPO
  trainer feeds them (rows shuffled, split into microbatches, each right-padded to its longest
  row, forward and backward per microbatch);
- ``unshared``: harts-hf on the forest with prefix sharing off (every trajectory its own root);
- ``harts``: harts-hf on the prefix forest, under a budget of the tokens of stock's padded
  microbatch: a forest above it runs as the engine's planned pieces (the trainer's path), one
  graph alive at a time.

Every mode back-propagates the same policy loss (``loss.py``) and returns the per-trajectory
log-probs in one layout, ``[B, max_len - 1]``, so their numerics compare entry by entry.

Legend: B trajectories, b rows of a microbatch, L padded length, V vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..engine import TreeEngine, memory_model
from ..forest import RolloutForest
from ..modeling import patch_model, tree_logprobs, unpatch_model
from ..planner import Plan, plan
from .loss import policy_loss

__all__ = [
    "Batch",
    "StepResult",
    "StockMode",
    "TreeMode",
    "step_clock",
    "stock_rows",
    "token_logprobs",
    "trajectory_logprobs",
]


@dataclass(frozen=True)
class Batch:
    """What every mode trains on: the rollouts' forest (trajectory order = the workload's) and
    the per-trajectory advantages."""

    forest: RolloutForest
    advantages: np.ndarray  # [B]

    @property
    def loss_mask(self) -> np.ndarray:
        """[B, max_len - 1] the token predicted at column t (token t + 1) is trained."""
        return self.forest.padded(self.forest.loss_mask, fill=False)[:, 1:]

    @property
    def trained_tokens(self) -> int:
        return max(1, int(self.loss_mask.sum()))


@dataclass
class StepResult:
    """Wall seconds of one step's phases, the process CPU seconds beside them (less sensitive to
    other processes on a shared machine), and the step's log-probs."""

    forward_s: float
    backward_s: float
    forward_cpu_s: float
    backward_cpu_s: float
    logprobs: torch.Tensor  # [B, max_len - 1] detached, on CPU, fp32

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def step_cpu_s(self) -> float:
        return self.forward_cpu_s + self.backward_cpu_s


def step_clock(device: torch.device) -> np.ndarray:
    """(wall, process CPU) seconds, after the device's queued work finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return np.array([time.perf_counter(), time.process_time()])


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[b, L - 1] log p(ids[:, t + 1]) from logits [b, L, V] (fp32 softmax, as TRL)."""
    logp = logits[:, :-1].float().log_softmax(-1)
    return logp.gather(-1, ids[:, 1:, None])[..., 0]


def stock_rows(batch_rows: int, max_len: int, token_budget: int) -> int:
    """Rows per stock microbatch: the largest power of two whose padded tokens fit the budget."""
    fit = max(1, token_budget // max(1, max_len))
    return min(batch_rows, 1 << (fit.bit_length() - 1))


class StockMode:
    """The unpatched model on shuffled, right-padded microbatches of ``rows`` trajectories."""

    name = "stock"

    def __init__(self, batch: Batch, device: torch.device, rows: int, seed: int = 0):
        forest = batch.forest
        self.device = device
        self.rows = rows
        self.shape = (forest.num_trajectories, forest.max_length - 1)
        self.trained = batch.trained_tokens
        ids = forest.padded(forest.tokens[forest.restore], fill=0)  # [B, max_len]
        valid = forest.padded(np.ones(forest.num_trajectory_tokens, dtype=bool), fill=False)
        mask = batch.loss_mask
        order = np.random.default_rng(seed).permutation(forest.num_trajectories)
        self.microbatches = []
        for start in range(0, order.size, rows):
            r = order[start : start + rows]
            width = int(forest.lengths[r].max())
            as_t = lambda a: torch.as_tensor(a, device=device)
            self.microbatches.append(
                (
                    torch.as_tensor(r),
                    as_t(ids[r, :width]),
                    as_t(valid[r, :width].astype(np.int64)),
                    as_t(mask[r, : width - 1]),
                    as_t(batch.advantages[r]),
                )
            )

    def step(self, model: torch.nn.Module) -> StepResult:
        unpatch_model(model)
        out = torch.zeros(self.shape)
        fwd = bwd = np.zeros(2)
        for rows, ids, attn, mask, adv in self.microbatches:
            t0 = step_clock(self.device)
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            lp = token_logprobs(logits, ids) * attn[:, 1:]
            loss = policy_loss(lp, adv, mask, self.trained)
            t1 = step_clock(self.device)
            loss.backward()
            t2 = step_clock(self.device)
            fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
            out[rows, : lp.shape[1]] = lp.detach().float().cpu()
            del logits, lp, loss
        return StepResult(fwd[0], bwd[0], fwd[1], bwd[1], out)


class TreeMode:
    """harts-hf on ``forest`` (the prefix forest, or every trajectory its own root), in one model
    call, or with ``max_tokens`` in the microbatches the plan makes under that budget (context
    priced by the model's memory model, as the trainer prices it; planned at the first step)."""

    def __init__(
        self, name: str, batch: Batch, forest: RolloutForest, device: torch.device, max_tokens: int | None = None
    ):
        self.name = name
        self.forest = forest
        self.trained = batch.trained_tokens
        self.mask = torch.as_tensor(batch.loss_mask, device=device)
        self.advantages = torch.as_tensor(batch.advantages, device=device)
        self.device = device
        self.max_tokens = max_tokens
        self.plan: Plan | None = None

    def microbatches(self, model: torch.nn.Module) -> Plan | None:
        """The plan under ``max_tokens`` of the patched ``model``, None if there is no budget."""
        if self.max_tokens is not None and self.plan is None:
            budget = dict(max_tokens_per_microbatch=self.max_tokens, memory_model=memory_model(model))
            self.plan = plan(self.forest, world_size=1, **budget)
        return self.plan

    def step(self, model: torch.nn.Module) -> StepResult:
        patch_model(model)
        pieces = self.microbatches(model)
        t0 = step_clock(self.device)
        if pieces is None or pieces.num_slots == 1:
            lp = tree_logprobs(model, self.forest)
        else:  # recorded now; the backward replays every piece but the last, in reverse
            lp = TreeEngine(model, self.forest, pieces).attached_logprobs()[0]
        loss = policy_loss(lp, self.advantages, self.mask, self.trained)
        t1 = step_clock(self.device)
        loss.backward()
        t2 = step_clock(self.device)
        fwd, bwd = t1 - t0, t2 - t1
        return StepResult(fwd[0], bwd[0], fwd[1], bwd[1], lp.detach().float().cpu())


@torch.no_grad()
def trajectory_logprobs(model: torch.nn.Module, forest: RolloutForest, device: torch.device) -> torch.Tensor:
    """[B, max_len - 1] the unpatched model on each trajectory alone (no padding, no batch)."""
    unpatch_model(model)
    out = torch.zeros(forest.num_trajectories, forest.max_length - 1)
    for i, seq in enumerate(forest.trajectories()):
        if seq.size < 2:
            continue
        ids = torch.as_tensor(seq, device=device)[None]
        out[i, : seq.size - 1] = token_logprobs(model(input_ids=ids, use_cache=False).logits, ids)[0].cpu()
    return out
