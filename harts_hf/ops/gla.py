"""Gated linear attention on trees: GLA (per-channel decay) and simple GLA (per-head decay).

Recurrence (no delta rule): ``S_t = exp(g_t) * S_{t-1} + k_t v_t^T``, ``o_t = scale * q_t S_t``; ``g`` is
[.., H, K] for GLA and [.., H] for simple GLA. Mamba2's SSD and MiniMax's lightning attention are simple
GLA with other names, so their tree ops live here as thin adapters.

The chunk-scan kernels follow the shared interface (see ``linear_attention.py``): chunks of all paths of
one round packed step-major, intra-chunk work batched over every chunk, the inter-chunk recurrence
stepped over the active prefix of paths. The arithmetic follows fla's naive references
(``fla/ops/gla/naive.py``, ``fla/ops/simple_gla/naive.py``), except that GLA's intra-chunk scores are
factorised by sub-chunks (:func:`channel_decay_scores`, shared with KDA) instead of materialising a
[C, C, K] decay per chunk; simple GLA's intra-chunk decay mask is transformers' Mamba2 segment sum, so
Mamba2 trees match the stock torch SSD path to fp32 rounding.

Shape legend: Tc chunks in a round, T chunks of one length L, C chunk size, H heads, K key dim, V value dim,
P paths, N tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from ..chunking import CHUNK_SIZE
from .backends import dispatch, register
from .linear_attention import (
    ChunkKernel,
    chunk_scan,
    expand_heads,
    linear_call,
    linear_inputs_check,
    masked_exp,
    prefix_state,
    run_tree_kind,
    torch_tables,
)
from .tree_batch import TreeBatch

__all__ = [
    "GLA_KERNEL",
    "SIMPLE_GLA_KERNEL",
    "channel_decay_scores",
    "gla_chunk_scan",
    "simple_gla_chunk_scan",
    "tree_gla",
    "tree_lightning",
    "tree_mamba2_ssd",
    "tree_simple_gla",
]

SUB_CHUNK = 8  # rows per sub-chunk of the per-channel decayed scores (see channel_decay_scores)


def gla_step(
    state: torch.Tensor,
    q_decay: torch.Tensor,
    o_intra: torch.Tensor,
    chunk_decay: torch.Tensor,
    k_end: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Inter-chunk half of (simple) GLA: the active paths' start states [n, H, K, V] and their
    chunk's rows -> (outputs [n, H, L, V], end states, None: the state update adds the plain v).

    The chunk's own state contribution ``k_end @ v`` (k decayed to the chunk's end, [n, H, K, L]) is
    formed here rather than in the intra half: only chunks whose end state is read need it, and most
    chunks of a tree (leaves, path ends) are not such chunks.
    """
    return q_decay @ state + o_intra, torch.addcmul(k_end @ v, state, chunk_decay), None


def gla_output(
    state: torch.Tensor, q_decay: torch.Tensor, o_intra: torch.Tensor, *state_rows: torch.Tensor
) -> tuple[torch.Tensor, None]:
    """:func:`gla_step` without the end states (``state_rows``: the chunk decay, k_end and v it ignores)."""
    return q_decay @ state + o_intra, None


def gla_state_at(
    state: torch.Tensor, values: None, take: Callable[[str], torch.Tensor], upto: torch.Tensor
) -> torch.Tensor:
    """State after row ``upto[r]`` of chunk r from its start state [R, H, K, V] (``take``: the chunks'
    prepared inputs by name, k [R, H, L, K], v [R, H, L, V], g [R, H, L] or [R, H, L, K]; ``values`` is
    None, the state update adds the plain v): :func:`gla_step`'s end-state update truncated at that row."""
    return prefix_state(state, take("k"), take("v"), take("g"), upto)


