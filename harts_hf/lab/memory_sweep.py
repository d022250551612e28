"""``harts-hf memory``: peak memory and step time against trajectory length at one microbatch budget.

Workload per length L: one tree, a prompt of ``L // 2`` random token ids (in ``[3, vocab)``, seeded
by the seed and L) shared by ``COMPLETIONS`` = 2 completions of ``L - L // 2`` ids each: the longest
trajectory is L tokens, the forest ``L // 2 + 2 * (L - L // 2)`` compact tokens.

Modes per length, each one forward + backward of the same per-token loss (fixed seeded weights
times the log-probs, summed):

- ``harts``: the patched model planned under the budget with its memory model
  (:func:`~harts_hf.engine.memory_model`), run by :class:`~harts_hf.TreeEngine` on the replay path
  the trainer's step takes: slots grow with L while every microbatch stays within the budget; the
  predicted peak is the plan's largest ``peak_bytes``. The step time counts compiling the units;
- ``one unit``: the same, the forest in one microbatch (budget = its compact tokens), where
  ``2 L <= one_unit_max_tokens``: what the pieces cost in time, and the memory they save;
- ``stock``: the unpatched model on the trajectories as one batch ``[G, L]`` (equal lengths: no
  padding), log-probs gathered from an fp32 log-softmax as TRL does, where ``L <= stock_max_tokens``.

Parameter gradients are allocated before every measured run (training's steady state), so a peak
is the step's activations and transients (what the memory model prices) plus what the engine
keeps between units. Measured peaks (:class:`~.memory.PeakMemory`): torch's allocator's peak
above entry, the live tensor bytes (on CPU tracked in a run of its own, which is not timed).
Seconds are the fastest of ``repeats`` runs, peaks the highest.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..engine import TreeEngine, memory_model
from ..forest import RolloutForest
from ..modeling import patch_model, unpatch_model
from ..planner import MemoryModel, Plan, plan
from .config import DTYPES, check_model_options
from .memory import PeakMemory
from .models import build_model
from .modes import step_clock, token_logprobs
from .plan_report import legend

__all__ = ["COMPLETIONS", "MemorySweepConfig", "memory_sweep", "memory_table", "plot_memory_sweep", "sweep_forest"]

COMPLETIONS = 2
MODES = ("harts", "one_unit", "stock")
_MB = 1 << 20
_COLORS = {"harts": "#dd8452", "one_unit": "#4c72b0", "stock": "#9e9e9e"}
_CPU_NOTE = "CPU peaks: torch's allocator (live tensor bytes) above the step's start, from the profiler's memory events"
_LABELS = {"harts": "harts (pieces)", "one_unit": "harts, one unit", "stock": "stock"}

COLUMNS = {
    "L": f"tokens of the longest trajectory (a prompt of L/2 shared by {COMPLETIONS} completions of L/2)",
    "slots": "microbatches harts' plan runs under the budget",
    "harts MB": "measured peak of harts' step above what was held before it",
    "pred MB": "the memory model's peak: the plan's largest microbatch (peak_bytes); an upper bound that prices "
    "attention's score buffers at their full size (fixed), which small microbatches do not fill",
    "err": "measured / predicted - 1 (positive: the memory model underestimates; far below 0: small microbatches "
    "under the fixed term, e.g. -41% to -51% at a 1,024-token budget against -2% to -6% at 4,096 on qwen3_5 quick)",
    "s": "seconds of the step (forward + backward; harts: compiling the units too), fastest of the repeats",
    "1-unit": "harts with the whole forest in one microbatch (- beyond --one-unit-max-tokens)",
    "stock": f"the unpatched model, one [{COMPLETIONS}, L] batch (- beyond --stock-max-tokens)",
}


@dataclass
class MemorySweepConfig:
    model: str = field(default="qwen3_5", metadata={"help": "model family (harts_hf.lab.BENCH_FAMILIES)"})
    size: str = field(default="quick", metadata={"help": "model size (harts_hf.lab.SIZES)"})
    lengths: tuple[int, ...] = field(
        default=(2048, 4096, 8192, 16384, 32768), metadata={"help": "longest-trajectory lengths to sweep (>= 2)"}
    )
    budget: int = field(default=8192, metadata={"help": "harts' microbatch budget (max_tokens_per_microbatch)"})
    one_unit_max_tokens: int = field(
        default=16384, metadata={"help": "run harts as one unit where the trajectories' 2L tokens are at most this"}
    )
    stock_max_tokens: int = field(
        default=8192, metadata={"help": "run stock where L is at most this (its attention may be quadratic)"}
    )
    repeats: int = field(default=1, metadata={"help": "runs per mode and length; the fastest counts"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    dtype: str = field(default="fp32", metadata={"help": "model and compute dtype: fp32 or bf16"})
    seed: int = field(default=0, metadata={"help": "seed of the model weights, the token ids and the loss weights"})

    def __post_init__(self) -> None:
        check_model_options(self.model, self.size, self.dtype, self.device)
        self.lengths = tuple(sorted(set(self.lengths)))
        if not self.lengths or min(self.lengths) < 2:
            raise ValueError(
                f"lengths must be whole numbers >= 2 (a trajectory of one token has no log-prob): {self.lengths}"
            )
        counts = {k: getattr(self, k) for k in ("budget", "one_unit_max_tokens", "stock_max_tokens", "repeats")}
        if bad := {k: v for k, v in counts.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}:
            raise ValueError(f"these must be positive whole numbers: {bad}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def sweep_forest(length: int, vocab: int, *, seed: int = 0) -> RolloutForest:
    """The workload of ``length`` (module docstring): one prompt, :data:`COMPLETIONS` completions."""
    rng = np.random.default_rng([seed, length])
    prompt = rng.integers(3, vocab, length // 2)
    tails = rng.integers(3, vocab, (COMPLETIONS, length - length // 2))
    return RolloutForest.from_sequences(np.concatenate([np.broadcast_to(prompt, (COMPLETIONS, prompt.size)), tails], 1))


def _plan(forest: RolloutForest, budget: int, memory: MemoryModel) -> Plan:
    try:
        return plan(forest, world_size=1, max_tokens_per_microbatch=budget, memory_model=memory)
    except ValueError as err:
        raise ValueError(f"length {forest.max_length:,}: {err}") from err


def _measure(model: torch.nn.Module, repeats: int, bar: tqdm, step: Callable[..., torch.Tensor], *args) -> dict:
    """Peak MB (the highest), seconds (the fastest) and loss of ``repeats`` runs of ``step(model,
    *args)``, each from zeroed (allocated) gradients; where tracking memory slows a run (CPU), the
    peak comes from one more run of its own."""
    device = model.get_output_embeddings().weight.device
    untimed = int(PeakMemory(device).slows)
    peaks, seconds = [], []
    for run in range(untimed + repeats):
        model.zero_grad(set_to_none=False)
        meter, timed = PeakMemory(device), run >= untimed
        with meter if meter.tracks(timed) else contextlib.nullcontext():
            began = step_clock(device)[0]
            loss = step(model, *args)
            elapsed = step_clock(device)[0] - began
        if meter.tracks(timed):
            peaks.append(meter.peak_bytes)
        if timed:
            seconds.append(elapsed)
        bar.update()
    return {"peak_mb": max(peaks) / _MB, "seconds": float(min(seconds)), "loss": float(loss)}


def _tree_loss(model: torch.nn.Module, forest: RolloutForest, the_plan: Plan, weights: torch.Tensor) -> torch.Tensor:
    """The engine's forward and backward of the loss on ``forest`` under ``the_plan``; the loss, detached."""
    return TreeEngine(model, forest, the_plan).backward(lambda lps: (lps[0] * weights).sum())


