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

__all__ = ["KINDS", "TREE_KWARG", "KernelKind"]

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


def _conv(batch: TreeBatch, a: Arguments) -> torch.Tensor:
    x = _single_row(a["hidden_states"], "hidden_states")  # [D, N]
    weight = a["weight"]  # [D, W]
    out = tree_causal_conv1d(x.t().to(weight.dtype), weight, a["bias"], batch, activation=a["activation"])  # [N, D]
    return out.t().unsqueeze(0).to(x.dtype)  # [1, D, N]


def _delta_rule(op: Callable) -> Callable[[TreeBatch, Arguments], tuple[torch.Tensor, None]]:
    def call(batch: TreeBatch, a: Arguments) -> tuple[torch.Tensor, None]:
        _stateless(a, "initial_state", "output_final_state")
        q = _single_row(a["query"], "query")  # [N, Hk, K]
        o, _ = op(
            q,
            _single_row(a["key"], "key"),
            _single_row(a["value"], "value"),  # [N, H, V]
            _single_row(a["g"], "g"),  # [N, H] (GDN) or [N, H, K] (KDA)
            _single_row(a["beta"], "beta"),  # [N, H]
            batch,
            scale=q.shape[-1] ** -0.5,
            use_qk_l2norm=bool(a["use_qk_l2norm_in_kernel"]),
            chunk_size=a["chunk_size"],
        )
        return o.unsqueeze(0).to(a["query"].dtype), None  # [1, N, H, V]

    return call


def _mamba2_scan(batch: TreeBatch, a: Arguments) -> torch.Tensor:
    """transformers' ``mamba2_chunk_scan``; the op discretises dt exactly as it does."""
    _stateless(a, "initial_states", "return_final_states")
    y, _ = tree_mamba2_ssd(
        _single_row(a["hidden_states"], "hidden_states"),  # [N, H, P]
        _single_row(a["dt"], "dt"),  # [N, H] raw time steps
        a["A"],  # [H]
        _single_row(a["B"], "B"),  # [N, G, S]
        _single_row(a["C"], "C"),  # [N, G, S]
        a["D"],  # [H]
        batch,
        chunk_size=a["chunk_size"],
        dt_bias=a["dt_bias"],
        dt_softplus=a["dt_softplus"],
        dt_limit=a["dt_limit"],
    )
    return y.unsqueeze(0)  # [1, N, H, P] fp32, like the original


def _lightning_mixer(batch: TreeBatch, a: Arguments) -> tuple[torch.Tensor, None]:
    """MiniMax's ``MiniMaxLightningAttention.forward`` (no module-level kernel to swap): the same
    projections, the block recurrence as the lightning tree op, the same norm, gate and output."""
    _stateless(a, "past_key_values")
    layer = a["self"]
    x = _single_row(a["hidden_states"], "hidden_states")  # [N, E]
    qkv = layer.act_fn(layer.qkv_proj(x)).reshape(x.shape[0], layer.num_attention_heads, 3 * layer.head_dim)
    q, k, v = torch.split(qkv, layer.head_dim, dim=-1)  # [N, H, D] each
    o, _ = tree_lightning(q, k, v, layer.slope_rate, batch, chunk_size=layer.block_size)  # [N, H, D]
    o = layer.norm(o.reshape(x.shape[0], -1))
    o = torch.sigmoid(layer.output_gate(x)) * o
    return layer.out_proj(o).unsqueeze(0), None  # [1, N, E]


def _no_fused_path(batch: TreeBatch, a: Arguments) -> None:
    """The fused mamba_ssm path: returning None sends the mixer down its unfused path."""
    return


_DELTA_PARAMS = ("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state")

KINDS: dict[str, KernelKind] = {
    kind.name: kind
    for kind in (
        KernelKind("conv", ("hidden_states", "weight", "bias", "activation"), _conv),
        KernelKind("gated_delta", _DELTA_PARAMS + ("use_qk_l2norm_in_kernel",), _delta_rule(tree_gated_delta_rule)),
        KernelKind("kda", _DELTA_PARAMS + ("use_qk_l2norm_in_kernel",), _delta_rule(tree_kda)),
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
