"""``calibrate_memory(model)``: fit the planner's memory model to the peaks measured on this machine.

:func:`harts_hf.engine.memory_model` derives a model's memory model from what autograd saves and
what the engine keeps (deterministic, no measurement); this measures instead, through the same
engine, the peak memory of forward + backward (``PeakMemory``: torch's allocator's peak):

- own tokens: one unit over chains of T, 2T, 4T tokens;
- context: a chain of k * T tokens in k units of T (k = 2, 4, 8): the last unit reads the
  (k - 1) T tokens before it.

``token``, ``context`` and ``fixed`` are fitted jointly (least squares, non-negative, ``fixed``
on a grid); ``head`` and ``layer`` are as derived (the head's chunk is known exactly). Attention's
score buffers grow with a piece's keys up to their cap (``fixed``): measure at the budget you
train with (T of a few thousand tokens), where they have reached it. Gradients are set to None before
each run, so a peak includes allocating them once, as a training step does.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from torch import nn

from ..engine import TreeEngine, memory_model
from ..engine.memory import FREE_CONTEXT, LayerMemory, chain
from ..planner import MemoryModel, plan
from .memory import PeakMemory

__all__ = ["calibrate_memory", "format_breakdown", "format_memory_model"]

PIECES = (2, 4, 8)


def _peak(model: nn.Module, tokens: int, units: int) -> tuple[float, int, int]:
    """(peak bytes, own tokens, context tokens of the last unit) of one forward + backward over a
    chain of ``units * tokens`` tokens cut into ``units`` units."""
    forest = chain(model, units * tokens)
    the_plan = plan(forest, world_size=1, max_tokens_per_microbatch=tokens, memory_model=FREE_CONTEXT)
    engine = TreeEngine(model, forest, the_plan)
    model.zero_grad(set_to_none=True)
    with PeakMemory(engine.device) as measured:
        engine.backward(lambda lps: lps[0].sum())
    model.zero_grad(set_to_none=True)
    return float(measured.peak_bytes), int(the_plan.tokens[0, -1]), int(the_plan.context[0, -1])


def calibrate_memory(model: nn.Module, *, tokens: int = 2048) -> MemoryModel:
    """The :class:`~harts_hf.planner.MemoryModel` of a patched ``model`` fitted to measured peaks
    (module docstring); ``tokens`` (T, a multiple of the chunk size) sets the sizes measured."""
    derived = memory_model(model)
    whole = np.array([_peak(model, tokens * k, 1) for k in (1, 2, 4)])  # [3, (peak, own, context)]
    pieces = np.array([_peak(model, tokens, k) for k in PIECES])

    def through_origin(y: np.ndarray, x: np.ndarray, least: float) -> tuple[float, float]:
        """(slope, squared residual) of y ~ slope * x, the slope at least ``least``."""
        slope = max(float(y @ x / (x @ x)), least)
        return slope, float(np.square(y - slope * x).sum())

    def with_fixed(fixed: float) -> tuple[float, MemoryModel]:
        """The best token and context costs given ``fixed``, and their residual over all peaks."""
        phases = dataclasses.replace(derived, token=1.0, context=0.0, fixed=fixed)
        n = whole[:, 1]
        token, own_error = through_origin(whole[:, 0] - (phases(n) - n), n, 1.0)
        fitted = dataclasses.replace(phases, token=token)
        context, context_error = through_origin(pieces[:, 0] - fitted(pieces[:, 1]), pieces[:, 2], 0.0)
        return own_error + context_error, dataclasses.replace(fitted, context=context)

    grid = np.linspace(0.0, max(whole[:, 0].max(), pieces[:, 0].max()), 129)
    return min((with_fixed(f) for f in grid), key=lambda fit: fit[0])[1]


def format_breakdown(layers: list[LayerMemory]) -> str:
    """:func:`~harts_hf.engine.memory.memory_breakdown` as a table, one row per layer kind."""
    head = f"  {'layer kind':<18}{'layers':>7}{'B/token':>10}{'ckpt B/token':>14}{'K/V B/row':>11}{'B/path':>9}"
    lines = [
        "derived by layer kind: activations kept per own token, checkpointing off and on; what an earlier",
        "slot keeps for a piece: attention's K/V per context row, halos / replay rows / states per path:",
        head,
    ]
    for m in layers:
        lines.append(
            f"  {m.kind:<18}{m.layers:>7}{m.activations:>10,.0f}{m.checkpointed:>14,.0f}{m.kv:>11,.0f}{m.path:>9,.0f}"
        )
    return "\n".join(lines)


def format_memory_model(measured: MemoryModel, derived: MemoryModel, title: str) -> str:
    """``title`` and the coefficients measured beside the ones ``memory_model`` derives."""
    rows = [
        ("token", "per own token: activations kept for backward"),
        ("context", "per context token: what a piece holds for an ancestor from an earlier slot"),
        ("head", f"per LM-head row, up to {derived.head_chunk} rows (the checkpointed logit chunk)"),
        ("layer", "per own token, in the layers' backward (after the head's): gradients, recomputation"),
        ("fixed", "per microbatch, in the layers' backward: attention's score buffers"),
    ]
    lines = [title, f"  {'':<8} {'measured':>12} {'derived':>12}"]
    for name, meaning in rows:
        a, b = getattr(measured, name), getattr(derived, name)
        lines.append(f"  {name:<8} {a:>10,.0f} B {b:>10,.0f} B  {meaning}")
    weight = lambda m: m.budget(max_tokens=1).context_weight
    lines.append(f"a context token costs {weight(measured):.3f} own tokens measured, {weight(derived):.3f} derived")
    return "\n".join(lines)
