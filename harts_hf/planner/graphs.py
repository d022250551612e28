"""Which slots keep their graphs from the recording to their backward, and so are not rerun.

A step of several slots records every microbatch once; a slot whose graph stays alive until its
backward pass is not run again, every other slot is rerun with grad in the backward
(``harts_hf.engine``). Graphs alive together hold what their microbatches save, so the last slots
keep theirs while they fit the microbatch budget in bytes together: walking back from the last
slot, each adds the activations it saves (``token * n + context * c`` under the memory model), and
the largest of their transient phases (the head's chunk, one layer's backward: they run one call
at a time) comes on top once. The last slot keeps its graph whatever the budget (one microbatch, as
in the replay). Empty slots (no unit) save nothing.

FSDP2 narrows what the budget allows (:data:`GRAPH_RULES`): the engine enforces it; the plan
prices it. DDP does not: where call 0 keeps its graph, a closing call syncs (``harts_hf.engine``).
On a GPU a graph the budget cannot hold may instead wait in host memory (``Budget.host_bytes`` of
it; not under FSDP2): its saved tensors go there as its forward makes them and come back as its
backward needs them (``harts_hf.engine.offload``), on a copy stream beside the compute; a slot
whose copies, there and back, would add more than its rerun still reruns (:func:`host_seconds`),
and so do those past the host memory (:func:`host_slots`).

Legend: R ranks, S slots.
"""

from __future__ import annotations

import numpy as np

from .cost import CostModel
from .memory import Budget, MemoryModel

__all__ = ["GRAPH_RULES", "graph_excess", "graph_slots", "host_seconds", "host_slots", "rerun_slots", "unkept"]

GRAPH_RULES = ("budget", "last")
"""What may keep a graph besides the byte budget: ``budget``, any slot it holds (and host memory
the others); ``last``, only the last slot (FSDP2: its parameter groups allow one pending forward
with grad before a backward)."""


def graph_slots(
    memory: MemoryModel, budget: Budget, tokens: np.ndarray, context: np.ndarray, rule: str = "budget"
) -> np.ndarray:
    """[R] how many last slots of every rank keep their graphs (at least 1), for microbatches of
    ``tokens`` [R, S] own tokens reading ``context`` [R, S] under ``rule`` (:data:`GRAPH_RULES`)."""
    if rule not in GRAPH_RULES:
        raise ValueError(f"unknown graph rule {rule!r}; valid: {', '.join(GRAPH_RULES)}")
    num_slots = np.shape(tokens)[1]
    limit = num_slots if rule == "budget" else 1
    fits = _held(memory, tokens, context) <= float(memory(budget.tokens))
    fits[:, 0] = True
    kept = np.argmin(np.c_[fits, np.zeros(len(fits), dtype=bool)], axis=1)  # the first that does not fit
    return np.minimum(kept, limit)


def _held(memory: MemoryModel, tokens: np.ndarray, context: np.ndarray) -> np.ndarray:
    """[R, S] bytes the last k + 1 slots' graphs hold alive together (k = 0 ..), at their peak."""
    saved = memory.saved(tokens, context)  # [R, S] kept until the backward
    phase = np.where(np.asarray(tokens) > 0, memory(tokens, context) - saved, 0.0)  # [R, S] transient, one at a time
    return np.cumsum(saved[:, ::-1], axis=1) + np.maximum.accumulate(phase[:, ::-1], axis=1)


def graph_excess(memory: MemoryModel, budget: Budget, tokens: np.ndarray, context: np.ndarray) -> np.ndarray:
    """[R] bytes by which every slot's graph kept alive would pass the byte budget (<= 0: all fit):
    what a rank's slots must shed so that none reruns."""
    return _held(memory, tokens, context)[:, -1] - float(memory(budget.tokens))


def rerun_slots(num_slots: int, kept: np.ndarray) -> np.ndarray:
    """[R, S] bool: the slots each rank reruns in the backward, all but its ``kept`` [R] last."""
    return np.arange(num_slots) < num_slots - np.asarray(kept)[:, None]


def host_seconds(
    memory: MemoryModel, cost: CostModel, tokens: np.ndarray, context: np.ndarray, seconds: np.ndarray
) -> np.ndarray:
    """[R, S] seconds that keeping each microbatch's graph in host memory adds to it: what it saves
    (``MemoryModel.saved``) goes there during its forward (``forward_share`` of its ``seconds``) and
    back during its backward (the rest), at ``cost.host_byte`` seconds a byte each way, on a copy
    stream: the part of each copy its pass does not hide."""
    copy = cost.host_byte * memory.saved(tokens, context)
    seconds = np.asarray(seconds, dtype=np.float64)
    forward = cost.forward_share * seconds
    return np.maximum(copy - forward, 0.0) + np.maximum(copy - (seconds - forward), 0.0)


def host_slots(
    memory: MemoryModel,
    cost: CostModel,
    budget: Budget,
    tokens: np.ndarray,
    context: np.ndarray,
    seconds: np.ndarray,
    kept: np.ndarray,
    rule: str,
) -> np.ndarray:
    """[R, S] bool: the microbatches (of ``tokens``, ``context`` and ``seconds`` [R, S]) whose graphs
    wait in host memory for their backward: under the ``budget`` rule, of the non-empty ones before
    each rank's ``kept`` [R] last whose copies add less than their rerun, those saving the most
    seconds per byte first, while they fit ``budget.host_bytes`` together."""
    if rule != "budget" or budget.host_bytes <= 0:
        return np.zeros(np.shape(tokens), dtype=bool)
    tokens = np.asarray(tokens)
    saved = memory.saved(tokens, context)
    gain = cost.forward_share * seconds - host_seconds(memory, cost, tokens, context, seconds)
    worth = rerun_slots(tokens.shape[1], kept) & (tokens > 0) & (gain > 0)
    per_byte = np.divide(-gain, saved, out=np.full(saved.shape, np.inf), where=worth)  # [R, S] lowest: best
    order = np.argsort(per_byte, axis=1, kind="stable")
    held = np.cumsum(np.take_along_axis(np.where(worth, saved, 0.0), order, axis=1), axis=1)
    out = np.zeros_like(worth)
    np.put_along_axis(out, order, np.take_along_axis(worth, order, axis=1) & (held <= budget.host_bytes), axis=1)
    return out


def unkept(
    memory: MemoryModel,
    cost: CostModel,
    budget: Budget,
    tokens: np.ndarray,
    context: np.ndarray,
    seconds: np.ndarray,
    kept: np.ndarray,
    rule: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """([R, S] rerun, [R, S] host, [R, S] copies) of the non-empty microbatches before each rank's
    ``kept`` [R] last under ``rule``: those rerun in the backward, those whose graphs wait in host
    memory instead (:func:`host_slots`), and the seconds the latter's copies add (0 elsewhere):
    what the predicted step charges besides the slots (``balance.step_seconds``)."""
    host = host_slots(memory, cost, budget, tokens, context, seconds, kept, rule)
    rerun = rerun_slots(np.shape(tokens)[1], kept) & (np.asarray(tokens) > 0) & ~host
    return rerun, host, np.where(host, host_seconds(memory, cost, tokens, context, seconds), 0.0)
