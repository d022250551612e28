"""A segment kernel of the zero-extra-round layout (``waves.py``, ``cut=False``) made of fla's
naive references, for testing the fla backend's glue without a GPU: the wave's segments run one
chunk step at a time through ``fla_naive_segments`` (the segments that have chunk j, from the
states after chunk j - 1), so every chunk's start state is a differentiable output."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from fla_naive_segments import naive_segments

T = torch.Tensor


def naive_chunk_states(kind: str, chunk: int):
    """``kind``'s naive segment kernel, returning the start state of each ``chunk``-token chunk."""
    step = naive_segments(kind)

    def kernel(q, k, v, g, beta, h0, wave, *, scale, chunks, l2=False):
        cu = wave.cu_seqlens_cpu.numpy().astype(np.int64)
        counts = np.diff(cu) // chunk  # segments are whole chunks
        first = np.cumsum(counts) - counts
        h, outs, slots, states, rows = h0, [], [], [], []
        for j in range(counts.max()):
            live = np.flatnonzero(counts > j)
            tokens = (cu[live, None] + j * chunk + np.arange(chunk)).reshape(-1)
            sub = SimpleNamespace(cu_seqlens_cpu=torch.arange(live.size + 1, dtype=torch.int32) * chunk)
            inputs = (None if x is None else x[:, tokens] for x in (q, k, v, g, beta))
            live_t = torch.as_tensor(live)
            states.append(h[live_t])
            rows.append(first[live] + j)
            o, _, ht = step(*inputs, h[live_t], sub, scale=scale, chunks=False, l2=l2)
            h = h.index_copy(0, live_t, ht)
            outs.append(o)
            slots.append(tokens)
        o = torch.cat(outs, dim=1)[:, torch.as_tensor(np.argsort(np.concatenate(slots)))]
        h_chunks = torch.cat(states)[torch.as_tensor(np.argsort(np.concatenate(rows)))]
        return o, h_chunks if chunks else None, h

    return kernel
