"""Ancestor attention on a tree batch: every compact token attends to its ancestors-or-self.

On one trajectory this is causal attention; on a tree a token's keys are exactly its root
path, so each shared prefix token is attended (and back-propagated) once for all trajectories.

Legend: N piece tokens (the queries), Nc context tokens, Nk = Nc + N keys (combined space,
see ``TreeBatch``); Hq query heads, Hkv key/value heads, R = Hq // Hkv; D, Dv head dims;
Bq queries per block, nb blocks, G blocks in a group, K keys of a block (padded).

Blocks: the DFS-ordered queries are cut into blocks of Bq consecutive tokens. A key serves
every block that holds a token of its subtree; in DFS order those blocks form ONE contiguous
range, so all blocks' key lists (the union of their tokens' root paths) come out of one
repeat and one sort. Blocks whose key counts round up to the same size share a bucket; a
group of a bucket's blocks runs as one batched matmul masked by the interval test. Forward
keeps only the output and the row log-sum-exp, backward recomputes one group's probabilities
at a time (flash-attention style): memory is linear in N plus one group's scores, and work is
the attended (ancestor) pairs plus bounded padding.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from .backends import Call, dispatch, register
from .precision import without_autocast
from .tree_batch import Table, TreeBatch

__all__ = ["AttentionBlocksTable", "tree_attention", "tree_attention_torch"]

BLOCK_SIZE = 128
GROUP_ELEMENTS = 1 << 22  # scores per group (heads included): 16 MiB per fp32 temporary


@dataclass(frozen=True)
class _Bucket:
    blocks: torch.Tensor  # [B] block ids
    keys: torch.Tensor  # [B, K] int32 combined key index; Nk (a zero row) where padded


@dataclass(frozen=True)
class _Blocks:
    """Per-batch block layout of ancestor attention (built once per batch and block size)."""

    block_size: int
    num_blocks: int
    query_global: torch.Tensor  # [nb, Bq] forest index of each query slot; -1 where padded
    key_lo: torch.Tensor  # [Nk + 1] forest index of each key; key serves q iff lo <= q < hi
    key_hi: torch.Tensor  # [Nk + 1] subtree end of each key; the pad key (Nk) has lo = hi = 0
    query_pos: torch.Tensor  # [nb, Bq] depth of each query slot (sliding windows)
    key_pos: torch.Tensor  # [Nk + 1] depth of each key
    buckets: tuple[_Bucket, ...]


@dataclass(frozen=True)
class AttentionBlocksTable(Table):
    """The batch's block layout of ancestor attention for ``block_size`` queries a block."""

    block_size: int

    def build(self, batch: TreeBatch) -> _Blocks:
        return _build_blocks(batch, self.block_size)


