"""Kernel kinds: the tree-side replacement of each transformers kernel function, shared by families.

A modeling module's kernel function (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ...)
is wrapped once (``patch.py``); on a tree call the wrapper binds the call's arguments to the
original signature and hands them, by parameter name, to the kind's ``tree_call``. Every kind
reshapes transformers' batch-of-one layout ([1, N, ...], conv: [1, D, N]) to the token-major
layout of ``harts_hf.ops`` ([N, ...]) and back, so family code never sees trees. A mixer without
a module-level kernel (MiniMax's lightning attention) has its ``forward`` wrapped the same way;
its kind re-states the projections around the tree op and names the source lines it relies on.

Legend: N compact tokens, D channels, W conv width, H heads, K key dim, V value dim,
P mamba head dim, G groups, S state size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..ops.conv import tree_causal_conv1d
from ..ops.gated_delta import tree_gated_delta_rule
from ..ops.gla import tree_lightning, tree_mamba2_ssd
from ..ops.kda import tree_kda
from ..ops.tree_batch import TreeBatch

__all__ = ["KINDS", "TREE_KWARG", "KernelKind", "context_of"]

Arguments = Mapping[str, Any]

TREE_KWARG = "harts_tree"  # the forward kwarg that carries the TreeBatch down to every layer


@dataclass(frozen=True)
class KernelKind:
    """One kernel function shape: the parameters the original must accept and the code it must
    still contain (a module whose function lost either is refused), and the tree implementation
    taking the bound arguments."""

    name: str
    params: tuple[str, ...]
    tree_call: Callable[[TreeBatch, Arguments], Any]
    source_markers: tuple[str, ...] = ()


def _single_row(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.shape[0] != 1:
        raise ValueError(f"harts-hf tree calls run one packed row: {name} has batch size {x.shape[0]}")
    return x[0]


def _stateless(a: Arguments, state_in: str, state_out: str | None = None) -> None:
    """Trees hand states between paths themselves: a cache state here means use_cache was on."""
    if a[state_in] is not None or (state_out is not None and a[state_out]):
        raise ValueError("harts-hf tree calls run without a cache: call the model with use_cache=False")


def context_of(batch: TreeBatch, name: str, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The context rows of this layer call's inputs ``values`` ([N, ...] each) when the batch is a
    piece run by the engine (which also keeps the rows later pieces read); None for a whole forest."""
    handoff = batch.handoff
    return None if handoff is None else handoff.context(handoff.call(name), values)


def _linear(
    batch: TreeBatch,
    name: str,
    values: Mapping[str, torch.Tensor],
    chunk_size: int,
    run: Callable,
) -> torch.Tensor:
    """``run(context, initial_states, state_out_tokens) -> (o, states)`` with the piece's handoff:
    context inputs and boundary states in, the states later pieces start from kept."""
    handoff = batch.handoff
    if handoff is None:
        return run(None, None, None)[0]
    key = handoff.call(name)
    o, states = run(
        handoff.context(key, values),
        handoff.initial_states(key, chunk_size),
        handoff.state_out_tokens(chunk_size),
    )
    handoff.keep_states(key, states)
    return o


def _conv(batch: TreeBatch, a: Arguments) -> torch.Tensor:
    x = _single_row(a["hidden_states"], "hidden_states")  # [D, N]
    weight = a["weight"]  # [D, W]
    x = x.t().to(weight.dtype)  # [N, D]
    context = context_of(batch, "conv", {"x": x})
    out = tree_causal_conv1d(
        x,
        weight,
        a["bias"],
        batch,
        activation=a["activation"],
        context_x=None if context is None else context["x"],
    )  # [N, D]
    return out.t().unsqueeze(0).to(a["hidden_states"].dtype)  # [1, D, N]


def _delta_rule(name: str, op: Callable) -> Callable[[TreeBatch, Arguments], tuple[torch.Tensor, None]]:
    def call(batch: TreeBatch, a: Arguments) -> tuple[torch.Tensor, None]:
        _stateless(a, "initial_state", "output_final_state")
        q = _single_row(a["query"], "query")  # [N, Hk, K]
        values = {
            "k": _single_row(a["key"], "key"),  # [N, Hk, K]
            "v": _single_row(a["value"], "value"),  # [N, H, V]
            "g": _single_row(a["g"], "g"),  # [N, H] (GDN) or [N, H, K] (KDA)
            "beta": _single_row(a["beta"], "beta"),  # [N, H]
        }
        run = lambda context, states, out: op(
            q,
            *values.values(),
            batch,
            scale=q.shape[-1] ** -0.5,
            use_qk_l2norm=bool(a["use_qk_l2norm_in_kernel"]),
            chunk_size=a["chunk_size"],
            context=context,
            initial_states=states,
            state_out_tokens=out,
        )
        o = _linear(batch, name, values, a["chunk_size"], run)
        return o.unsqueeze(0).to(a["query"].dtype), None  # [1, N, H, V]

    return call


