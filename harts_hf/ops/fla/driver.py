"""Runs a tree batch's linear-attention waves (``waves.py``) on a per-kind segment kernel.

The same job as ``linear_attention.run_tree_linear_attention`` (same arguments, same results),
but each wave is ONE path-major varlen call in the inputs' own dtype (bf16 stays bf16, as in
trajectory-wise fla training; states fp32), and states move through the bank of ``waves.py``.

Segment kernel signature (``public_ops.py``, ``diagonal.py``, ``delta.py``)::

    kernel(q, k, v, g, beta, h0, wave, *, scale, chunks) -> (o, h_chunks, h_final)
        q, k [1, T, H, K]; v [1, T, H, V]; g [1, T, H] or [1, T, H, K]; beta [1, T, H] or None;
        h0 [S, H, K, V] fp32; wave: the :class:`Wave` (cu_seqlens); chunks: whether the per-chunk
        start states are needed (then differentiable: [NT, H, K, V] fp32, one per chunk of the
        kernel's own chunk size, which must divide C: fla's is 64; else None);
        o [1, T, H, V]; h_final [S, H, K, V] fp32.

Legend: R replayed context tokens, N piece tokens, H value heads, K key dim, V value dim, E external states.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..rounds import context_replay_of, input_table
from ..tree_batch import TreeBatch
from .waves import Waves, waves_of

__all__ = ["SegmentKernel", "run_waves"]

SegmentKernel = Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]


def run_waves(
    kernel: SegmentKernel,
    batch: TreeBatch,
    chunk_size: int,
    *,
    cut: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    scale: float,
    context: Mapping[str, torch.Tensor] | None = None,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every wave of ``batch`` through ``kernel``; q, k [N, Hk, K] (expanded here to v's H heads),
    v [N, H, V], g, beta as the kind takes them. Returns o [N, H, V] in v's dtype and the states
    after ``batch.state_out[chunk_size]`` [S, H, K, V] fp32 (None if not asked)."""
    waves: Waves = waves_of(batch, chunk_size, cut)
    rounds = waves.rounds
    own = {"q": q, "k": k, "v": v, "g": g} | ({} if beta is None else {"beta": beta})
    rounds.check_inputs(own, context, initial_states)
    heads = v.shape[1]
    expand = lambda x: x.repeat_interleave(heads // x.shape[1], dim=1)
    own |= {"q": expand(q), "k": expand(k)}
    ctx = {} if context is None else dict(context)
    if "k" in ctx:
        ctx["k"] = expand(ctx["k"])
    replayed = context_replay_of(batch, chunk_size).numel()
    tables = {name: input_table(x, ctx.get(name) if name != "q" else None, replayed) for name, x in own.items()}

    H, K, V = heads, k.shape[-1], v.shape[-1]
    zeros = v.new_zeros(1, H, K, V, dtype=torch.float32)
    bank = {0: zeros if initial_states is None else torch.cat((zeros, initial_states.float()))}
    outs = []
    for w, wave in enumerate(waves.waves):
        packed = {name: t[wave.gather].unsqueeze(0) for name, t in tables.items()}  # [1, T, ...]
        h0 = wave.h0.take(bank)
        o, h_chunks, h_final = kernel(
            packed["q"],
            packed["k"],
            packed["v"],
            packed["g"],
            packed.get("beta"),
            h0,
            wave,
            scale=scale,
            chunks=not cut,
        )
        outs.append(o[0])
        if h_chunks is not None:
            bank[1 + 2 * w] = h_chunks[:: h_chunks.shape[0] * chunk_size // o.shape[1]]  # every C-chunk's
        bank[2 + 2 * w] = h_final
    o = torch.cat(outs)[waves.own_index].to(v.dtype)  # [N, H, V]
    return o, None if waves.state_out is None else waves.state_out.take(bank)
