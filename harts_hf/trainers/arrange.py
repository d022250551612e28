"""Which rows a rank trains, and in which microbatch: TRL's row shuffle, made prefix-aware.

TRL shuffles the generation batch row by row before cutting it into ``steps_per_generation``
microbatches, which scatters the members of a group (and the turns of an episode) over
microbatches and breaks their prefix sharing. Here the rows are sorted in trie order (rows that
share a prefix become neighbours), cut into the same number of equally sized microbatches, and the
microbatches are visited in a random order. The random draw is the one TRL makes
(``torch.randperm`` of the batch), so the RNG stream, hence later sampling, stays in lockstep with
stock training.

Rows only move between microbatches of the same optimizer step: when a generation batch spans
several optimizer steps (``steps_per_generation`` not dividing ``gradient_accumulation_steps``),
its microbatches are taken in blocks of ``gcd(steps_per_generation, gradient_accumulation_steps)``
(blocks that never straddle an optimizer step), each block holding exactly the rows TRL's shuffle
gives it, and the rows are arranged within each block. So every optimizer step trains the rows stock
TRL trains, and its gradient is unchanged: every loss TRL normalises by a global token count (dapo,
cispo, vespo) or by the row count of equally sized microbatches (grpo, sapo, dr_grpo, luspo) sums to
the same value however the step's rows are grouped into microbatches. bnpo, the entropy bonus,
``top_entropy_quantile`` (its threshold), the MoE aux loss and the per-microbatch logged metrics (kl,
entropy, clip ratios) are computed per microbatch in TRL itself, so they depend on the grouping
(TRL's own shuffle already draws a random one); with one microbatch per block they are exact too.

With several processes (:func:`distribute`) the ranks all-gather the generation batch, compute the
same plan over it, and each keeps the rows whose trajectories the plan assigns to it (a row's loss
lives on one rank; ranks exchange only gradients). Ranks must run the same number of equally
sized microbatches, so short ranks get filler rows: copies of one of their prompts with an empty
completion (zero loss, and no new compact tokens: the prompt is already in the forest).

Legend: B rows, R ranks, S microbatches per generation batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ..forest import RolloutForest
from ..planner import Plan, plan
from .rows import row_sequences

__all__ = ["arrange_local", "batch_sequences", "distribute", "trie_order"]


def trie_order(seqs: Sequence[np.ndarray]) -> np.ndarray:
    """Row indices in lexicographic (DFS pre-order) order of their token sequences."""
    keys = [np.asarray(s, dtype=np.int64).astype(">u8").tobytes() for s in seqs]
    return np.asarray(sorted(range(len(seqs)), key=keys.__getitem__), dtype=np.int64)


def batch_sequences(batch: dict) -> list[np.ndarray]:
    """The real tokens (prompt then completion) of every row of a TRL generation batch."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return row_sequences(ids, mask)


def _num_rows(batch: dict) -> int:
    return int(batch["prompt_ids"].size(0))


def _take(batch: dict, rows: np.ndarray) -> dict:
    """Every row-valued entry (tensor or list) indexed by ``rows``; 0-d tensors and None kept."""
    n = _num_rows(batch)
    index = torch.as_tensor(rows, dtype=torch.long)
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0 and value.size(0) == n:
            out[key] = value[index.to(value.device)]
        elif isinstance(value, list) and len(value) == n:
            out[key] = [value[i] for i in rows]
        else:
            out[key] = value
    return out


def _slices_in_random_order(order: np.ndarray, perm: torch.Tensor, slices: int) -> np.ndarray:
    """``order`` cut into ``slices`` equal runs, the runs permuted by the rank order of ``perm[:slices]``."""
    size = order.size // slices
    visit = torch.argsort(perm[:slices]).numpy()
    return np.concatenate([order[s * size : (s + 1) * size] for s in visit])


def arrange_local(batch: dict, slices: int, accumulation: int) -> dict:
    """This rank's rows cut into ``slices`` microbatches: per block of gcd(slices, ``accumulation``)
    microbatches (module docstring), the rows TRL's shuffle gives the block, in trie order, cut into
    the block's microbatches, visited in a random order."""
    perm = torch.randperm(_num_rows(batch))  # the draw TRL's shuffle makes
    block = math.gcd(slices, accumulation)
    seqs = batch_sequences(batch)
    arranged = []
    for rows, draw in zip(perm.numpy().reshape(slices // block, -1), perm.split(block)):
        order = rows[trie_order([seqs[r] for r in rows])]
        arranged.append(_slices_in_random_order(order, draw, block))
    return _take(batch, np.concatenate(arranged))


def _gather(batch: dict, accelerator) -> dict:
    """All ranks' rows, rank-major; 2-D entries padded to a common width (prompts on the left)."""
    out = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            out[key] = value
            continue
        if value.ndim == 2:
            value = accelerator.pad_across_processes(value, dim=1, pad_index=0, pad_first=key.startswith("prompt"))
        out[key] = accelerator.gather(value)
    return out


def distribute(batch: dict, slices: int, accelerator, **plan_options) -> tuple[dict, Plan, int]:
    """(this rank's rows arranged as by :func:`arrange_local`, the plan, rows per microbatch).

    ``batch`` is this rank's generation batch; the result holds the rows the plan gives this rank
    plus filler rows, the same count on every rank. ``plan_options`` go to :func:`harts_hf.plan`.
    """
    perm = torch.randperm(_num_rows(batch))  # the draw TRL's shuffle makes
    full = _gather(batch, accelerator)
    seqs = batch_sequences(full)
    world, rank = accelerator.num_processes, accelerator.process_index
    result = plan(RolloutForest.from_sequences(seqs), world_size=world, **plan_options)
    owner = result.traj_rank[0]  # [R * B]
    per_rank = -(-int(np.bincount(owner, minlength=world).max()) // slices) * slices
    mine = np.flatnonzero(owner == rank)
    filler = per_rank - mine.size
    source = mine[0] if mine.size else rank * _num_rows(batch)
    rows = np.concatenate([mine, np.full(filler, source, dtype=np.int64)])
    out = _take(full, rows)
    is_filler = torch.zeros(rows.size, dtype=torch.bool)
    is_filler[mine.size :] = True
    out["completion_mask"] = out["completion_mask"].masked_fill(is_filler[:, None].to(out["completion_mask"].device), 0)
    out["advantages"] = out["advantages"].masked_fill(
        is_filler.to(out["advantages"].device).view(-1, *[1] * (out["advantages"].ndim - 1)), 0.0
    )
    order = trie_order(batch_sequences(out))  # fillers are prompt-only rows now
    return _take(out, _slices_in_random_order(order, perm, slices)), result, per_rank // slices
