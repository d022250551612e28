"""PyTorch references for fla's state kernels, which Triton's interpreter cannot run: the
diagonal kinds' ``chunk_fwd_h`` and ``chunk_bwd_dh`` (fla/ops/common/chunk_h.py), put in
``harts_hf.ops.fla.diagonal.STATE_KERNELS``, and the delta rule's state forward
(``chunk_gated_delta_rule_fwd_h``, fla/ops/common/chunk_delta_h.py, as launched by
``harts_hf.ops.fla.delta.fwd_h_fp32``), put in ``harts_hf.ops.fla.delta.STATE_KERNELS``. The CPU
tests run every other fla function for real.

Written from the recurrence, with fla's conventions: batch 1 varlen (``cu_seqlens``), chunking
restarting at every sequence start, gates ``g`` [1, T, H] or ``gk`` [1, T, H, K] as chunk-local
cumulative sums in log2 units; h row r = the state at the START of chunk r, dh row r = the
gradient of the state at its END (from ``do`` and ``dht`` only)::

    h_{c+1} = 2^{G_c} h_c + (k_c * 2^{G_c - g})^T v_c,    G_c = g at chunk c's last token
    dh_{c-1} = 2^{G_c} dh_c + scale * (q_c * 2^g)^T do_c,  dh of the last chunk = dht

and for the delta rule (w, u: fla's WY representation of the chunk's keys and values)::

    v_new_c = u_c - w_c h_c,    h_{c+1} = 2^{G_c} h_c + (k_c * 2^{G_c - g})^T v_new_c

(KDA: G_c per key channel, and fla hands k over already multiplied by 2^{G_c - g}).
"""

from __future__ import annotations

from itertools import pairwise

import torch

T = torch.Tensor


def _chunks(cu_seqlens: T, chunk: int) -> list[list[slice]]:
    """Token slices of every chunk of every sequence."""
    return [[slice(s, min(s + chunk, b)) for s in range(a, b, chunk)] for a, b in pairwise(cu_seqlens.tolist())]


def _log_decay(g: T | None, gk: T | None) -> T:
    """[T, H, K or 1] cumulative log2 gates, per key channel or broadcast over it."""
    return gk[0].float() if gk is not None else g[0].float()[..., None]


def chunk_fwd_h(
    k: T,
    v: T,
    h0: T | None,
    output_final_state: bool,
    cu_seqlens: T,
    chunk_size: int,
    states_in_fp32: bool,
    g: T | None = None,
    gk: T | None = None,
) -> tuple[T, T | None]:
    """(h [1, NT, H, K, V], ht [S, H, K, V] fp32 or None) as fla's ``chunk_fwd_h``."""
    lg, k, v = _log_decay(g, gk), k[0].float(), v[0].float()
    H, K, V = k.shape[1], k.shape[2], v.shape[2]
    rows, finals = [], []
    for n, chunks in enumerate(_chunks(cu_seqlens, chunk_size)):
        h = h0[n].float() if h0 is not None else k.new_zeros(H, K, V)
        for sl in chunks:
            rows.append(h)
            last = lg[sl][-1]  # [H, K or 1]
            h = h * last.exp2()[..., None] + torch.einsum("thk,thv->hkv", k[sl] * (last - lg[sl]).exp2(), v[sl])
        finals.append(h)
    out = torch.stack(rows)[None].to(torch.float32 if states_in_fp32 else k.dtype)
    return out, torch.stack(finals) if output_final_state else None


def chunk_bwd_dh(
    q: T,
    k: T,
    v: T,
    do: T,
    h0: T | None,
    dht: T | None,
    scale: float,
    cu_seqlens: T,
    chunk_size: int,
    states_in_fp32: bool,
    g: T | None = None,
    gk: T | None = None,
) -> tuple[T, T | None]:
    """(dh [1, NT, H, K, V], dh0 [S, H, K, V] fp32 or None) as fla's ``chunk_bwd_dh``."""
    lg, q, do = _log_decay(g, gk), q[0].float(), do[0].float()
    H, K, V = q.shape[1], q.shape[2], do.shape[2]
    rows, starts = [], []
    for n, chunks in enumerate(_chunks(cu_seqlens, chunk_size)):
        b = dht[n].float() if dht is not None else q.new_zeros(H, K, V)
        ends = []
        for sl in reversed(chunks):
            ends.append(b)
            b = b * lg[sl][-1].exp2()[..., None] + torch.einsum("thk,thv->hkv", q[sl] * scale * lg[sl].exp2(), do[sl])
        rows += ends[::-1]
        starts.append(b)
    out = torch.stack(rows)[None].to(torch.float32 if states_in_fp32 else k.dtype)
    return out, torch.stack(starts) if h0 is not None else None


