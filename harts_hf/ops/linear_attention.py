"""The tree driver shared by every chunkwise linear-attention kind (GDN, KDA, GLA, simple GLA).

``rounds.py`` cuts the tree into paths grouped into rounds; this driver runs the rounds in order, each
as ONE scan of the kind's kernel over all of its paths. A path's initial state is a state of its
parent path from the previous round (or zeros / a caller-given state for root paths).

A kind's kernel is a :class:`ChunkKernel`: ``intra`` does the intra-chunk work batched over chunks,
``step`` one inter-chunk step of the active paths, ``state_at`` the state after a given row of a
chunk. :func:`chunk_scan` runs the first two on one step-major round of full chunks (chunk 0 of
paths 0..n_0-1, then chunk 1 of paths 0..n_1-1, ...: the ``<kind>_chunk_scan`` functions); the tree
driver runs them on the ragged layout (``ragged_layout.py``): a child path starts exactly at its
branch point from the mid-chunk state ``state_at`` computed in its parent's round (no replay of the
parent's tokens), and every chunk runs at its true length rounded up to 8 (:func:`scan_ragged`).

Short chunks make the per-chunk overhead, not the token work, the cost of a tree, so the layout gives
one gather of every input for the whole run, ``intra`` once per chunk length for all rounds together,
states kept in visiting order (a visit's states are a view), and only the states a later use reads
materialised: the chunk-start states a mid-chunk state or the next round reads, the end states only
where the next round or ``batch.state_out`` reads one (the other last chunks run ``output``). A
mid-chunk state reuses its chunk's ``step`` values instead of recomputing them.

Signature (stable; the per-kind wrappers in ``gated_delta.py``, ``kda.py``, ``gla.py`` call it)::

    run_tree_linear_attention(
        kernel,                  # the kind's ChunkKernel (e.g. gated_delta.GDN_KERNEL)
        batch: TreeBatch,
        chunk_size: int,
        *,
        q, k, v, g, beta,        # own (piece) tokens, fp32, prepared: l2-normalised if the layer asks,
                                 # q/k heads already expanded to the value-head count H
                                 # q, k [N, H, K]; v [N, H, V]; g [N, H] or [N, H, K]; beta [N, H] or None
        scale: float,
        context=None,            # {"k", "v", "g", "beta"} [R, ...] of the R context tokens the paths replay
                                 # (rounds_of(batch, chunk_size).context_replay, in that order), prepared
                                 # like the own inputs ("beta" only for delta-rule kinds; others ignored);
                                 # needed iff R > 0
        initial_states=None,     # [E, H, K, V] fp32, the state after each of
                                 # rounds_of(batch, chunk_size).external_tokens (E of them, in that order)
    ) -> tuple[o, states_out]    # o [N, H, V] fp32; states_out [S, H, K, V] fp32 after each of
                                 # batch.state_out[chunk_size] (None if the batch asks for none)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NamedTuple

import torch

from .backends import Call
from .ragged_layout import RaggedLayoutTable, ScanRound, ragged_layout_of
from .rounds import ReplayTable, RoundsTable, context_replay_of, input_table, rounds_of
from .take_rows import take_rows
from .tree_batch import Table, TreeBatch

__all__ = [
    "ChunkKernel",
    "chunk_scan",
    "expand_heads",
    "grid_tables",
    "linear_call",
    "linear_inputs_check",
    "masked_exp",
    "prefix_state",
    "run_tree_linear_attention",
    "scan_ragged",
    "scan_steps",
    "torch_tables",
]

Step = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


class ChunkKernel(NamedTuple):
    """A linear-attention kind as two halves the drivers compose.

    Args:
        intra: ``(q, k, v, g, beta, *, scale)`` on chunks ([T, L, H, K] etc., any chunk length L)
            -> per-chunk tensors [T, ...] (the rows ``step`` takes).
        step: ``(state [n, H, K, V], *rows)`` -> (outputs [n, H, L, V], end states [n, H, K, V], values):
            ``values`` [n, H, L, V] are the values the state update adds (the delta rule's corrected
            values ``u - w @ state``), None where they are the plain inputs v.
        output: ``step`` without the end states, (outputs, values): a path's last chunk whose end state
            nobody reads.
        state_at: ``(state [R, H, K, V], values, take, upto [R])`` -> [R, H, K, V] the state after row
            ``upto[r]`` of chunk r from its start state; ``values`` [R, H, L, V] are those chunks' ``step``
            values (or None), ``take(name)`` gathers their prepared input ``name`` head-major ("k", "v", "g":
            [R, H, L, ...]), so a kind gathers only what it uses (see :func:`prefix_state`).
    """

    intra: Callable[..., tuple[torch.Tensor, ...]]
    step: Step
    output: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    state_at: Callable[..., torch.Tensor]


def linear_call(kind: str, q: torch.Tensor, v: torch.Tensor, chunk_size: int, **_) -> Call:
    """The :class:`~harts_hf.ops.backends.Call` of a linear ``kind``'s public op: q [N, Hk, K],
    v [N, H, V] on the chunk grid ``chunk_size``."""
    return Call(kind, q.device, chunk_size, key_dim=q.shape[-1], value_dim=v.shape[-1])


def grid_tables(call: Call) -> tuple[Table, ...]:
    """The tables every linear backend reads: the rounds (the grid states live on) and the
    context tokens its paths replay."""
    return RoundsTable(call.chunk_size), ReplayTable(call.chunk_size)


def torch_tables(call: Call) -> tuple[Table, ...]:
    """The tables :func:`run_tree_linear_attention` (every torch backend) reads."""
    return (*grid_tables(call), RaggedLayoutTable(call.chunk_size))


def _fits(shape: Sequence[int], target: Sequence[int]) -> bool:
    """``shape`` is ``target`` with some dimensions possibly 1 (broadcast)."""
    return len(shape) == len(target) and all(s in (1, t) for s, t in zip(shape, target))


def linear_inputs_check(*, per_channel: bool) -> Callable[..., None]:
    """The :func:`~harts_hf.ops.backends.dispatch` check of a linear kind (``per_channel``: g has a
    decay per key channel): q [N, Hq, K], k [N, Hk, K] and v [N, H, V] with H a multiple of Hq and Hk
    (each repeated to H heads; Jamba shares one query head between all channels); g [N, H] or [N, H, K];
    beta [N, H]; g_gamma [H] (size-1 dimensions broadcast); all floating point. A mismatch is refused
    here rather than broadcast into another recurrence or failing deep in a kernel."""

    def check(q, k, v, g, beta=None, *, g_gamma=None, **_) -> None:
        given = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "g_gamma": g_gamma}
        given = {name: x for name, x in given.items() if x is not None}
        shapes = ", ".join(f"{name} {tuple(x.shape)}" for name, x in given.items())
        for name, x in given.items():
            if not x.is_floating_point():
                raise ValueError(f"{name} must be floating point, got {x.dtype}")
        fits = lambda x: x.dim() == 3 and v.shape[1] % x.shape[1] == 0
        if v.dim() != 3 or not (fits(q) and fits(k)) or q.shape[2] != k.shape[2]:
            raise ValueError(f"{shapes}: need q [N, Hq, K], k [N, Hk, K], v [N, H, V] with H a multiple of Hq and Hk")
        heads, key_dim = v.shape[1], q.shape[2]  # token counts: checked against the batch by Rounds.check_inputs
        gate = (heads, key_dim) if per_channel else (heads,)
        if g is not None and not _fits(g.shape[1:], gate):
            raise ValueError(
                f"{shapes}: g must be [N, {', '.join(map(str, gate))}] (log-decay per token, head{', channel' * per_channel})"
            )
        if beta is not None and not _fits(beta.shape[1:], (heads,)):
            raise ValueError(f"{shapes}: beta must be [N, {heads}]")
        if g_gamma is not None and not _fits(g_gamma.shape, (heads,)):
            raise ValueError(f"{shapes}: g_gamma must be [{heads}] (one log-decay per head)")

    return check


def expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[N, Hk, D] -> [N, heads, D] fp32, each key head repeated for its group of value heads (GVA)."""
    if heads % x.shape[1]:
        raise ValueError(f"{heads} value heads is not a multiple of {x.shape[1]} key heads")
    return x.float().repeat_interleave(heads // x.shape[1], dim=1)


def masked_exp(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x.masked_fill(keep == 0, -inf).exp()`` to the bit (values and gradient) for a finite ``x``;
    ``keep`` holds 1 / 0 in x's dtype (broadcast). The masked entries are zeroed before ``exp`` and
    after, because CPU ``exp`` takes a slow path on every input that underflows (-inf included), and a
    causal mask is about half of a chunk's pairs; multiplying the kept ones by 1 leaves them as they are."""
    return (x * keep).exp() * keep


def prefix_state(
    state: torch.Tensor, k: torch.Tensor, values: torch.Tensor, g: torch.Tensor, upto: torch.Tensor
) -> torch.Tensor:
    """The state after row i = ``upto[r]`` of chunk r, the chunk-end update of every kind truncated at i:
    ``exp(G_i) * state + sum_{s <= i} (k_s * exp(G_i - G_s))^T values_s``, G the chunk's cumulative
    log-decay (scalar per head or per key channel).

    state [R, H, K, V] at the chunk's start; k [R, H, L, K]; values [R, H, L, V] (the delta rule's
    corrected values ``u - w @ state``, plain v otherwise); g [R, H, L] or [R, H, L, K]; upto [R].
    """
    cum = g.float().cumsum(2)  # [R, H, L] or [R, H, L, K]
    cum = cum if cum.dim() == 4 else cum.unsqueeze(-1)  # [R, H, L, K or 1]
    at = cum.gather(2, upto.view(-1, 1, 1, 1).expand(-1, cum.shape[1], 1, cum.shape[3]))  # [R, H, 1, K|1]
    upto_here = (torch.arange(k.shape[2], device=k.device) <= upto[:, None]).to(cum.dtype)  # [R, L]
    rel = masked_exp(at - cum, upto_here[:, None, :, None])  # [R, H, L, K|1]
    keys = k.float() * rel  # [R, H, L, K]
    return torch.addcmul(keys.transpose(-1, -2) @ values, state, at.exp().transpose(-1, -2))


def scan_steps(
    h0: torch.Tensor,
    step_counts: list[int],
    per_chunk: Sequence[torch.Tensor],
    step: Step,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inter-chunk recurrence of a step-major round, for any kind's kernel.

    ``per_chunk`` are [Tc, ...] tensors; ``step(state, *rows)`` gets the start states [n_m, H, K, V]
    of the active paths and their rows of every ``per_chunk`` tensor at chunk step m, and returns
    (outputs [n_m, ...], end states, values). Rows are taken by ``split``, not slicing: a slice's backward
    writes a zero-filled full-size gradient per step, which makes backward quadratic in Tc.
    Returns (cat of outputs [Tc, ...], h_start [Tc, H, K, V], h_final [P, H, K, V]).
    """
    state = h0  # [P, H, K, V]
    outs, starts, finals = [], [], []
    for m, rows in enumerate(zip(*(x.split(step_counts) for x in per_chunk))):
        starts.append(state)
        o, state, _ = step(state, *rows)
        outs.append(o)
        n_next = step_counts[m + 1] if m + 1 < len(step_counts) else 0
        if n_next < state.shape[0]:  # paths n_next.. end at this step
            state, done = state.split([n_next, state.shape[0] - n_next])
            finals.append(done)
    # Later steps finish lower path indices: reverse to restore path order.
    return torch.cat(outs), torch.cat(starts), torch.cat(finals[::-1])


def chunk_scan(
    kernel: ChunkKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    h0: torch.Tensor,
    step_counts: list[int],
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernel`` on one step-major round of full chunks (the ``<kind>_chunk_scan`` interface):
    q, k [Tc, C, H, K], v [Tc, C, H, V], h0 [P, H, K, V] -> (o [Tc, C, H, V], h_start [Tc, H, K, V],
    h_final [P, H, K, V])."""
    per_chunk = kernel.intra(q, k, v, g, beta, scale=scale)
    o, h_start, h_final = scan_steps(h0.float(), step_counts, per_chunk, kernel.step)
    return o.transpose(1, 2), h_start, h_final


def scan_ragged(
    h0: torch.Tensor,
    rnd: ScanRound,
    rows: Sequence[Iterator[tuple[torch.Tensor, ...]]],
    kernel: ChunkKernel,
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], torch.Tensor | None, torch.Tensor | None]:
    """:func:`scan_steps` on a round of the ragged layout (``ragged_layout.py``): ``rows[j]`` yields the
    per-chunk tensors of length j visit by visit; h0 [P, H, K, V] in step 0's visiting order. Only the
    states ``rnd`` keeps are materialised, and the paths' end states only if ``rnd.finals`` (else the
    ending visits compute their outputs alone). Returns (per length the outputs [n, H, L, V] of its
    visits, per length the ``step`` values of its visits (empty where None), the kept chunk-start states
    [Ks, H, K, V] or None, h_final [P, H, K, V] by rank or None)."""
    state = h0  # [n_m, H, K, V] in visiting order
    outs: list[list[torch.Tensor]] = [[] for _ in rows]
    values: list[list[torch.Tensor]] = [[] for _ in rows]
    kept, finals = [], []
    for step in rnd.steps:
        if step.keep is not None:
            kept.append(state if isinstance(step.keep, slice) else take_rows(state, step.keep))
        ends = []
        for i, (states, (j, _)) in enumerate(zip(state.split([n for _, n in step.visits]), step.visits)):
            if i < step.following or rnd.finals:
                o, end, vals = kernel.step(states, *next(rows[j]))
                (ends if i < step.following else finals).append(end)
            else:
                o, vals = kernel.output(states, *next(rows[j]))
            outs[j].append(o)
            if vals is not None:
                values[j].append(vals)
        if ends:
            state = torch.cat(ends) if len(ends) > 1 else ends[0]
            state = state if step.order is None else take_rows(state, step.order)
    h_start = torch.cat(kept) if kept else None
    h_final = take_rows(torch.cat(finals), rnd.final_order) if rnd.finals else None
    return outs, values, h_start, h_final


def run_tree_linear_attention(
    kernel: ChunkKernel,
    batch: TreeBatch,
    chunk_size: int,
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    scale: float,
    context: Mapping[str, torch.Tensor] | None = None,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``kernel`` over every path of ``batch``, one ragged scan per round (module docstring).

    Handoffs stay in autograd: a state given to several child paths is gathered once per child, so
    its gradient is the sum of theirs.
    """
    own = {"q": q, "k": k, "v": v, "g": g} | ({} if beta is None else {"beta": beta})
    rounds_of(batch, chunk_size).check_inputs(own, context, initial_states)
    H, K, V = v.shape[1], k.shape[-1], v.shape[-1]
    zeros = q.new_zeros(1, H, K, V)
    h_in = zeros if initial_states is None else torch.cat((zeros, initial_states.to(zeros)))
    layout = ragged_layout_of(batch, chunk_size)

    replayed = context_replay_of(batch, chunk_size).numel()
    tables = {
        name: input_table(x, None if context is None or name == "q" else context[name], replayed)
        for name, x in own.items()
    }
    sizes = [length * n for length, n in zip(layout.lengths, layout.chunks)]
    split = {name: take_rows(t, layout.gather).split(sizes) for name, t in tables.items()}
    inputs, rows = [], []  # per length: prepared inputs {name: [T, L, H, ...]}; the intra rows, visit by visit
    for j, (length, n) in enumerate(zip(layout.lengths, layout.chunks)):
        x = {name: parts[j].unflatten(0, (n, length)) for name, parts in split.items()}
        per_chunk = kernel.intra(x["q"], x["k"], x["v"], x["g"], x.get("beta"), scale=scale)
        inputs.append(x)
        rows.append(iter(list(zip(*(t.split(layout.sections[j]) for t in per_chunk)))))

    outs: list[list[torch.Tensor]] = [[] for _ in layout.lengths]  # per length, every visit's [n, H, L, V]
    picked = []
    for rnd in layout.rounds:
        o, values, h_start, h_final = scan_ragged(take_rows(h_in, rnd.h0), rnd, rows, kernel)
        for j, out in enumerate(o):
            outs[j] += out
        mids = [  # [R, H, K, V] states after rows of this round's chunks, for the next round's paths
            kernel.state_at(
                take_rows(h_start, mid.start),
                take_rows(torch.cat(values[mid.length]), mid.local) if values[mid.length] else None,
                lambda name, x=inputs[mid.length], chunk=mid.chunk: take_rows(x[name].transpose(1, 2), chunk),
                mid.row,
            )
            for mid in rnd.mids
        ]
        later = [x for x in (h_start, h_final, *mids) if x is not None]  # the states later rounds read
        h_in = later[0] if len(later) == 1 else torch.cat(later) if later else None
        if rnd.picks is not None:
            picked.append(take_rows(h_in, rnd.picks))
    flat = [torch.cat(o).transpose(1, 2).flatten(0, 1) for o in outs]  # [T_j * L_j, H, V]
    o = take_rows(torch.cat(flat), layout.output)  # [N, H, V]
    if chunk_size not in batch.state_out:
        return o, None
    return o, take_rows(torch.cat(picked), layout.pick_order) if picked else zeros[:0]


def run_tree_kind(
    kernel: ChunkKernel,
    batch: TreeBatch,
    chunk_size: int,
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    qk_norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    context: Mapping[str, torch.Tensor] | None = None,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The common body of every kind's torch backend: fp32 inputs, ``qk_norm`` (fp32) of q and k,
    key heads expanded to the value heads (GVA), scale K^-0.5 by default; output in v's dtype."""
    heads = v.shape[1]

    def prep_qk(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return expand_heads(x if qk_norm is None else qk_norm(x), heads)

    ctx = None
    if context is not None:
        names = ("k", "v", "g") + (() if beta is None else ("beta",))
        ctx = {n: prep_qk(context[n]) if n == "k" else context[n].float() for n in names if n in context}
    o, states = run_tree_linear_attention(
        kernel,
        batch,
        chunk_size,
        q=prep_qk(q),
        k=prep_qk(k),
        v=v.float(),
        g=g.float(),
        beta=None if beta is None else beta.float(),
        scale=k.shape[-1] ** -0.5 if scale is None else scale,
        context=ctx,
        initial_states=initial_states,
    )
    return o.to(v.dtype), states
