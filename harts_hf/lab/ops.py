"""Micro-benchmark of the tree kernels: one layer's forward + backward on a rollout forest vs the
same kernel run trajectory by trajectory.

The trajectory-wise baseline is the same op on ``RolloutForest.from_sequences(seqs,
share_prefixes=False)``: every trajectory its own root, so the kernel, its packing and its
overheads are identical and only the sharing differs. Ideal speedups: the token compression for
the token-linear kinds (conv, linear attention), the attended-pair ratio for attention (pairs of a
forest = sum over compact tokens of position + 1). Linear kinds also report ``grid_ideal``, the
ratio of chunk slots of :func:`~harts_hf.ops.rounds.rounds_of`'s C-slot layout (chunk-padded paths,
replays of the parent's tokens up to the branch point included; the fla backend's layout). It is also
the ratio of chunk counts, so of the work every chunked kernel does per chunk whatever the chunk's
length (read each head's K x V start state, write its end state, and again in backward). At small
scales paths are not much longer than a chunk and the grid ideal lies far below the token ideal
(swe-like with one task: 1.66x vs 5.62x at CPU_SCALE, 3.41x vs 5.97x at scale 0.02, 4.53x vs 5.98x at
0.05); the cheaper a kind's per-token work (simple GLA), the nearer its speedup lands to the grid
ideal. (Where the trajectory-wise tensors outgrow the caches, a speedup can pass the token ideal: KDA
and GLA at 0.02.) The torch backend computes the ragged layout of
:func:`~harts_hf.ops.ragged_layout.ragged_layout_of` (exact starts, no replay of piece tokens, chunks at
their length rounded up to 8): ``slot_ideal`` is the ratio of its slots, ``replayed``
and ``padding`` count the tree run's slots that hold no own token (replayed context tokens; padding).

Where the time goes, for linear kinds: ``intra_speedup`` times the kernel's chunk-local half
(``ChunkKernel.intra``: intra-chunk scores, decays) alone on each forest's chunks: per-token work
that sharing divides by the slot ratio or more (a short chunk's scores cost less per token);
``rest_speedup`` is the speedup of everything else (the chunk-to-chunk scan, the mid-chunk states
child paths start from, gathers), mostly per-chunk state work that sharing divides by about the chunk
ratio. The whole speedup lies between the two, weighted by their shares of the trajectory-wise time
(swe-like at CPU_SCALE, over several runs: intra 5.0-5.6x, rest 0.6-4.0x).

``harts-hf bench-ops`` times on one CPU thread with glibc keeping freed memory
(:func:`keep_freed_memory`), so the numbers measure the kernels rather than thread scheduling on a
shared machine or page faults on the bigger trajectory-wise tensors.

Legend: N tokens of a forest (compact or trajectory-wise), H heads, K key dim, V value dim,
D conv channels, W conv width.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..chunking import CHUNK_SIZE
from ..forest import RolloutForest
from ..ops.attention import tree_attention
from ..ops.conv import tree_causal_conv1d
from ..ops.gated_delta import GDN_KERNEL, tree_gated_delta_rule
from ..ops.gla import GLA_KERNEL, SIMPLE_GLA_KERNEL, tree_gla, tree_simple_gla
from ..ops.kda import KDA_KERNEL, tree_kda
from ..ops.linear_attention import ChunkKernel
from ..ops.ragged_layout import ragged_layout_of
from ..ops.rounds import rounds_of
from ..ops.tree_batch import TreeBatch
from .fla_report import fallback_note, sequential_calls
from .plan_report import legend

__all__ = ["KINDS", "LINEAR_KINDS", "bench_ops", "format_table", "keep_freed_memory"]

LINEAR_KINDS = ("gated_delta", "kda", "gla", "simple_gla")
KINDS = ("attention", "conv", *LINEAR_KINDS)
KERNELS: dict[str, ChunkKernel] = {
    "gated_delta": GDN_KERNEL,
    "kda": KDA_KERNEL,
    "gla": GLA_KERNEL,
    "simple_gla": SIMPLE_GLA_KERNEL,
}  # the torch backend's kernel of each linear kind (its chunk-local half is timed alone)
HEADS, HEAD_DIM = 4, 64  # linear kinds: H = 4, K = V = 64
ATTN_HEADS = 8  # attention: 8 heads x 64
CONV_DIM, CONV_WIDTH = 256, 4


@dataclass(frozen=True)
class _Case:
    """One kind on one forest: leaf inputs, the output gradient(s) and the op."""

    inputs: tuple[torch.Tensor, ...]
    grad: torch.Tensor | tuple[torch.Tensor, ...]
    op: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse: no fresh mapping per big block, no trimming.

    Eager CPU ops allocate a new tensor per op; glibc maps every block above 32 MiB anew and the
    kernel zero-fills it page by page, so a forest-sized baseline spends more time in page faults
    than in arithmetic (85 of 210 s were system time at scale 0.01), which inflates speedups. A
    process-wide setting, for the benchmark process only; False where the C library is not glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # mallopt parameters, glibc's malloc.h
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).requires_grad_()


def _linear_inputs(kind: str, gen: torch.Generator, *lead: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, g (a log-decay < 0, per key channel for KDA / GLA), and beta for the delta-rule kinds,
    each [*lead, H, ...]: the inputs of linear ``kind``, whole layer or chunk-local half alike."""
    q, k, v = (_randn(gen, *lead, HEADS, HEAD_DIM) for _ in range(3))
    gate_shape = (*lead, HEADS, *(HEAD_DIM,) * (kind in ("kda", "gla")))
    g = (-F.softplus(torch.randn(*gate_shape, generator=gen)) * 0.1).requires_grad_()
    beta = (torch.rand(*lead, HEADS, generator=gen).requires_grad_(),) if kind in ("gated_delta", "kda") else ()
    return (q, k, v, g, *beta)