def _mamba2_scan(batch: TreeBatch, a: Arguments) -> torch.Tensor:
    """transformers' ``mamba2_chunk_scan``; the op discretises dt exactly as it does."""
    _stateless(a, "initial_states", "return_final_states")
    values = {
        "x": _single_row(a["hidden_states"], "hidden_states"),  # [N, H, P]
        "dt": _single_row(a["dt"], "dt"),  # [N, H] raw time steps
        "B": _single_row(a["B"], "B"),  # [N, G, S]
    }
    run = lambda context, states, out: tree_mamba2_ssd(
        values["x"],
        values["dt"],
        a["A"],  # [H]
        values["B"],
        _single_row(a["C"], "C"),  # [N, G, S]
        a["D"],  # [H]
        batch,
        chunk_size=a["chunk_size"],
        dt_bias=a["dt_bias"],
        dt_softplus=a["dt_softplus"],
        dt_limit=a["dt_limit"],
        context=context,
        initial_states=states,
        state_out_tokens=out,
    )
    return _linear(batch, "mamba2_scan", values, a["chunk_size"], run).unsqueeze(0)  # [1, N, H, P] fp32


def _lightning_mixer(batch: TreeBatch, a: Arguments) -> tuple[torch.Tensor, None]:
    """MiniMax's ``MiniMaxLightningAttention.forward`` (no module-level kernel to swap): the same
    projections, the block recurrence as the lightning tree op, the same norm, gate and output."""
    _stateless(a, "past_key_values")
    layer = a["self"]
    x = _single_row(a["hidden_states"], "hidden_states")  # [N, E]
    qkv = layer.act_fn(layer.qkv_proj(x)).reshape(x.shape[0], layer.num_attention_heads, 3 * layer.head_dim)
    q, k, v = torch.split(qkv, layer.head_dim, dim=-1)  # [N, H, D] each
    run = lambda context, states, out: tree_lightning(
        q,
        k,
        v,
        layer.slope_rate,
        batch,
        chunk_size=layer.block_size,
        context=context,
        initial_states=states,
        state_out_tokens=out,
    )
    o = _linear(batch, "lightning_mixer", {"k": k, "v": v}, layer.block_size, run)  # [N, H, D]
    o = layer.norm(o.reshape(x.shape[0], -1))
    o = torch.sigmoid(layer.output_gate(x)) * o
    return layer.out_proj(o).unsqueeze(0), None  # [1, N, E]


def _no_fused_path(batch: TreeBatch, a: Arguments) -> None:
    """The fused mamba_ssm path: returning None sends the mixer down its unfused path."""
    return


_DELTA_PARAMS = (
    "query",
    "key",
    "value",
    "g",
    "beta",
    "chunk_size",
    "initial_state",
    "output_final_state",
)

KINDS: dict[str, KernelKind] = {
    kind.name: kind
    for kind in (
        KernelKind("conv", ("hidden_states", "weight", "bias", "activation"), _conv),
        KernelKind(
            "gated_delta",
            _DELTA_PARAMS + ("use_qk_l2norm_in_kernel",),
            _delta_rule("gated_delta", tree_gated_delta_rule),
        ),
        KernelKind(
            "kda",
            _DELTA_PARAMS + ("use_qk_l2norm_in_kernel",),
            _delta_rule("kda", tree_kda),
        ),
        KernelKind(
            "mamba2_scan",
            (
                "hidden_states",
                "dt",
                "A",
                "B",
                "C",
                "chunk_size",
                "D",
                "dt_bias",
                "initial_states",
                "dt_softplus",
                "dt_limit",
                "return_final_states",
            ),
            _mamba2_scan,
        ),
        KernelKind("mamba2_fused", ("zxbcdt",), _no_fused_path),
        KernelKind(
            "lightning_mixer",
            ("self", "hidden_states", "attention_mask", "past_key_values", "kwargs"),
            _lightning_mixer,
            source_markers=(
                "self.act_fn(self.qkv_proj(hidden_states))",
                "self.slope_rate",
                "self.norm(attn_output)",
                "F.sigmoid(self.output_gate(hidden_states)) * attn_output",
                "self.out_proj(attn_output)",
            ),
        ),
    )
}
