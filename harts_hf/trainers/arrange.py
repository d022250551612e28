"""Which rows a rank trains, and in which microbatch: TRL's row shuffle, made prefix-aware.

TRL shuffles the generation batch row by row before cutting it into ``steps_per_generation``
microbatches of equal row counts, which scatters the members of a group (and the turns of an
episode) over microbatches and breaks their prefix sharing. Here the rows are sorted in trie order
(rows that share a prefix become neighbours), cut into the same number of equally sized
microbatches, and the microbatches are visited in a random order. The random draw is the one TRL
makes (``torch.randperm`` of the batch), so the RNG stream, hence later sampling, stays in lockstep
with stock training.

Rows only move between microbatches of the same optimizer step: the generation batch's
microbatches are taken in blocks of ``gcd(steps_per_generation, gradient_accumulation_steps)``
(blocks that never straddle an optimizer step), each block holding exactly the rows TRL's shuffle
gives it, and the rows are arranged within each block.

With several processes the ranks all-gather the generation batch and TRL's draws, and per block
plan the rows of every rank's block (:func:`harts_hf.plan`: a tree is divided between ranks where
that lowers the step time); every rank keeps the plan's grouping but exactly the row count stock
TRL gives it (:func:`equal_shares`), so no rank idles and no filler row is needed.

Why the gradient is stock's: the step trains the rows stock TRL trains, in microbatches of stock's
row count, so every loss TRL normalises by a global token count (dapo, cispo, vespo) or by the row
count of a microbatch (grpo, sapo, dr_grpo, luspo) sums to the same value however the rows are
grouped. Options that normalise by a microbatch's own token count or statistics (bnpo, the
entropy bonus, ``top_entropy_quantile``, the MoE aux loss) depend on the grouping: for those the
trainer keeps TRL's own shuffle (``_compat.grouping_dependent_options``).

Legend: B rows of this rank's generation batch, R ranks, S microbatches per generation batch.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..forest import RolloutForest, trie_order
from ..planner import plan
from .rows import row_sequences

__all__ = ["arrange", "batch_sequences", "equal_shares"]


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


def equal_shares(owner: np.ndarray, world_size: int) -> np.ndarray:
    """Ranks for rows given in trie order, ``owner`` [n] the plan's rank of each, such that every rank
    holds n / R rows and each rank's rows stay one run of the plan's order: the rows sorted by (plan
    rank, ranks ordered by their first row; trie position), cut into R equal runs, run j going to
    the j-th rank of that order. Rows move only where the runs' boundaries shift from the plan's; a
    plan whose counts are equal already is kept as it is."""
    n = owner.size
    first = np.full(world_size, n, dtype=np.int64)
    np.minimum.at(first, owner, np.arange(n))
    rank_order = np.argsort(first, kind="stable")
    place = np.empty(world_size, dtype=np.int64)
    place[rank_order] = np.arange(world_size)
    sequence = np.lexsort((np.arange(n), place[owner]))
    out = np.empty(n, dtype=np.int64)
    out[sequence] = rank_order[np.arange(n) // (n // world_size)]
    return out


def arrange(batch: dict, slices: int, accumulation: int, accelerator=None, **plan_options) -> tuple[dict, float | None]:
    """(this rank's rows cut into ``slices`` microbatches, the fraction of all ranks' rows the plans
    moved to another rank than the one that rolled them out, None on one process): per block of
    gcd(slices, ``accumulation``) microbatches (module docstring), the block's rows in trie order, cut
    into the block's microbatches, visited in a random order. With an ``accelerator`` of several
    processes the block's rows are those of every rank, divided by a plan (``plan_options`` go to
    :func:`harts_hf.plan`) into equal shares."""
    n = _num_rows(batch)
    if n % slices:
        raise ValueError(f"the generation batch has {n} rows, not a multiple of steps_per_generation={slices}")
    perm = torch.randperm(n)  # the draw TRL's shuffle makes
    block = math.gcd(slices, accumulation)
    world = accelerator.num_processes if accelerator is not None else 1
    if world > 1:
        full = _gather(batch, accelerator)
        perms = accelerator.gather(perm[None].to(accelerator.device)).cpu().numpy()  # [R, B]
        rows = (perms + n * np.arange(world)[:, None]).reshape(world, slices // block, -1)  # [R, blocks, m]
        rows = rows.transpose(1, 0, 2).reshape(slices // block, -1)  # [blocks, R * m]: every rank's block rows
    else:
        full, rows = batch, perm.numpy().reshape(slices // block, -1)
    seqs = batch_sequences(full)
    arranged, moved = [], 0
    for block_rows, draw in zip(rows, perm.split(block)):
        order = block_rows[trie_order([seqs[r] for r in block_rows])]
        if world > 1:
            result = plan(RolloutForest.from_sequences([seqs[r] for r in order]), world_size=world, **plan_options)
            owner = equal_shares(result.traj_rank[0], world)
            moved += int((owner != order // n).sum())
            order = order[owner == accelerator.process_index]
        arranged.append(_slices_in_random_order(order, draw, block))
    return _take(full, np.concatenate(arranged)), moved / (n * world) if world > 1 else None
