"""``calibrate_memory(model)``: fit the planner's memory model to the peaks measured on this machine.

:func:`harts_hf.engine.memory_model` derives a model's memory model from what autograd saves and
what the engine keeps (deterministic, no measurement); this measures instead, through the same
engine, the peak memory of forward + backward (``PeakMemory``: CUDA's allocator, or the process's
resident set on Linux CPUs):

- own tokens: one unit over chains of T, 2T, 4T tokens; ``fixed + token * n`` fits the peaks
  after the LM head's chunk (known exactly from the model) is taken off;
- context: a chain of k * T tokens in k units of T (k = 2, 4, 8): the last unit reads the
  (k - 1) T tokens before it, so the peak above one unit's is ``context * (k - 1) * T``.

Both fits are least squares with non-negative coefficients. Gradients are set to None before
each run, so a peak includes allocating them once, as a training step does.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from ..engine import TreeEngine, memory_model
from ..engine.memory import FREE_CONTEXT, chain
from ..planner import MemoryModel, plan
from .memory import PeakMemory

__all__ = ["calibrate_memory", "format_memory_model"]

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
    if measured.peak_bytes is None:
        raise ValueError(f"peak memory cannot be measured on {engine.device} here (CUDA, or Linux for CPU)")
    return float(measured.peak_bytes), int(the_plan.tokens[0, -1]), int(the_plan.context[0, -1])


def calibrate_memory(model: nn.Module, *, tokens: int = 512) -> MemoryModel:
    """The :class:`~harts_hf.planner.MemoryModel` of a patched ``model`` fitted to measured peaks
    (module docstring); ``tokens`` (T, a multiple of the chunk size) sets the sizes measured."""
    derived = memory_model(model)
    head = lambda n: derived.head * np.minimum(n, derived.head_chunk)
    whole = np.array([_peak(model, tokens * k, 1) for k in (1, 2, 4)])  # [3, (peak, own, context)]
    n = whole[:, 1]
    own = whole[:, 0] - head(n)
    fixed, token = np.linalg.lstsq(np.stack([np.ones_like(n), n], axis=1), own, rcond=None)[0]
    if fixed < 0:  # non-negative: refit through the origin
        fixed, token = 0.0, float(own @ n / (n @ n))
    pieces = np.array([_peak(model, tokens, k) for k in PIECES])
    c = pieces[:, 2]
    extra = pieces[:, 0] - (fixed + token * pieces[:, 1] + head(pieces[:, 1]))
    context = max(float(extra @ c / (c @ c)), 0.0)
    return MemoryModel(
        token=max(float(token), 1.0),
        context=context,
        head=derived.head,
        head_chunk=derived.head_chunk,
        fixed=float(fixed),
    )


def format_memory_model(measured: MemoryModel, derived: MemoryModel, title: str) -> str:
    """``title`` and the coefficients measured beside the ones ``memory_model`` derives."""
    rows = [
        ("token", "per own token: activations kept for backward, and its transients"),
        ("context", "per context token: what a piece holds for an ancestor from an earlier slot"),
        ("head", f"per LM-head row, up to {derived.head_chunk} rows (the checkpointed logit chunk)"),
        ("fixed", "per microbatch"),
    ]
    lines = [title, f"  {'':<8} {'measured':>12} {'derived':>12}"]
    for name, meaning in rows:
        a, b = getattr(measured, name), getattr(derived, name)
        lines.append(f"  {name:<8} {a:>10,.0f} B {b:>10,.0f} B  {meaning}")
    weight = lambda m: m.budget(max_tokens=1).context_weight
    lines.append(f"a context token costs {weight(measured):.3f} own tokens measured, {weight(derived):.3f} derived")
    return "\n".join(lines)
