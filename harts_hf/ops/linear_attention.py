"""The tree driver shared by every chunkwise linear-attention kind (GDN, KDA, GLA, simple GLA).

``rounds.py`` cuts the tree into chunk-aligned paths grouped into rounds; this driver runs the
rounds in order, each as ONE call of the kind's chunk-scan kernel on all of its paths packed
*step-major*: chunk 0 of paths 0..n_0-1, then chunk 1 of paths 0..n_1-1, ... (paths sorted by
chunk count, descending; ``step_counts = [n_0, n_1, ...]``; tails padded with the neutral token
q=k=v=0, g=0, beta=0). A path's initial state is a boundary state of its parent path from the
previous round (or zeros / a caller-given state for root paths); replayed tokens' outputs are
dropped. The per-kind kernels share the inter-chunk loop, :func:`scan_steps`.

Signature (stable; the per-kind wrappers in ``gated_delta.py``, ``kda.py``, ``gla.py`` call it)::

    run_tree_linear_attention(
        kernel,                  # <kind>_chunk_scan(q, k, v, g, beta, h0, step_counts, *, scale)
        batch: TreeBatch,
        chunk_size: int,
        *,
        q, k, v, g, beta,        # own (piece) tokens, fp32, prepared: l2-normalised if the layer asks,
                                 # q/k heads already expanded to the value-head count H
                                 # q, k [N, H, K]; v [N, H, V]; g [N, H] or [N, H, K]; beta [N, H] or None
        scale: float,
        context=None,            # {"k", "v", "g", "beta"} [Nc, ...] of the context tokens, prepared like
                                 # the own inputs ("beta" only for delta-rule kinds; other keys ignored);
                                 # needed iff rounds_of(batch, chunk_size).context_replay is non-empty
        initial_states=None,     # [E, H, K, V] fp32, the state after each of
                                 # rounds_of(batch, chunk_size).external_tokens (E of them, in that order)
        state_out_tokens=None,   # [S] combined indices of piece tokens t with (position[t] + 1) % C == 0
    ) -> tuple[o, states_out]    # o [N, H, V] fp32; states_out [S, H, K, V] fp32 (None if not asked)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from .rounds import rounds_of
from .tree_batch import TreeBatch

__all__ = ["ChunkScan", "expand_heads", "run_tree_linear_attention", "scan_steps"]

# (q, k, v, g, beta, h0, step_counts, *, scale) -> (o [Tc, C, H, V], h_start [Tc, H, K, V], h_final [P, H, K, V])
ChunkScan = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[N, Hk, D] -> [N, heads, D] fp32, each key head repeated for its group of value heads (GVA)."""
    if heads % x.shape[1]:
        raise ValueError(f"{heads} value heads is not a multiple of {x.shape[1]} key heads")
    return x.float().repeat_interleave(heads // x.shape[1], dim=1)


def scan_steps(
    h0: torch.Tensor,
    step_counts: list[int],
    per_chunk: Sequence[torch.Tensor],
    step: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inter-chunk recurrence of a step-major round, for any kind's kernel.

    ``per_chunk`` are [Tc, ...] tensors; ``step(state, *rows)`` gets the start states [n_m, H, K, V]
    of the active paths and their rows of every ``per_chunk`` tensor at chunk step m, and returns
    (outputs [n_m, ...], end states). Rows are taken by ``split``, not slicing: a slice's backward
    writes a zero-filled full-size gradient per step, which makes backward quadratic in Tc.
    Returns (cat of outputs [Tc, ...], h_start [Tc, H, K, V], h_final [P, H, K, V]).
    """
    state = h0  # [P, H, K, V]
    outs, starts, finals = [], [], []
    for m, rows in enumerate(zip(*(x.split(step_counts) for x in per_chunk))):
        starts.append(state)
        o, state = step(state, *rows)
        outs.append(o)
        n_next = step_counts[m + 1] if m + 1 < len(step_counts) else 0
        if n_next < state.shape[0]:  # paths n_next.. end at this step
            state, done = state.split([n_next, state.shape[0] - n_next])
            finals.append(done)
    # Later steps finish lower path indices: reverse to restore path order.
    return torch.cat(outs), torch.cat(starts), torch.cat(finals[::-1])


def _combined(own: torch.Tensor, ctx: torch.Tensor | None, num_context: int) -> torch.Tensor:
    """[Nc + N + 1, ...] context rows, own rows, and a zero row that packed index -1 selects
    (neutral padding). Without ``ctx`` the context rows are zeros: the q of replayed tokens (their
    outputs are dropped), or every input of a piece that replays no context token."""
    if ctx is None:
        ctx = own.new_zeros((num_context, *own.shape[1:]))
    return torch.cat((ctx.to(own), own, own.new_zeros((1, *own.shape[1:]))))


def run_tree_linear_attention(
    kernel: ChunkScan,
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
    state_out_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a chunk-scan kernel over every path of ``batch``, one call per round (module docstring).

    Handoffs stay in autograd: a boundary state given to several child paths is gathered once per
    child, so its gradient is the sum of theirs.
    """
    rounds = rounds_of(batch, chunk_size)
    nc, n = batch.num_context, batch.num_tokens
    if q.shape[0] != n:
        raise ValueError(f"inputs have {q.shape[0]} tokens but the batch has {n} piece tokens")
    if rounds.context_replay.numel() and context is None:
        raise ValueError(
            f"this piece replays {rounds.context_replay.numel()} context tokens: pass their inputs as `context`"
        )
    num_ext = rounds.external_tokens.numel()
    if (0 if initial_states is None else initial_states.shape[0]) != num_ext:
        raise ValueError(
            f"this piece needs initial_states for its {num_ext} external boundary states (Rounds.external_tokens)"
        )
    H, K, V = v.shape[1], k.shape[-1], v.shape[-1]
    zeros = q.new_zeros(1, H, K, V)
    h_in = zeros if initial_states is None else torch.cat((zeros, initial_states.to(zeros)))

    own = {"k": k, "v": v, "g": g} | ({} if beta is None else {"beta": beta})
    tables = {"q": _combined(q, None, nc)}
    tables |= {name: _combined(x, None if context is None else context[name], nc) for name, x in own.items()}

    outs, states = [], []
    for rnd in rounds.rounds:
        packed = {name: t[rnd.gather].unflatten(0, (-1, chunk_size)) for name, t in tables.items()}
        h0 = h_in[rnd.h0_index]  # [P, H, K, V]
        o, h_start, h_final = kernel(
            packed["q"], packed["k"], packed["v"], packed["g"], packed.get("beta"), h0, rnd.step_counts, scale=scale
        )
        outs.append(o.flatten(0, 1)[rnd.own_slot])  # [n_r, H, V]
        h_in = torch.cat((h_start, h_final))  # [Tc + P, H, K, V] boundary states of the round
        if state_out_tokens is not None:
            states.append(h_in)
    o = torch.cat(outs)[rounds.restore]  # [N, H, V]

    if state_out_tokens is None:
        return o, None
    rnd_of, row = rounds.state_index(torch.as_tensor(state_out_tokens).cpu().numpy())
    by_round = np.argsort(rnd_of, kind="stable")
    picked = [st[torch.as_tensor(row[rnd_of == r], device=st.device)] for r, st in enumerate(states)]
    return o, torch.cat(picked)[torch.as_tensor(np.argsort(by_round), device=o.device)]


def run_tree_kind(
    kernel: ChunkScan,
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
    state_out_tokens: torch.Tensor | None = None,
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
        ctx = {n: prep_qk(context[n]) if n == "k" else context[n].float() for n in names}
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
        state_out_tokens=state_out_tokens,
    )
    return o.to(v.dtype), states