def delta_fwd_h(
    k: T, w: T, u: T, g: T, initial_state: T, output_final_state: bool, cu_seqlens: T, chunk_indices: T, chunk_size: int
) -> tuple[T, T, T | None]:
    """(h [1, NT, H, K, V] fp32, v_new [1, T, H, V] in u's dtype, ht [S, H, K, V] fp32 or None)
    as ``harts_hf.ops.fla.delta.fwd_h_fp32``; g chunk-local cumulative log2 gates, [1, T, H]
    (GDN: k decays to the chunk's end here) or [1, T, H, K] (KDA: k comes already decayed)."""
    dtype, per_channel = u.dtype, g.dim() == 4
    lg, k, w, u = (
        _log_decay(None if per_channel else g, g if per_channel else None),
        k[0].float(),
        w[0].float(),
        u[0].float(),
    )
    rows, finals, v_new = [], [], torch.empty_like(u)
    for n, chunks in enumerate(_chunks(cu_seqlens, chunk_size)):
        h = initial_state[n].float()
        for sl in chunks:
            rows.append(h)
            v_new[sl] = u[sl] - torch.einsum("thk,hkv->thv", w[sl], h)
            last = lg[sl][-1]  # [H, K or 1]
            decayed = k[sl] if per_channel else k[sl] * (last - lg[sl]).exp2()
            h = h * last.exp2()[..., None] + torch.einsum("thk,thv->hkv", decayed, v_new[sl])
        finals.append(h)
    return torch.stack(rows)[None], v_new[None].to(dtype), torch.stack(finals) if output_final_state else None


def kda_intra_token_parallel(
    q: T,
    k: T,
    gk: T,
    beta: T,
    Aqk: T,
    Akk: T,
    scale: float,
    cu_seqlens: T,
    chunk_size: int,
    sub_chunk_size: int,
    use_graph: bool = False,
) -> tuple[T, T]:
    """fla's ``chunk_kda_fwd_intra_token_parallel`` (fla/ops/kda/chunk_intra_token_parallel.py):
    the interpreter runs it, but one program per token (minutes on a tree); a reference keeps the
    KDA tests fast. Within each ``sub_chunk_size`` block of a chunk, for j <= t (j < t for Akk)::

        Aqk[t, j mod BT] = scale * sum_k q_t k_j 2^{g_t - g_j},
        Akk[t, j - block start] = beta_t * sum_k k_t k_j 2^{g_t - g_j}

    Entries above the diagonal are zeros here (fla leaves them unwritten; nothing reads them).
    q, k [1, T, H, K]; gk [1, T, H, K] chunk-local cumulative log2 gates; beta [1, T, H];
    Aqk [1, T, H, BT], Akk [1, T, H, BC] fp32, filled in place and returned."""
    bounds = cu_seqlens.tolist()
    for a, b in pairwise(bounds):
        for s in range(a, b, sub_chunk_size):
            e = min(s + sub_chunk_size, b)
            qs, ks, gs = (x[0, s:e].float() for x in (q, k, gk))  # [n, H, K]
            n = e - s
            decay = (gs[:, None] - gs[None, :]).exp2()  # [t, j, H, K]
            upto = torch.ones(n, n, dtype=torch.bool).tril()[..., None]  # [t, j, 1]: j <= t
            qk = torch.where(upto, torch.einsum("thk,jhk,tjhk->tjh", qs, ks, decay) * scale, 0.0)
            kk = torch.einsum("thk,jhk,tjhk->tjh", ks, ks, decay) * beta[0, s:e].float()[:, None]
            kk = torch.where(torch.ones(n, n, dtype=torch.bool).tril(-1)[..., None], kk, 0.0)
            col = (s - a) % chunk_size
            Aqk[0, s:e, :, col : col + n] = qk.transpose(1, 2).to(Aqk.dtype)
            Akk[0, s:e, :, :n] = kk.transpose(1, 2).to(Akk.dtype)
    return Aqk, Akk