def channel_decay_scores(queries: Sequence[torch.Tensor], k: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-channel decayed scores ``sum_d a_id k_jd exp(g_id - g_jd)`` for j <= i (0 above the
    diagonal), [..., C, C], for every ``a`` [..., C, K] of ``queries``; g [..., C, K] is the
    cumulative log-decay.

    Computing every (i, j, d) term costs C * C * K per chunk. Instead the chunk is cut into
    sub-chunks of SUB_CHUNK rows; for i in sub-chunk I and j in an earlier sub-chunk J the decay
    splits as ``exp(g_i - f_I) * exp(f_I - l_J) * exp(l_J - g_j)`` (f_I: g at I's first row, l_J: at
    J's last), three factors <= 1 for a non-positive log-decay, so nothing overflows, and the
    scores of I against every earlier column are one matmul. Only the diagonal sub-chunk blocks
    take the explicit terms. The key side is shared by all ``queries``. Same values to fp32
    rounding, several times less memory traffic at C = 64.
    """
    chunk = k.shape[-2]
    sub = SUB_CHUNK if chunk % SUB_CHUNK == 0 else chunk
    n = chunk // sub
    blocks = lambda x: x.unflatten(-2, (n, sub))  # [..., n, sub, K]
    a = blocks(torch.stack(tuple(queries)))  # [A, ..., n, sub, K]
    gb = blocks(g)
    first, last = gb[..., 0, :], gb[..., -1, :]  # [..., n, K]
    earlier = torch.ones(n, n, dtype=g.dtype, device=k.device).tril(-1)  # [I, J]: J before I
    between = masked_exp(first.unsqueeze(-2) - last.unsqueeze(-3), earlier[..., None])
    k_last = blocks(k) * (last.unsqueeze(-2) - gb).exp()  # [..., n, sub, K]
    keys = (between.unsqueeze(-2) * k_last.unsqueeze(-4)).flatten(-3, -2)  # [..., n, C, K]
    before = (a * (gb - first.unsqueeze(-2)).exp()) @ keys.transpose(-1, -2)  # [A, ..., n, sub, C]
    causal = torch.ones(sub, sub, dtype=g.dtype, device=k.device).tril()
    inner = masked_exp(gb.unsqueeze(-2) - gb.unsqueeze(-3), causal[..., None])  # [..., n, sub, sub, K]
    diag = (a.unsqueeze(-2) * (blocks(k).unsqueeze(-3) * inner)).sum(-1)  # [A, ..., n, sub, sub]
    eye = torch.eye(n, dtype=k.dtype, device=k.device)[:, None, :, None]  # [n, 1, n, 1]
    scores = (before.unflatten(-1, (n, sub)) + diag.unsqueeze(-2) * eye).flatten(-2).flatten(-3, -2)
    return scores.unbind(0)  # A x [..., C, C]


def gla_intra(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: None, *, scale: float
) -> tuple[torch.Tensor, ...]:
    """Intra-chunk half of GLA (per-channel log-decay ``g`` [T, L, H, K]; ``beta`` None) -> the rows
    of :func:`gla_step`."""
    q, k, v, g = (x.transpose(1, 2).float() for x in (q, k, v, g))  # [T, H, L, K|V]
    q = q * scale
    g = g.cumsum(-2)
    o_intra = channel_decay_scores((q,), k, g)[0] @ v  # [T, H, L, V]
    q_decay = q * g.exp()  # [T, H, L, K]
    k_end = (k * (g[:, :, -1:] - g).exp()).transpose(-1, -2)  # [T, H, K, L]
    chunk_decay = g[:, :, -1].exp().unsqueeze(-1)  # [T, H, K, 1]
    return q_decay, o_intra, chunk_decay, k_end, v


GLA_KERNEL = ChunkKernel(gla_intra, gla_step, gla_output, gla_state_at)


def gla_chunk_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: None,
    h0: torch.Tensor,
    step_counts: list[int],
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GLA chunk scan (per-channel log-decay ``g`` [Tc, C, H, K]); ``beta`` must be None."""
    return chunk_scan(GLA_KERNEL, q, k, v, g, beta, h0, step_counts, scale=scale)


def segment_sum(g: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [..., C, C]: sum of g over (j, i] at [i, j], -inf above the diagonal.

    Summed directly (masked cumsum, as transformers' Mamba2 ``segment_sum``) instead of as a difference of
    cumulative sums, which loses ~1e-5 of the decay gradient's precision to cancellation.
    """
    chunk = g.shape[-1]
    ones = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device)
    terms = g.unsqueeze(-1).expand(*g.shape, chunk).masked_fill(~ones.tril(-1), 0)  # [..., C, C]: g_i if j < i
    return terms.cumsum(-2).masked_fill(~ones.tril(), float("-inf"))


def simple_gla_intra(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: None, *, scale: float
) -> tuple[torch.Tensor, ...]:
    """Intra-chunk half of simple GLA (per-head log-decay ``g`` [T, L, H]; ``beta`` None) -> the rows
    of :func:`gla_step`."""
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))  # [T, H, L, K|V]
    g = g.transpose(1, 2).float()  # [T, H, L]
    decay = g.cumsum(-1)
    q = q * scale
    mask = segment_sum(g).exp()  # [T, H, L, L]
    o_intra = (q @ k.transpose(-1, -2) * mask) @ v  # [T, H, L, V]
    q_decay = q * decay.exp().unsqueeze(-1)  # [T, H, L, K]
    k_end = (k * (decay[..., -1:] - decay).exp().unsqueeze(-1)).transpose(-1, -2)  # [T, H, K, L]
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [T, H, 1, 1]
    return q_decay, o_intra, chunk_decay, k_end, v


SIMPLE_GLA_KERNEL = ChunkKernel(simple_gla_intra, gla_step, gla_output, gla_state_at)


def simple_gla_chunk_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: None,
    h0: torch.Tensor,
    step_counts: list[int],
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Simple GLA chunk scan (per-head log-decay ``g`` [Tc, C, H]); ``beta`` must be None."""
    return chunk_scan(SIMPLE_GLA_KERNEL, q, k, v, g, beta, h0, step_counts, scale=scale)


@register("gla", "torch", tables=torch_tables)
def tree_gla_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    batch: TreeBatch,
    *,
    scale: float | None = None,
    chunk_size: int = CHUNK_SIZE,
    context: Mapping[str, torch.Tensor] | None = None,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pure-PyTorch backend of :func:`tree_gla`."""
    return run_tree_kind(
        GLA_KERNEL,
        batch,
        chunk_size,
        q=q,
        k=k,
        v=v,
        g=g,
        scale=scale,
        context=context,
        initial_states=initial_states,
    )


@dispatch("gla", linear_call, check=linear_inputs_check(per_channel=True))
def tree_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    batch: TreeBatch,
    *,
    scale: float | None = None,
    chunk_size: int = CHUNK_SIZE,
    context: Mapping[str, torch.Tensor] | None = None,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GLA over the compact tokens of a tree batch; equals fla's GLA run per root-to-leaf trajectory.

    Args:
        q, k: [N, Hk, K] piece tokens; v: [N, H, V] (H a multiple of Hk); g: [N, H, K] per-channel
            log-decay.
        batch, chunk_size, context ({"k", "v", "g"}), initial_states: as in
            :func:`harts_hf.ops.kda.tree_kda`.
        scale: applied to q (default K ** -0.5).

    Returns:
        o [N, H, V] in v's dtype, and the states after ``batch.state_out[chunk_size]`` [S, H, K, V] fp32 (or None).
    """


@register("simple_gla", "torch", tables=torch_tables)
def tree_simple_gla_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    batch: TreeBatch,
    *,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = CHUNK_SIZE,
    context: Mapping[str, torch.Tensor] | None = None,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pure-PyTorch backend of :func:`tree_simple_gla` (a constant ``g_gamma`` becomes a per-token g)."""
    if (g is None) == (g_gamma is None):
        raise ValueError("pass exactly one of g (per-token decay) and g_gamma (constant per-head decay)")
    heads = v.shape[1]

    def decay(gates: torch.Tensor | None, tokens: int) -> torch.Tensor:
        """[tokens, H] per-token log-decay: ``gates``, or ``g_gamma`` repeated."""
        return gates.float() if g_gamma is None else g_gamma.float().expand(tokens, heads)

    if context is not None:
        context = {**context, "g": decay(context["g"] if g_gamma is None else None, context["v"].shape[0])}
    return run_tree_kind(
        SIMPLE_GLA_KERNEL,
        batch,
        chunk_size,
        q=q,
        k=k,
        v=v,
        g=decay(g, v.shape[0]),
        scale=scale,
        context=context,
        initial_states=initial_states,
    )


@dispatch("simple_gla", linear_call, check=linear_inputs_check(per_channel=False))
def tree_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    batch: TreeBatch,
    *,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = CHUNK_SIZE,
    context: Mapping[str, torch.Tensor] | None = None,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Simple GLA over the compact tokens of a tree batch; equals fla's simple GLA per trajectory.

    Args:
        q, k: [N, Hk, K] piece tokens; v: [N, H, V] (H a multiple of Hk); g: [N, H] per-head
            log-decay, or None with ``g_gamma`` [H], a constant per-head log-decay (fla's
            data-independent decay, as in lightning attention).
        batch, chunk_size, context ({"k", "v", "g"}; "g" unused with g_gamma), initial_states,
        scale: applied to q (default K ** -0.5).

    Returns:
        o [N, H, V] in v's dtype, and the states after ``batch.state_out[chunk_size]`` [S, H, K, V] fp32 (or None).
    """


def tree_mamba2_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    batch: TreeBatch,
    *,
    chunk_size: int,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    context: Mapping[str, torch.Tensor] | None = None,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mamba2's SSD scan (transformers' ``mamba2_chunk_scan``) over a tree batch, as simple GLA:
    q = C, k = B, v = x * dt, g = A * dt, scale 1, plus the skip ``D * x``.

    Args:
        x: [N, H, P] piece tokens; dt: [N, H] raw time steps (``dt_bias``, ``dt_softplus`` and
            ``dt_limit`` applied here, as ``mamba2_chunk_scan`` does); A: [H]; B, C: [N, G, S]
            with G groups (expanded to the H heads); D: [H] or None.
        chunk_size: the model's SSD chunk size (``config.chunk_size``).
        context: {"x", "dt", "B"} [Nc, ...] raw inputs of the context tokens (see
            :func:`tree_simple_gla`); initial_states [E, H, S, P] / returned states [S, H, S, P] use
            the simple-GLA layout (mamba2's [.., H, P, S] transposed).

    Returns:
        y [N, H, P] fp32 (as ``mamba2_chunk_scan`` returns), and the requested states (or None).
    """
    heads = x.shape[1]
    if A.shape != (heads,) or (D is not None and D.shape != (heads,)):
        raise ValueError(
            f"A {tuple(A.shape)}{'' if D is None else f', D {tuple(D.shape)}'}: need one value per head ({heads})"
        )

    def discretize(inputs: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(v = x * dt [n, H, P], g = A * dt [n, H]) with dt prepared as ``mamba2_chunk_scan`` does."""
        if dt_bias is not None:
            steps = steps + dt_bias.to(steps.dtype)
        if dt_softplus:
            steps = F.softplus(steps)
        steps = torch.clamp(steps, min=dt_limit[0], max=dt_limit[1]).float()
        return inputs.float() * steps[..., None], A.float() * steps

    ctx = None
    if context is not None:
        ctx_v, ctx_g = discretize(context["x"], context["dt"])
        ctx = {"k": expand_heads(context["B"], heads), "v": ctx_v, "g": ctx_g}
    v, g = discretize(x, dt)
    y, states = tree_simple_gla(
        expand_heads(C, heads),
        expand_heads(B, heads),
        v,
        g,
        batch,
        scale=1.0,
        chunk_size=chunk_size,
        context=ctx,
        initial_states=initial_states,
    )
    if D is not None:
        y = y + D[..., None] * x.float()
    return y, states


def tree_lightning(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slope: torch.Tensor,
    batch: TreeBatch,
    *,
    chunk_size: int = CHUNK_SIZE,
    context: Mapping[str, torch.Tensor] | None = None,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MiniMax lightning attention over a tree batch: simple GLA with the constant decay -slope
    per head and scale 1 (``MiniMaxLightningAttention``'s block recurrence, unnormalised).

    Args:
        q, k, v: [N, H, D] piece tokens (after the layer's activation); slope: the layer's
            ``slope_rate`` buffer ([H, 1, 1] or [H]).
        chunk_size: the layer's ``block_size`` reproduces its blocking (and rounding) exactly.
        context ({"k", "v"}), initial_states: as in :func:`tree_simple_gla`.

    Returns:
        o [N, H, D] in v's dtype, and the requested states [S, H, D, D] (or None).
    """
    return tree_simple_gla(
        q,
        k,
        v,
        None,
        batch,
        g_gamma=-slope.reshape(-1),
        scale=1.0,
        chunk_size=chunk_size,
        context=context,
        initial_states=initial_states,
    )