def _case(kind: str, batch: TreeBatch, gen: torch.Generator) -> _Case:
    """Realistic small-layer inputs (fp32) for ``kind`` on ``batch``."""
    n = batch.num_tokens
    if kind == "attention":
        q, k, v = (_randn(gen, n, ATTN_HEADS, HEAD_DIM) for _ in range(3))
        out_shape = (n, ATTN_HEADS, HEAD_DIM)
        op = lambda q, k, v: tree_attention(q, k, v, batch, scale=HEAD_DIM**-0.5)
        inputs = (q, k, v)
    elif kind == "conv":
        inputs = (_randn(gen, n, CONV_DIM), _randn(gen, CONV_DIM, CONV_WIDTH, scale=0.5), _randn(gen, CONV_DIM))
        out_shape = (n, CONV_DIM)
        op = lambda x, w, b: tree_causal_conv1d(x, w, b, batch, activation="silu")
    else:
        inputs = _linear_inputs(kind, gen, n)
        out_shape = (n, HEADS, HEAD_DIM)
        if kind in ("gated_delta", "kda"):
            fn = tree_gated_delta_rule if kind == "gated_delta" else tree_kda
            op = lambda q, k, v, g, beta: fn(q, k, v, g, beta, batch, use_qk_l2norm=True, chunk_size=CHUNK_SIZE)[0]
        else:
            fn = tree_gla if kind == "gla" else tree_simple_gla
            op = lambda q, k, v, g: fn(q, k, v, g, batch, chunk_size=CHUNK_SIZE)[0]
    return _Case(inputs, torch.randn(*out_shape, generator=gen), op)