def _padded_size(count: np.ndarray, block_size: int) -> np.ndarray:
    """Round key counts up to a multiple of max(Bq, 2^(floor(log2 count) - 3)): <= 12.5% padding."""
    octave = np.floor(np.log2(np.maximum(count, 1))).astype(np.int64)
    step = np.maximum(block_size, 1 << np.maximum(octave - 3, 0))
    return -(-count // step) * step


def _build_blocks(batch: TreeBatch, block_size: int) -> _Blocks:
    nc, n = batch.num_context, batch.num_tokens
    lo = batch.global_index.cpu().numpy()
    hi = batch.global_end.cpu().numpy()
    piece = lo[nc:]
    if np.any(np.diff(piece) <= 0):
        raise ValueError("tree attention needs the piece's tokens in DFS order (increasing global_index)")
    nk, nb = lo.size, -(-n // block_size)
    # Piece tokens in key k's subtree: the contiguous range [first, last] -> blocks [b_lo, b_hi].
    first = np.searchsorted(piece, lo)
    last = np.searchsorted(piece, hi) - 1
    b_lo = first // block_size
    b_hi = np.where(last >= first, last // block_size, -1)
    # Keys serving block b: b_lo <= b <= b_hi (counted by differences of cumulative counts).
    has = b_hi >= 0
    opened = np.cumsum(np.bincount(b_lo[has], minlength=nb))
    closed = np.cumsum(np.bincount(b_hi[has], minlength=nb))
    per_block = opened - np.concatenate(([0], closed[:-1]))

    size = _padded_size(per_block, block_size)
    by_size = np.argsort(size, kind="stable")
    sizes, start, rows = np.unique(size[by_size], return_index=True, return_counts=True)
    row = np.empty(nb, dtype=np.int64)
    row[by_size] = np.arange(nb) - np.repeat(start, rows)
    base = np.concatenate(([0], np.cumsum(sizes * rows)))
    offset = base[np.searchsorted(sizes, size)] + row * size  # flat offset of each block's row
    flat = np.full(int(base[-1]), nk, dtype=np.int32)  # the largest table of a batch: 32-bit rows (Nk < 2^31)
    for b, (at, count) in enumerate(zip(offset.tolist(), per_block.tolist())):  # its keys, ascending
        end = nc + min(n, (b + 1) * block_size)  # later piece tokens start in later blocks
        flat[at : at + count] = np.flatnonzero((b_lo[:end] <= b) & (b_hi[:end] >= b))

    def as_t(a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.long, device=batch.device)

    buckets = tuple(
        _Bucket(
            blocks=as_t(by_size[start[u] : start[u] + rows[u]]),
            keys=torch.as_tensor(flat[base[u] : base[u + 1]].reshape(rows[u], sizes[u]), device=batch.device),
        )
        for u in range(sizes.size)
    )
    query_global = np.full(nb * block_size, -1, dtype=np.int64)
    query_global[:n] = piece
    pos = batch.position.cpu().numpy()
    query_pos = np.zeros(nb * block_size, dtype=np.int64)
    query_pos[:n] = pos[nc:]
    return _Blocks(
        block_size=block_size,
        num_blocks=nb,
        query_global=as_t(query_global.reshape(nb, block_size)),
        key_lo=as_t(np.append(lo, 0)),
        key_hi=as_t(np.append(hi, 0)),
        query_pos=as_t(query_pos.reshape(nb, block_size)),
        key_pos=as_t(np.append(pos, 0)),
        buckets=buckets,
    )


def _groups(blocks: _Blocks, heads: int, group_elements: int) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
    """(block ids [G], its keys [G, K] in chunks) of every group, in a fixed order (backward replays
    it). A group holds at most ``group_elements`` scores: blocks whose keys fit share one chunk, a
    block with more keys (a piece under a long context) runs its keys in chunks (online softmax)."""
    row = heads * blocks.block_size
    for bucket in blocks.buckets:
        k = bucket.keys.shape[1]
        step = max(1, group_elements // (row * k))
        chunk = max(1, group_elements // row)
        for s in range(0, bucket.blocks.numel(), step):
            keys = bucket.keys[s : s + step]
            yield bucket.blocks[s : s + step], list(keys.split(chunk, dim=1)) if k > chunk else [keys]


def _chunk_ids() -> Iterator[int]:
    """The dropout mask seed offset of each (group, key chunk), in the order forward and backward run them."""
    return itertools.count()


def _acc(x: torch.Tensor) -> torch.dtype:
    """Softmax / accumulation dtype: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)


def _to_blocks(x: torch.Tensor, nb: int, bq: int, hkv: int) -> torch.Tensor:
    """[N, Hq, D] -> [Hkv, nb, R, Bq, D], zero-padded to nb * Bq rows."""
    n, hq, d = x.shape
    out = x.new_zeros(nb * bq, hq, d)
    out[:n] = x
    return out.view(nb, bq, hkv, hq // hkv, d).permute(2, 0, 3, 1, 4).contiguous()


def _from_blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    """[Hkv, nb, R, Bq, D] -> [N, Hq, D]."""
    hkv, nb, r, bq, d = x.shape
    return x.permute(1, 3, 0, 2, 4).reshape(nb * bq, hkv * r, d)[:n]


def _with_pad_row(x: torch.Tensor) -> torch.Tensor:
    """[Nk, Hkv, D] -> [Hkv, Nk + 1, D]: the last row is the zero key/value padded slots read."""
    out = x.new_zeros(x.shape[1], x.shape[0] + 1, x.shape[2])
    out[:, :-1] = x.transpose(0, 1)
    return out


@dataclass
class _Blocked:
    """Block layouts of one call, rebuilt in backward (nothing quadratic is kept in between).

    Queries are pre-multiplied by ``scale`` (divided by ``softcap`` when capping), so a group's
    raw product is the capped function's argument and no pass over the scores scales them.
    """

    blocks: _Blocks
    qb: torch.Tensor  # [Hkv, nb, R, Bq, D] scaled queries
    kt: torch.Tensor  # [Hkv, Nk + 1, D]
    vt: torch.Tensor  # [Hkv, Nk + 1, Dv]
    sinks: torch.Tensor | None  # [Hkv, 1, R, 1, 1] sink logits, softmax dtype
    softcap: float | None
    window: int | None
    dropout: float
    seed: int

    @classmethod
    def of(cls, q, k, v, sinks, blocks: _Blocks, scale, softcap, window, dropout, seed) -> _Blocked:
        hkv = k.shape[1]
        qb = _to_blocks(q, blocks.num_blocks, blocks.block_size, hkv)
        qb.mul_(_q_factor(scale, softcap))
        if sinks is not None:
            sinks = sinks.to(_acc(q)).view(hkv, 1, -1, 1, 1)
        return cls(blocks, qb, _with_pad_row(k), _with_pad_row(v), sinks, softcap, window, dropout, seed)

    def queries(self, blk: torch.Tensor) -> torch.Tensor:
        return self.qb.index_select(1, blk).flatten(2, 3)  # [Hkv, G, R * Bq, D]

    @staticmethod
    def gather(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return x.index_select(1, keys.flatten()).view(x.shape[0], *keys.shape, x.shape[-1])  # [Hkv, G, K, D]

    def keep(self, g: int, shape: torch.Size) -> torch.Tensor:
        """Group g's dropout keep-mask, scaled by 1 / (1 - p); replayed from the seed in backward."""
        gen = torch.Generator(device=self.qb.device).manual_seed(self.seed + g)
        keep = torch.rand(shape, generator=gen, device=self.qb.device) >= self.dropout
        return keep.to(_acc(self.qb)).div_(1 - self.dropout)

    def logits(self, blk: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Masked logits [Hkv, G, R, Bq, K], which (query, key) pairs attend [G, Bq, K] as 1 / 0 (see
        :func:`_probabilities`) and, when capping, d(logit)/d(raw product)."""
        hkv, r, bq = self.qb.shape[0], self.qb.shape[2], self.blocks.block_size
        s = (self.queries(blk) @ self.gather(self.kt, keys).transpose(-1, -2)).to(_acc(self.qb))
        s = s.view(hkv, blk.numel(), r, bq, -1)
        dcap = None
        if self.softcap is not None:
            s.tanh_()
            dcap = (1 - s.square()).mul_(self.softcap)
            s.mul_(self.softcap)
        qg = self.blocks.query_global.index_select(0, blk)[:, :, None]  # [G, Bq, 1]
        flat = keys.flatten()
        lo = self.blocks.key_lo.index_select(0, flat).view(keys.shape)[:, None]  # [G, 1, K]
        hi = self.blocks.key_hi.index_select(0, flat).view(keys.shape)[:, None]
        # Additive mask (a bool masked_fill is several times slower on CPU): 0 kept, -1e30 not.
        keep = (lo <= qg) & (qg < hi)  # [G, Bq, K]
        if self.window is not None:  # HF's sliding_window_overlay: keep iff q - k < window
            qp = self.blocks.query_pos.index_select(0, blk)[:, :, None]  # [G, Bq, 1]
            kp = self.blocks.key_pos.index_select(0, flat).view(keys.shape)[:, None]  # [G, 1, K]
            keep &= qp - kp < self.window
        attends = keep.to(s.dtype)
        return s.add_((attends - 1).mul_(1e30)[None, :, None]), attends, dcap


def _probabilities(s: torch.Tensor, shift: torch.Tensor, attends: torch.Tensor) -> torch.Tensor:
    """``exp(s - shift)`` in place, exactly 0 where ``attends`` [G, Bq, K] is 0: a masked logit's exponent
    is zeroed before ``exp`` and its result after. CPU ``exp`` takes a slow path on every input that
    underflows, and the masked -1e30s are most of a block's pairs on a tree (exp alone was 15x slower);
    multiplying the attended ones by 1 leaves them exactly as they were."""
    attends = attends[None, :, None]
    return s.sub_(shift).mul_(attends).exp_().mul_(attends)


def _q_factor(scale: float, softcap: float | None) -> float:
    return scale if softcap is None else scale / softcap


class _Attention(torch.autograd.Function):
    """Block-sparse ancestor attention; saves output + log-sum-exp, recomputes scores in backward."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, blocks: _Blocks, scale, softcap, window, dropout, seed, group_elements):
        lay = _Blocked.of(q, k, v, sinks, blocks, scale, softcap, window, dropout, seed)
        acc = _acc(q)
        out = lay.qb.new_zeros(*lay.qb.shape[:4], v.shape[-1], dtype=acc)  # [Hkv, nb, R, Bq, Dv]
        lse = lay.qb.new_zeros(lay.qb.shape[:4], dtype=acc)  # [Hkv, nb, R, Bq]
        chunks = _chunk_ids()
        for blk, key_chunks in _groups(blocks, q.shape[1], group_elements):
            m = total = o = None
            for keys in key_chunks:
                s, attends, _ = lay.logits(blk, keys)  # [Hkv, G, R, Bq, K]
                top = s.amax(-1, keepdim=True)
                if m is None and sinks is not None:
                    top = torch.maximum(top, lay.sinks)
                if m is not None:  # online softmax: rescale what earlier chunks summed to the new max
                    top = torch.maximum(top, m)
                    rescale = torch.exp(m - top)
                p = _probabilities(s, top, attends)
                part = p.sum(-1, keepdim=True)
                if dropout:
                    p.mul_(lay.keep(next(chunks), p.shape))
                po = (p.flatten(2, 3).to(v.dtype) @ lay.gather(lay.vt, keys)).view(*p.shape[:4], -1)  # [.., Bq, Dv]
                total, o = (part, po) if m is None else (total * rescale + part, o * rescale + po)
                m = top
            if sinks is not None:
                total = total + torch.exp(lay.sinks - m)
            # A real row's max term is exp(0) = 1, so its total is >= 1; a padded query slot attends no
            # key (total 0): 1 gives it output 0 and a finite log-sum-exp, so no NaN in backward.
            total.clamp_min_(1)
            out.index_copy_(1, blk, o / total)
            lse.index_copy_(1, blk, (m + total.log()).squeeze(-1))
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.args = (blocks, scale, softcap, window, dropout, seed, group_elements)
        return _from_blocks(out, q.shape[0]).to(q.dtype)

    @staticmethod
    @once_differentiable
    @without_autocast
    def backward(ctx, grad):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        blocks, scale, softcap, window, dropout, seed, group_elements = ctx.args
        lay = _Blocked.of(q, k, v, sinks, blocks, scale, softcap, window, dropout, seed)
        acc = _acc(q)
        dob = _to_blocks(grad, blocks.num_blocks, blocks.block_size, k.shape[1])  # [Hkv, nb, R, Bq, Dv]
        delta = (dob.to(acc) * out).sum(-1)  # [Hkv, nb, R, Bq] rowsum(dO * O)
        dq = torch.zeros_like(lay.qb, dtype=acc)
        dk = torch.zeros_like(lay.kt, dtype=acc)
        dv = torch.zeros_like(lay.vt, dtype=acc)
        chunks = _chunk_ids()
        for blk, key_chunks in _groups(blocks, q.shape[1], group_elements):
            for keys in key_chunks:
                s, attends, dcap = lay.logits(blk, keys)
                p = _probabilities(s, lse.index_select(1, blk).unsqueeze(-1), attends)  # [Hkv, G, R, Bq, K]
                keep = lay.keep(next(chunks), p.shape) if dropout else None
                kg, vg = lay.gather(lay.kt, keys), lay.gather(lay.vt, keys)  # [Hkv, G, K, D(v)]
                do = dob.index_select(1, blk).flatten(2, 3)  # [Hkv, G, R * Bq, Dv]
                flat = keys.flatten()
                pk = p if keep is None else p * keep
                dv.index_add_(1, flat, (pk.flatten(2, 3).transpose(-1, -2).to(do.dtype) @ do).flatten(1, 2).to(acc))
                ds = (do @ vg.transpose(-1, -2)).to(acc).view_as(p)  # dP
                if keep is not None:
                    ds.mul_(keep)
                ds.sub_(delta.index_select(1, blk).unsqueeze(-1)).mul_(p)
                if dcap is not None:
                    ds.mul_(dcap)
                ds = ds.flatten(2, 3).to(kg.dtype)  # [Hkv, G, R * Bq, K] d(raw product)
                dq.index_add_(1, blk, (ds @ kg).view(*p.shape[:4], -1).to(acc))
                dk.index_add_(1, flat, (ds.transpose(-1, -2) @ lay.queries(blk)).flatten(1, 2).to(acc))
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            p_sink = torch.exp(lay.sinks.squeeze(-1) - lse)  # [Hkv, nb, R, Bq]
            dsinks = -(p_sink * delta).sum((1, 3)).flatten().to(sinks.dtype)
        return (
            _from_blocks(dq.mul_(_q_factor(scale, softcap)), q.shape[0]).to(q.dtype),
            dk[:, :-1].transpose(0, 1).to(k.dtype),
            dv[:, :-1].transpose(0, 1).to(v.dtype),
            dsinks,
            *(None,) * 7,
        )


def _check_options(softcap: float | None, dropout: float, sliding_window: int | None, block_size: int) -> None:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive (or None for no cap), got {softcap}")
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 (or None for no window), got {sliding_window}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")


def _check(q, k, v, batch, sinks, context_kv) -> None:
    if not q.dim() == k.dim() == v.dim() == 3:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need [N, heads, head_dim] each")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    n, hq, d = q.shape
    if k.shape[:2] != v.shape[:2] or k.shape[0] != n or k.shape[2] != d or hq % k.shape[1]:
        shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        raise ValueError(f"{shapes}: need [N, Hq, D], [N, Hkv, D], [N, Hkv, Dv] with Hq a multiple of Hkv")
    if n != batch.num_tokens:
        raise ValueError(f"q has {n} tokens but the batch has {batch.num_tokens}")
    if (context_kv is None) != (batch.num_context == 0):
        raise ValueError(f"the batch has {batch.num_context} context tokens: pass context_kv iff it has any")
    if context_kv is not None and any(c.shape[0] != batch.num_context for c in context_kv):
        raise ValueError(f"context_kv must hold {batch.num_context} rows, got {[tuple(c.shape) for c in context_kv]}")
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"sinks must have shape ({hq},), got {tuple(sinks.shape)}")


@register("attention", "torch", tables=lambda call: (AttentionBlocksTable(BLOCK_SIZE),))
def tree_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: TreeBatch,
    *,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    context_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    block_size: int = BLOCK_SIZE,
    group_elements: int = GROUP_ELEMENTS,
) -> torch.Tensor:
    """Pure-PyTorch ancestor attention (see :func:`tree_attention`); ``block_size`` and
    ``group_elements`` (scores computed at once) trade padding against per-call overhead."""
    _check(q, k, v, batch, sinks, context_kv)
    _check_options(softcap, dropout, sliding_window, block_size)
    if context_kv is not None:
        k = torch.cat((context_kv[0], k))
        v = torch.cat((context_kv[1], v))
    blocks = batch.cached(AttentionBlocksTable(block_size))
    seed = int(torch.randint(1 << 62, (), device="cpu")) if dropout else 0
    return _Attention.apply(q, k, v, sinks, blocks, scale, softcap, sliding_window, dropout, seed, group_elements)


@dispatch("attention", lambda kind, q, **_: Call(kind, q.device), autocast_casts=("q", "k", "v", "context_kv"))
def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: TreeBatch,
    *,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    context_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of every piece token over its ancestors-or-self (causal attention per trajectory).

    Args:
        q: [N, Hq, D] queries of the batch's own tokens, DFS order.
        k, v: [N, Hkv, D] / [N, Hkv, Dv] their keys and values (GQA: Hq a multiple of Hkv).
        batch: the microbatch's tree metadata.
        scale: logit scale (usually D ** -0.5).
        softcap: gemma2-style ``softcap * tanh(logits / softcap)``.
        sinks: [Hq] gpt-oss-style learned sink logit per head, added to the softmax denominator.
        context_kv: ([Nc, Hkv, D], [Nc, Hkv, Dv]) K/V of the context tokens (ancestors computed in
            an earlier microbatch); gradients flow into them.
        dropout: probability of dropping an attention weight (after the softmax).
        sliding_window: keys with ``position[q] - position[k] >= sliding_window`` are masked
            (transformers' ``sliding_window_overlay``); None attends to every ancestor.

    Returns:
        [N, Hq, Dv] in q's dtype; the softmax runs in fp32. Under autocast q, k, v and context_kv
        run in the autocast dtype, as ``scaled_dot_product_attention`` does.
    """