def _stock_loss(model: torch.nn.Module, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The unpatched model's forward and backward of the loss on ``ids`` [G, L]; the loss, detached."""
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    loss = (token_logprobs(logits, ids) * weights).sum()
    loss.backward()
    return loss.detach()


def memory_sweep(config: MemorySweepConfig, *, progress: bool = True) -> dict:
    """Run ``config``'s sweep (module docstring) and return its record: the config, the model, its
    memory model and budget, and per length the plan's slots and each mode's peak, seconds and loss
    (None where the mode's cap leaves it out). Every plan is made before the first run: a budget
    that cannot hold a length raises ValueError at once."""
    device = torch.device(config.device)
    bench = build_model(
        config.model, config.size, seed=config.seed, dtype=config.torch_dtype, max_positions=max(32768, *config.lengths)
    )
    model = patch_model(bench.model.to(device))
    memory = memory_model(model)
    vocab = model.get_input_embeddings().num_embeddings
    forests = [sweep_forest(n, vocab, seed=config.seed) for n in config.lengths]
    plans = {
        "harts": [_plan(f, config.budget, memory) for f in forests],
        "one_unit": [
            _plan(f, f.num_compact_tokens, memory) if f.num_trajectory_tokens <= config.one_unit_max_tokens else None
            for f in forests
        ],
    }
    stock = [n <= config.stock_max_tokens for n in config.lengths]
    for p in model.parameters():  # allocated once, outside every measured run
        p.grad = torch.zeros_like(p)
    runs = (len(forests) + sum(p is not None for p in plans["one_unit"]) + sum(stock)) * (
        config.repeats + PeakMemory(device).slows
    )
    bar = tqdm(total=runs, disable=not progress, desc="harts-hf memory", unit="run")
    rng = np.random.default_rng(config.seed)
    entries = []
    for i, forest in enumerate(forests):
        weights = torch.as_tensor(rng.standard_normal((COMPLETIONS, forest.max_length - 1)), dtype=torch.float32)
        weights = weights.to(device)  # [G, L - 1]
        entry = {
            "length": forest.max_length,
            "compact_tokens": forest.num_compact_tokens,
            "slots": plans["harts"][i].num_slots,
        }
        patch_model(model)
        for mode in ("harts", "one_unit"):
            if (the_plan := plans[mode][i]) is None:
                entry[mode] = None
                continue
            bar.set_postfix_str(f"L {forest.max_length:,} {mode}")
            result = _measure(model, config.repeats, bar, _tree_loss, forest, the_plan, weights)
            predicted = float(the_plan.peak_bytes.max()) / _MB
            error = result["peak_mb"] / predicted - 1
            entry[mode] = {"slots": the_plan.num_slots, "predicted_mb": predicted, "error": error, **result}
        entry["stock"] = None
        if stock[i]:
            bar.set_postfix_str(f"L {forest.max_length:,} stock")
            unpatch_model(model)
            ids = torch.as_tensor(forest.padded(forest.tokens[forest.restore], fill=0), device=device)  # [G, L]
            entry["stock"] = _measure(model, config.repeats, bar, _stock_loss, ids, weights)
        entries.append(entry)
    bar.close()
    patch_model(model)
    model.zero_grad(set_to_none=True)
    budget = memory.budget(max_tokens=config.budget)
    return {
        "config": dataclasses.asdict(config),
        "model": {
            "family": bench.family,
            "layers": model.config.num_hidden_layers,
            "hidden": model.config.hidden_size,
            "vocab": vocab,
            "params": sum(p.numel() for p in model.parameters()),
        },
        "memory_model": memory.as_dict(),
        "budget": {
            "tokens": budget.tokens,
            "context_weight": budget.context_weight,
            "bytes": float(memory(config.budget)),
            "longest_trajectory": budget.longest_trajectory,
        },
        "lengths": entries,
    }


def _title(record: dict) -> list[str]:
    """Two lines: the model and budget; the memory model the plans priced microbatches with."""
    c, m, mm, b = record["config"], record["model"], record["memory_model"], record["budget"]
    model = (
        f"{m['family']} {c['size']} ({m['params'] / 1e6:.1f}M params, {c['dtype']}, {c['device']}), budget "
        f"{b['tokens']:,} tokens per microbatch ({b['bytes'] / _MB:.0f} MB without context)"
    )
    memory = (
        f"memory model: {mm['token'] / 1024:.1f} KiB per own token, {mm['context'] / 1024:.1f} KiB per context "
        f"token (weight {b['context_weight']:.3f}), {mm['head'] / 1024:.1f} KiB per LM-head row up to "
        f"{mm['head_chunk']:,} rows, {mm['fixed'] / _MB:.0f} MB fixed"
    )
    return [model, memory]


def _cells(result: dict | None) -> tuple[str, str]:
    if result is None:
        return "-", "-"
    return f"{result['peak_mb']:.1f}", f"{result['seconds']:.2f}"


def memory_table(record: dict) -> str:
    """The sweep as text: a title naming the model, budget and memory model, one row per length, the legend."""
    head = (
        f"{'L':>7}{'slots':>7}{'harts MB':>10}{'pred MB':>9}{'err':>8}{'s':>8}"
        f"{'1-unit MB':>11}{'s':>8}{'stock MB':>10}{'s':>8}"
    )
    lines = [*_title(record), "", head]
    for e in record["lengths"]:
        h = e["harts"]
        err = f"{100 * h['error']:+.1f}%"
        (hm, hs), (um, us), (sm, ss) = _cells(h), _cells(e["one_unit"]), _cells(e["stock"])
        lines.append(
            f"{e['length']:>7,}{e['slots']:>7}{hm:>10}{h['predicted_mb']:>9.1f}{err:>8}{hs:>8}"
            f"{um:>11}{us:>8}{sm:>10}{ss:>8}"
        )
    if record["config"]["device"] == "cpu":
        lines += ["", _CPU_NOTE]
    return "\n".join(lines + ["", legend(COLUMNS)])


def plot_memory_sweep(record: dict, path: str | Path) -> None:
    """Draw ``record`` (:func:`memory_sweep`) to ``path``: peak MB and step seconds against length
    (log2 axis) for harts (its prediction dashed), harts as one unit and stock; a caption names the
    model, budget and memory model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, sec) = plt.subplots(1, 2, figsize=(10.5, 5.0), dpi=120)
    entries = record["lengths"]

    def line(ax, mode: str, key: str, **style) -> None:
        points = [(e["length"], e[mode][key]) for e in entries if e[mode] is not None and e[mode][key] is not None]
        if points:
            x, y = zip(*points)
            ax.plot(x, y, marker="o", color=_COLORS[mode], **style)

    for mode in MODES:
        line(mem, mode, "peak_mb", label=f"{_LABELS[mode]}, measured")
        line(sec, mode, "seconds", label=_LABELS[mode])
    line(
        mem,
        "harts",
        "predicted_mb",
        linestyle="--",
        markerfacecolor="none",
        label="harts, memory model's bound (prediction)",
    )
    lengths = [e["length"] for e in entries]
    ticks = [f"{e['length']:,}\n{e['slots']} slot{'s' * (e['slots'] > 1)}" for e in entries]
    for ax, ylabel in ((mem, "peak MB of a step (lower is better)"), (sec, "seconds per step (lower is better)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, ticks, fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("L: tokens of the longest trajectory (harts' slots below)", fontsize=9)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    mem.set_title("peak memory", fontsize=9)
    sec.set_title("step time", fontsize=9)
    caption = _title(record) + ([_CPU_NOTE] if record["config"]["device"] == "cpu" else [])
    fig.text(0.01, 0.01, "\n".join(caption), fontsize=8, va="bottom")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path)
    plt.close(fig)