def _intra_case(kind: str, batch: TreeBatch, gen: torch.Generator) -> _Case:
    """The chunk-local half of linear ``kind`` alone (``ChunkKernel.intra``), as the torch driver runs
    it on ``batch``: once per chunk length of the ragged layout, on that length's chunks of every round."""
    kernel, layout = KERNELS[kind], ragged_layout_of(batch, CHUNK_SIZE)
    blocks = [  # per chunk length: q, k, v, g[, beta] [T, L, H, ...]
        _linear_inputs(kind, gen, n, length) for length, n in zip(layout.lengths, layout.chunks)
    ]
    inputs, width = [x for block in blocks for x in block], len(blocks[0])

    def op(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        parts = (xs[i : i + width] for i in range(0, len(xs), width))
        return tuple(
            out
            for q, k, v, g, *beta in parts
            for out in kernel.intra(q, k, v, g, beta[0] if beta else None, scale=HEAD_DIM**-0.5)
        )

    with torch.no_grad():
        grads = tuple(torch.randn(out.shape, generator=gen) for out in op(*inputs))
    return _Case(tuple(inputs), grads, op)


def _run(case: _Case) -> float:
    """Seconds of one forward + backward (input gradients reset first)."""
    for x in case.inputs:
        x.grad = None
    start = time.perf_counter()
    torch.autograd.backward(case.op(*case.inputs), case.grad)
    return time.perf_counter() - start


def _attended_pairs(forest: RolloutForest) -> int:
    """(query, key) pairs causal attention computes on ``forest``: sum over tokens of position + 1."""
    return int(forest.position.sum()) + forest.num_compact_tokens


def _chunk_slots(batch: TreeBatch) -> int:
    """Packed token slots of the C-slot layout: every path's chunks times the chunk size."""
    return int(rounds_of(batch, CHUNK_SIZE).path_chunks.sum()) * CHUNK_SIZE


def _ragged_slots(batch: TreeBatch) -> tuple[int, int]:
    """(slots, slots holding a token) the torch backend's linear kinds compute (``ragged_layout_of``)."""
    gather = ragged_layout_of(batch, CHUNK_SIZE).gather
    zero_row = rounds_of(batch, CHUNK_SIZE).context_replay.numel() + batch.num_tokens
    return gather.numel(), int((gather < zero_row).sum())


def bench_ops(
    sequences: Sequence[Sequence[int]],
    kinds: Sequence[str] = KINDS,
    *,
    repeats: int = 3,
    seed: int = 0,
    threads: int | None = None,
    keep_memory: bool = False,
    progress: bool = True,
) -> dict[str, object]:
    """Time each kind's forward + backward on the forest of ``sequences`` and trajectory-wise.

    One warm-up run per variant builds the per-batch index structures (shared by every layer of a
    model, so not timed) and warms the allocator; then ``repeats`` interleaved tree / trajectory
    runs, of which the medians are kept. ``threads`` sets torch's CPU threads for the run (on a
    shared machine one thread is steadier: a stalled thread delays every parallel op);
    ``keep_memory`` calls :func:`keep_freed_memory` (process-wide) once the arguments are checked.

    Returns the forest statistics and, per kind: ``tree_ms``, ``traj_ms``, ``speedup``, ``ideal``,
    ``of_ideal`` (speedup / ideal), ``rounds`` / ``traj_rounds`` (sequential kernel calls per
    layer), and ``grid_ideal``, ``slot_ideal``, ``replayed``, ``padding``, ``tree_intra_ms``,
    ``traj_intra_ms``, ``intra_speedup``, ``rest_speedup`` (None where the chunk-local half took longer
    than the whole) for the linear kinds (see the module docstring); ``kept_memory`` says whether freed
    memory was kept.
    """
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown kinds {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    kept = keep_memory and keep_freed_memory()
    with _torch_threads(threads):
        return _bench(sequences, kinds, repeats, seed, progress) | {"kept_memory": kept}


@contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """torch's CPU thread count set to ``threads`` (unchanged if None) inside the block."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _bench(
    sequences: Sequence[Sequence[int]], kinds: Sequence[str], repeats: int, seed: int, progress: bool
) -> dict[str, object]:
    """:func:`bench_ops` with validated arguments."""
    forests = {
        "tree": RolloutForest.from_sequences(sequences),
        "traj": RolloutForest.from_sequences(sequences, share_prefixes=False),
    }
    batches = {name: TreeBatch.from_forest(f) for name, f in forests.items()}
    tree, traj = forests["tree"], forests["traj"]
    pair_ratio = _attended_pairs(traj) / _attended_pairs(tree)
    gen = torch.Generator().manual_seed(seed)
    results: dict[str, dict[str, object]] = {}
    runs = sum(4 if kind in LINEAR_KINDS else 2 for kind in kinds) * (repeats + 1)
    bar = tqdm(total=runs, desc="bench-ops", unit="run", disable=not progress)
    for kind in kinds:
        bar.set_postfix_str(kind)
        linear = kind in LINEAR_KINDS
        cases = {name: _case(kind, b, gen) for name, b in batches.items()}
        if linear:
            cases |= {f"{name}_intra": _intra_case(kind, b, gen) for name, b in batches.items()}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for rep in range(repeats + 1):
            for name, case in cases.items():
                seconds = _run(case)
                if rep:  # rep 0 is the warm-up
                    times[name].append(seconds)
                bar.update()
        tree_s, traj_s = (statistics.median(times[name]) for name in ("tree", "traj"))
        ideal = pair_ratio if kind == "attention" else tree.compression
        row: dict[str, object] = {
            "tree_ms": 1e3 * tree_s,
            "traj_ms": 1e3 * traj_s,
            "speedup": traj_s / tree_s,
            "ideal": ideal,
            "of_ideal": traj_s / tree_s / ideal,
            "rounds": sequential_calls(kind, batches["tree"], CHUNK_SIZE) if linear else 1,
            "traj_rounds": sequential_calls(kind, batches["traj"], CHUNK_SIZE) if linear else 1,
            "note": fallback_note(kind, batches["tree"], CHUNK_SIZE),
        }
        if linear:
            slots, filled = _ragged_slots(batches["tree"])
            row["grid_ideal"] = _chunk_slots(batches["traj"]) / _chunk_slots(batches["tree"])
            row["slot_ideal"] = _ragged_slots(batches["traj"])[0] / slots
            row["replayed"] = filled - tree.num_compact_tokens
            row["padding"] = slots - filled
            tree_intra, traj_intra = (statistics.median(times[f"{name}_intra"]) for name in ("tree", "traj"))
            row["tree_intra_ms"], row["traj_intra_ms"] = 1e3 * tree_intra, 1e3 * traj_intra
            row["intra_speedup"] = traj_intra / tree_intra
            row["rest_speedup"] = (traj_s - traj_intra) / (tree_s - tree_intra) if tree_s > tree_intra else None
        results[kind] = row
    bar.close()
    return {
        "trajectories": tree.num_trajectories,
        "trajectory_tokens": tree.num_trajectory_tokens,
        "compact_tokens": tree.num_compact_tokens,
        "compression": tree.compression,
        "attended_pair_ratio": pair_ratio,
        "chunk_size": CHUNK_SIZE,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "kinds": results,
    }


COLUMNS = {
    "tree ms": "median ms of one layer's forward + backward on the prefix forest (lower is better)",
    "traj ms": "the same kernel with one root per trajectory: no sharing (lower is better)",
    "speedup": "traj ms / tree ms (higher is better)",
    "ideal": "speedup if time followed the work: token compression (attention: attended-pair ratio)",
    "of ideal": "speedup / ideal (1 = all the sharing became time; higher is better)",
    "grid ideal": "linear kinds: ratio of chunk slots in the fla backend's chunk-padded layout",
    "slot ideal": "linear kinds: ratio of slots in the torch backend's ragged layout",
    "intra": "speedup of the chunk-local half alone (intra-chunk scores, decays; higher is better)",
    "rest": "speedup of the rest: chunk-to-chunk scan, mid-chunk states, gathers (-: intra took longer than all)",
    "rounds": "sequential kernel calls per layer on the forest (vs trajectory-wise; fewer is better)",
}
"""The table's legend (the module docstring has the full definitions)."""


def format_table(report: dict[str, object]) -> str:
    """The forest line and per-kind results of :func:`bench_ops` as an aligned text table, its
    legend, then the fallback notes."""
    forest = (
        f"{report['trajectories']:,} trajectories, {report['trajectory_tokens']:,} trajectory tokens -> "
        f"{report['compact_tokens']:,} compact ({report['compression']:.2f}x), attended pairs "
        f"{report['attended_pair_ratio']:.2f}x; median of {report['repeats']}, {report['threads']} thread(s)"
    )
    head = (
        "kind",
        "tree ms",
        "traj ms",
        "speedup",
        "ideal",
        "of ideal",
        "grid ideal",
        "slot ideal",
        "intra",
        "rest",
        "rounds",
    )
    ratio = lambda x: "-" if x is None else f"{x:.2f}x"
    rows = [head]
    for kind, r in report["kinds"].items():
        rows.append(
            (
                kind,
                f"{r['tree_ms']:.1f}",
                f"{r['traj_ms']:.1f}",
                f"{r['speedup']:.2f}x",
                f"{r['ideal']:.2f}x",
                f"{r['of_ideal']:.2f}",
                *(ratio(r.get(name)) for name in ("grid_ideal", "slot_ideal", "intra_speedup", "rest_speedup")),
                f"{r['rounds']} (vs {r['traj_rounds']})",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    table = "\n".join(
        "  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    )
    notes = "".join(f"\nnote: {r['note']}" for r in report["kinds"].values() if r.get("note"))
    return forest + "\n" + table + "\n\n" + legend(COLUMNS) + notes
