"""Gated DeltaNet (GDN) over a tree: the packed chunk-scan kernel and the public tree op.

``gdn_chunk_scan`` follows transformers' ``torch_chunk_gated_delta_rule`` (qwen3_5) formula for
formula (UT transform by ``solve_triangular``, decay applied once to q and k, then the scan over
chunks), so a tree run matches trajectory-wise training to fp32 rounding. The tree driver in
``linear_attention.py`` calls it once per round with all of that round's paths packed.

Legend: Tc packed chunks, T chunks of one length L, C chunk size, P paths, N tokens, H value heads,
Hk key heads, K key dim, V value dim.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..chunking import CHUNK_SIZE
from .backends import dispatch, register
from .linear_attention import (
    ChunkKernel,
    chunk_scan,
    linear_call,
    linear_inputs_check,
    masked_exp,
    prefix_state,
    run_tree_kind,
    torch_tables,
)
from .tree_batch import TreeBatch

__all__ = ["GDN_KERNEL", "gdn_chunk_scan", "tree_gated_delta_rule"]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla's / transformers' l2norm (rsqrt of sum of squares + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def gdn_intra(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, ...]:
    """Intra-chunk half: q, k [T, L, H, K]; v [T, L, H, V]; g, beta [T, L, H] -> the rows of :func:`delta_step`."""
    C = q.shape[1]
    query, key, value = (x.transpose(1, 2).float() for x in (q, k, v))  # [T, H, L, *]
    beta, decay = (x.transpose(1, 2).float() for x in (beta, g))  # [T, H, L]
    query = query * scale
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)

    cum_decay = decay.cumsum(dim=-1)  # [T, H, L]
    causal = torch.ones(C, C, dtype=cum_decay.dtype, device=q.device).tril()
    pairwise_decay = masked_exp(cum_decay.unsqueeze(-1) - cum_decay.unsqueeze(-2), causal)  # [T, H, L, L]
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise_decay  # [T, H, L, L]
    intra_chunk_attn = (query @ key.transpose(-1, -2)) * pairwise_decay
    to_row = cum_decay.exp().unsqueeze(-1)  # [T, H, L, 1] decay from the chunk start
    decayed_k_beta = k_beta * to_row
    # One triangular solve for both right-hand sides (columns are independent): [u | w].
    uw = torch.linalg.solve_triangular(
        ut_system, torch.cat((v_beta, decayed_k_beta), -1), upper=False, unitriangular=True
    )
    new_values, k_cumdecay = uw.split((v_beta.shape[-1], key.shape[-1]), -1)

    query = query * to_row
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]  # [T, H, 1, 1]
    wq = torch.cat((k_cumdecay, query), -2)  # [T, H, 2L, K]: one product with the state for both
    return new_values, wq, intra_chunk_attn, key.transpose(-1, -2), chunk_decay


def delta_step(
    state: torch.Tensor, u: torch.Tensor, wq: torch.Tensor, a: torch.Tensor, k: torch.Tensor, decay: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inter-chunk half of both delta-rule kinds (GDN, KDA): start states [n, H, K, V] and the chunks'
    rows (u [n, H, L, V], [w; q] [n, H, 2L, K], a [n, H, L, L], decayed k^T [n, H, K, L], chunk decay
    [n, H, 1, 1] (GDN) or [n, H, K, 1] (KDA)) -> (o [n, H, L, V], end states, the corrected values
    v_new [n, H, L, V])."""
    o, v_new = delta_output(state, u, wq, a, k, decay)
    return o, torch.addcmul(k @ v_new, state, decay), v_new


def delta_output(
    state: torch.Tensor, u: torch.Tensor, wq: torch.Tensor, a: torch.Tensor, k: torch.Tensor, decay: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`delta_step` without the end states: (o [n, H, L, V], v_new [n, H, L, V])."""
    w_state, q_state = (wq @ state).chunk(2, -2)  # [n, H, L, V] each
    v_new = u - w_state
    return q_state + a @ v_new, v_new


def delta_state_at(
    state: torch.Tensor, values: torch.Tensor, take: Callable[[str], torch.Tensor], upto: torch.Tensor
) -> torch.Tensor:
    """State after row ``upto[r]`` of chunk r from its start state [R, H, K, V], given the chunks'
    :func:`delta_step` values [R, H, L, V] (``take``: the chunks' prepared inputs by name, head-major,
    k [R, H, L, K], g [R, H, L] or [R, H, L, K]): :func:`delta_step`'s end-state update truncated there."""
    return prefix_state(state, take("k"), values, take("g"), upto)


GDN_KERNEL = ChunkKernel(gdn_intra, delta_step, delta_output, delta_state_at)


def gdn_chunk_scan(
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
    """Chunked gated delta rule over step-major packed paths (interface: ``linear_attention.py``).

    q, k [Tc, C, H, K]; v [Tc, C, H, V]; g, beta [Tc, C, H]; h0 [P, H, K, V].
    Returns o [Tc, C, H, V], h_start [Tc, H, K, V], h_final [P, H, K, V].
    """
    return chunk_scan(GDN_KERNEL, q, k, v, g, beta, h0, step_counts, scale=scale)


@register("gated_delta", "torch", tables=torch_tables)
def tree_gated_delta_rule_torch(
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
    """Pure-PyTorch backend of :func:`tree_gated_delta_rule`."""
    return run_tree_kind(
        GDN_KERNEL,
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


@dispatch("gated_delta", linear_call, check=linear_inputs_check(per_channel=False))
def tree_gated_delta_rule(
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
    """Gated delta rule over the compact tokens of a tree batch; equals running every
    root-to-leaf trajectory through ``torch_chunk_gated_delta_rule`` with the same chunk size.

    Args:
        q, k: [N, Hk, K] piece tokens; v: [N, H, V] (H a multiple of Hk: grouped value heads,
            q/k heads repeat_interleave'd); g: [N, H] log-decay; beta: [N, H].
        batch: the tree metadata (combined index space: context, then piece).
        scale: applied to q (default K ** -0.5); use_qk_l2norm: fp32 l2norm of q and k first.
        chunk_size: the chunk grid of trajectory-wise training (64 in transformers).
        context: {"k", "v", "g", "beta"} [Nc, ...] inputs of the context tokens (raw, like q/k/v);
            needed when ``rounds_of(batch, chunk_size).context_replay`` is non-empty.
        initial_states: [E, H, K, V] state after each of ``rounds_of(batch, C).external_tokens``.

    Returns:
        o [N, H, V] in v's dtype, and the states after ``batch.state_out[chunk_size]`` [S, H, K, V] fp32
        (None when not asked).
    """
