"""Segment kernels made of fla's naive references, for testing the fla backend's glue without a
GPU: same signature as ``harts_hf.ops.fla.public_ops`` (a wave's segments, path-major varlen),
run as one right-padded batch through ``fla/ops/<kind>/naive.py`` (padding is the neutral token)."""

from __future__ import annotations

from itertools import pairwise

import torch
from chunk_scan_cases import fla_naive

from harts_hf.ops.gated_delta import l2norm

T = torch.Tensor
_gdn = fla_naive("gated_delta_rule").naive_recurrent_gated_delta_rule
_kda = fla_naive("kda").naive_recurrent_kda
_gla = fla_naive("gla").naive_recurrent_gla
_sgla = fla_naive("simple_gla").naive_recurrent_simple_gla


def _batched(x: T | None, cu: list[int]) -> T | None:
    """[1, T, ...] varlen -> [S, L, ...] right-padded with zeros."""
    if x is None:
        return None
    longest = max(b - a for a, b in pairwise(cu))
    out = x.new_zeros(len(cu) - 1, longest, *x.shape[2:])
    for s, (a, b) in enumerate(pairwise(cu)):
        out[s, : b - a] = x[0, a:b]
    return out


def _unbatched(o: T, cu: list[int]) -> T:
    return torch.cat([o[s, : b - a] for s, (a, b) in enumerate(pairwise(cu))]).unsqueeze(0)


def naive_segments(kind: str):
    """A segment kernel for ``kind`` built on fla's naive recurrent reference."""

    def kernel(q, k, v, g, beta, h0, wave, *, scale, chunks, l2=False):
        assert not chunks
        cu = wave.cu_seqlens_cpu.tolist()
        q, k, v, g, beta = (_batched(x, cu) for x in (q, k, v, g, beta))
        if l2:
            q, k = l2norm(q.float()), l2norm(k.float())
        if kind == "gated_delta":
            o, ht = _gdn(q, k, v, beta, g, scale=scale, initial_state=h0, output_final_state=True)
        elif kind == "kda":
            o, ht = _kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
        elif kind == "gla":
            o, ht = _gla(q * (scale * q.shape[-1] ** 0.5), k, v, g, initial_state=h0, output_final_state=True)
        else:
            o, ht = _sgla(q, k, v, g, scale=scale, initial_state=h0, output_final_state=True)
        return _unbatched(o, cu), None, ht

    return kernel
