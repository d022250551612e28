"""Kimi Delta Attention (KDA) on trees: gated delta rule with a per-channel decay.

Recurrence: ``S_t = diag(exp(g_t)) S_{t-1}``, then ``S_t += beta_t k_t (v_t - k_t^T S_t)^T``,
``o_t = scale * q_t S_t``, with ``g`` [.., H, K]. The chunk-scan kernel follows the shared interface
(see ``linear_attention.py``) and follows transformers' torch ``chunk_kimi_delta_attention``
(models/kimi_linear) step by step, so tree training matches what the stock model computes trajectory
by trajectory to fp32 rounding. Two intra-chunk terms are computed differently for speed, with the
same values: the decayed scores by sub-chunks (:func:`harts_hf.ops.gla.channel_decay_scores`, no
[C, C, K] tensor) and the UT transform by a triangular solve (not row-wise forward substitution).

Shape legend: Tc chunks in a round, T chunks of one length L, C chunk size, H heads, K key dim, V value dim,
P paths, N tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..chunking import CHUNK_SIZE
from .backends import dispatch, register
from .gated_delta import delta_output, delta_state_at, delta_step
from .gla import channel_decay_scores
from .linear_attention import ChunkKernel, chunk_scan, linear_call, linear_inputs_check, run_tree_kind, torch_tables
from .tree_batch import TreeBatch

__all__ = ["KDA_KERNEL", "kda_chunk_scan", "tree_kda"]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """kimi_linear's l2norm (divide by sqrt, not multiply by rsqrt: the rounding transformers' KDA uses)."""
    return x / torch.sqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def kda_intra(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, ...]:
    """Intra-chunk half: q, k [T, L, H, K], v [T, L, H, V], g [T, L, H, K], beta [T, L, H] -> the rows of
    :func:`~harts_hf.ops.gated_delta.delta_step` (shared with GDN)."""
    q, k, v, g = (x.transpose(1, 2).float() for x in (q, k, v, g))  # [T, H, L, K|V]
    beta = beta.transpose(1, 2).float()  # [T, H, L]
    q = q * scale
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    g = g.cumsum(-2)
    # UT transform: (I + L)^-1, L the strictly lower part of the k_beta . k decayed scores (the solve
    # ignores the diagonal). transformers inverts by row-wise forward substitution; a triangular
    # solve gives the same to fp32 rounding.
    ut_system, a_qk = channel_decay_scores((k_beta, q), k, g)  # [T, H, L, L]
    # One triangular solve for both right-hand sides (columns are independent): [u | w].
    decay = g.exp()  # [T, H, L, K]
    uw = torch.linalg.solve_triangular(
        ut_system, torch.cat((v_beta, k_beta * decay), -1), upper=False, unitriangular=True
    )
    u, w = uw.split((v.shape[-1], k.shape[-1]), -1)
    wq = torch.cat((w, q * decay), -2)  # [T, H, 2L, K]: [w; q decayed], one product with the state for both
    k_decay = (k * (g[:, :, -1:] - g).exp()).transpose(-1, -2)  # [T, H, K, L]
    chunk_decay = g[:, :, -1].exp().unsqueeze(-1)  # [T, H, K, 1]
    return u, wq, a_qk, k_decay, chunk_decay


KDA_KERNEL = ChunkKernel(kda_intra, delta_step, delta_output, delta_state_at)


def kda_chunk_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor,
    step_counts: list[int],
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KDA chunk scan: q, k [Tc, C, H, K], v [Tc, C, H, V], g [Tc, C, H, K], beta [Tc, C, H]."""
    return chunk_scan(KDA_KERNEL, q, k, v, g, beta, h0, step_counts, scale=scale)


@register("kda", "torch", tables=torch_tables)
def tree_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    batch: TreeBatch,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = CHUNK_SIZE,
    context: Mapping[str, torch.Tensor] | None = None,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pure-PyTorch backend of :func:`tree_kda`."""
    return run_tree_kind(
        KDA_KERNEL,
        batch,
        chunk_size,
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=scale,
        qk_norm=l2norm if use_qk_l2norm else None,
        context=context,
        initial_states=initial_states,
    )


@dispatch("kda", linear_call, check=linear_inputs_check(per_channel=True))
def tree_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    batch: TreeBatch,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = CHUNK_SIZE,
    context: Mapping[str, torch.Tensor] | None = None,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA over the compact tokens of a tree batch; equals running every root-to-leaf trajectory
    through transformers' ``chunk_kimi_delta_attention`` with the same chunk size.

    Args:
        q, k: [N, Hk, K] piece tokens; v: [N, H, V] (H a multiple of Hk: q/k heads are
            repeat_interleave'd); g: [N, H, K] per-channel log-decay; beta: [N, H].
        batch: the tree metadata (combined index space: context, then piece).
        scale: applied to q (default K ** -0.5); use_qk_l2norm: fp32 l2norm of q and k first.
        chunk_size: the chunk grid of trajectory-wise training (64 in transformers).
        context: {"k", "v", "g", "beta"} [Nc, ...] raw inputs of the context tokens; needed when
            ``rounds_of(batch, chunk_size).context_replay`` is non-empty.
        initial_states: [E, H, K, V] state after each of ``rounds_of(batch, C).external_tokens``.

    Returns:
        o [N, H, V] in v's dtype, and the states after ``batch.state_out[chunk_size]`` [S, H, K, V] fp32
        (None when not asked).
    """
