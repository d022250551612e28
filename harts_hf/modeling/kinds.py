"""Kernel kinds: the tree-side replacement of each transformers kernel function, shared by families.

A modeling module's kernel function (``causal_conv1d_forward``, ``torch_chunk_gated_delta_rule``,
``mamba2_scan_forward``, ...; transformers 5.23: ``causal_conv1d_fn``, ``mamba2_chunk_scan``) is
wrapped once (``patch.py``); on a tree call the wrapper binds the call's arguments to the
original signature and hands them, by parameter name, to the kind's ``tree_call``. Every kind
reshapes transformers' batch-of-one layout ([1, N, ...], conv: [1, D, N]) to the token-major
layout of ``harts_hf.ops`` ([N, ...]) and back, so family code never sees trees. A mixer without
a module-level kernel hook (MiniMax's lightning attention; under transformers 5.23 the Mamba v1
mixers of Jamba, Mamba and FalconMamba, whose selective scan gets no kwargs there) has its
``forward`` wrapped the same way; its kind
re-states the projections around the tree op and names the source lines it relies on. Layers and
models that drop the forward kwargs (Jamba's Mamba decoder layer, Mamba's block and model) are
re-stated the same way, to hand the tree down to the mixer.

A kind also declares the tree-op calls a layer module makes through it (``calls``: op kind, chunk
grid, head dims, conv width, read off the module and the kernel function's defaults), from which
``tables.py`` finds the tree tables the layer reads without running it: the backend registry
(``harts_hf.ops.backends.choose``) picks the implementation of each call as it does when the op
runs, and that implementation names its tables.

Legend: N compact tokens, D channels, W conv width, H heads, K key dim, V value dim,
P mamba head dim, G groups, S state size, E hidden size, I Mamba v1 channels, R dt rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from ..chunking import CHUNK_SIZE
from ..ops.backends import Call
from ..ops.conv import ConvHaloTable, tree_causal_conv1d
from ..ops.gated_delta import tree_gated_delta_rule
from ..ops.gla import tree_gla, tree_lightning, tree_mamba2_ssd
from ..ops.kda import tree_kda
from ..ops.tree_batch import TreeBatch
from . import _compat
from .calls import context_of, linear_call

__all__ = ["KINDS", "TREE_KWARG", "KernelKind", "attention_calls"]

Arguments = Mapping[str, Any]
Calls = Callable[[nn.Module, Arguments, torch.device], tuple[Call, ...]]

TREE_KWARG = "harts_tree"  # the forward kwarg that carries the TreeBatch down to every layer


def _no_calls(module: nn.Module, defaults: Arguments, device: torch.device) -> tuple[Call, ...]:
    return ()


@dataclass(frozen=True)
class KernelKind:
    """One kernel function shape: the parameters the original must accept and the code it must
    still contain (a module whose function lost either is refused), and the tree implementation
    taking the bound arguments. ``restates``: other functions of the modeling module the tree call
    re-implements instead of calling (name -> code each must still contain). ``calls``: the tree-op
    calls its tree implementation makes for a layer ``module`` (the mixer calling the kernel, or
    the module whose forward it replaces), given the kernel function's parameter defaults (empty
    for a replaced forward) and the device the layer runs on."""

    name: str
    params: tuple[str | tuple[str, ...], ...]  # a tuple: the parameter goes by one of these names
    tree_call: Callable[[TreeBatch, Arguments], Any]
    source_markers: tuple[str, ...] = ()
    restates: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    calls: Calls = _no_calls


def attention_calls(module: nn.Module, device: torch.device) -> tuple[Call, ...]:
    """The tree-op calls of an attention layer (``attention.py``: one ancestor attention)."""
    return (Call("attention", device),)


def _conv_calls(module: nn.Module, defaults: Arguments, device: torch.device) -> tuple[Call, ...]:
    """A mixer's conv calls: one per depthwise ``nn.Conv1d`` it holds (what ``causal_conv1d_fn`` and
    ``causal_conv1d_forward`` take; PEFT's LoRA pair around one is not depthwise)."""
    convs = [m for m in module.modules() if isinstance(m, nn.Conv1d) and m.groups == m.in_channels > 1]
    return tuple(Call("conv", device, width=conv.kernel_size[0]) for conv in convs)


def _delta_calls(kind: str, key_dim: str, value_dim: str) -> Calls:
    """A delta-rule mixer's one call, on the kernel function's default chunk grid (the mixers pass none)."""
    return lambda m, defaults, device: (
        Call(kind, device, defaults["chunk_size"], key_dim=getattr(m, key_dim), value_dim=getattr(m, value_dim)),
    )


def _mamba2_calls(m: nn.Module, defaults: Arguments, device: torch.device) -> tuple[Call, ...]:
    """The SSD scan as simple GLA (``tree_mamba2_ssd``): q = C, k = B (S), v = x * dt (P), on the
    mixer's chunk grid."""
    return (Call("simple_gla", device, m.chunk_size, key_dim=m.ssm_state_size, value_dim=m.head_dim),)


def _selective_scan_calls(m: nn.Module, defaults: Arguments, device: torch.device) -> tuple[Call, ...]:
    """:func:`_selective_scan`'s GLA call: K = S, V = 1, on ``CHUNK_SIZE``."""
    return (Call("gla", device, CHUNK_SIZE, key_dim=m.ssm_state_size, value_dim=1),)


def _mamba_v1_calls(m: nn.Module, defaults: Arguments, device: torch.device) -> tuple[Call, ...]:
    """A re-stated Mamba v1 mixer: its conv, then the selective scan."""
    return _conv_calls(m, defaults, device) + _selective_scan_calls(m, defaults, device)


def _lightning_calls(m: nn.Module, defaults: Arguments, device: torch.device) -> tuple[Call, ...]:
    """:func:`_lightning_mixer`'s simple GLA call, on the layer's block grid."""
    return (Call("simple_gla", device, m.block_size, key_dim=m.head_dim, value_dim=m.head_dim),)


def _single_row(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.shape[0] != 1:
        raise ValueError(f"harts-hf tree calls run one packed row: {name} has batch size {x.shape[0]}")
    return x[0]


CACHE = _compat.CACHE_PARAMETERS  # a layer's cache parameter, by whichever name its release gives it


def _stateless(a: Arguments, state_in: str | tuple[str, ...], state_out: str | None = None) -> None:
    """Trees hand states between paths themselves: a cache state here means use_cache was on."""
    state = next(a[name] for name in state_in if name in a) if isinstance(state_in, tuple) else a[state_in]
    if state is not None or (state_out is not None and a[state_out]):
        raise ValueError("harts-hf tree calls run without a cache: call the model with use_cache=False")


def _tree_conv(
    batch: TreeBatch, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn`` on the tree, token-major: x [N, D] -> [N, D] in x's dtype,
    computed in weight's dtype, the halo tokens' inputs taken from the piece's handoff."""
    xw = x.to(weight.dtype)
    context = context_of(batch, "conv", {"x": xw}, rows=ConvHaloTable(weight.shape[1]))
    out = tree_causal_conv1d(
        xw,
        weight,
        bias,
        batch,
        activation=activation,
        context_x=None if context is None else context["x"],
    )
    return out.to(x.dtype)


def _conv(batch: TreeBatch, a: Arguments) -> torch.Tensor:
    x = _single_row(a["hidden_states"], "hidden_states").t()  # [N, D]
    return _tree_conv(batch, x, a["weight"], a["bias"], a["activation"]).t().unsqueeze(0)  # [1, D, N]


def _conv_forward(batch: TreeBatch, a: Arguments) -> torch.Tensor:
    """transformers 5.25's ``causal_conv1d_forward(conv1d, hidden_states, cache, ...)``: without a
    cache it is ``causal_conv1d_fn`` over the module's weight and bias."""
    _stateless(a, CACHE)
    conv1d = a["conv1d"]
    x = _single_row(a["hidden_states"], "hidden_states").t()  # [N, D]
    return _tree_conv(batch, x, conv1d.weight.squeeze(1), conv1d.bias, a["activation"]).t().unsqueeze(0)  # [1, D, N]


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
        run = lambda context, states: op(
            q,
            *values.values(),
            batch,
            scale=q.shape[-1] ** -0.5,
            use_qk_l2norm=bool(a["use_qk_l2norm_in_kernel"]),
            chunk_size=a["chunk_size"],
            context=context,
            initial_states=states,
        )
        o = linear_call(batch, name, values, a["chunk_size"], run)
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
    run = lambda context, states: tree_mamba2_ssd(
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
    )
    return linear_call(batch, "mamba2_scan", values, a["chunk_size"], run).unsqueeze(0)  # [1, N, H, P] fp32


def _mamba2_scan_forward(batch: TreeBatch, a: Arguments) -> torch.Tensor:
    """transformers 5.25's ``mamba2_scan_forward(module, hidden_states, B, C, dt, cache)``: without a
    cache it is ``mamba2_chunk_scan`` over the mixer's parameters (the D skip included)."""
    _stateless(a, CACHE)
    m = a["module"]
    x = _single_row(a["hidden_states"], "hidden_states")  # [N, H * P]
    n = x.shape[0]
    values = {
        "x": x.reshape(n, m.num_heads, m.head_dim),  # [N, H, P]
        "dt": _single_row(a["dt"], "dt"),  # [N, H] raw time steps
        "B": _single_row(a["B"], "B").reshape(n, m.n_groups, m.ssm_state_size),  # [N, G, S]
    }
    run = lambda context, states: tree_mamba2_ssd(
        values["x"],
        values["dt"],
        -torch.exp(m.A_log.float()),  # [H]
        values["B"],
        _single_row(a["C"], "C").reshape(n, m.n_groups, m.ssm_state_size),  # [N, G, S]
        m.D,  # [H]
        batch,
        chunk_size=m.chunk_size,
        dt_bias=m.dt_bias,
        dt_softplus=True,
        dt_limit=m.time_step_limit,
        context=context,
        initial_states=states,
    )
    return linear_call(batch, "mamba2_scan", values, m.chunk_size, run).reshape(1, n, -1)  # [1, N, H * P] fp32


def _lightning_mixer(batch: TreeBatch, a: Arguments) -> tuple[torch.Tensor, None]:
    """MiniMax's ``MiniMaxLightningAttention.forward`` (no module-level kernel to swap): the same
    projections, the block recurrence as the lightning tree op, the same norm, gate and output."""
    _stateless(a, CACHE)
    layer = a["self"]
    x = _single_row(a["hidden_states"], "hidden_states")  # [N, E]
    qkv = layer.act_fn(layer.qkv_proj(x)).reshape(x.shape[0], layer.num_attention_heads, 3 * layer.head_dim)
    q, k, v = torch.split(qkv, layer.head_dim, dim=-1)  # [N, H, D] each
    run = lambda context, states: tree_lightning(
        q,
        k,
        v,
        layer.slope_rate,
        batch,
        chunk_size=layer.block_size,
        context=context,
        initial_states=states,
    )
    o = linear_call(batch, "lightning_mixer", {"k": k, "v": v}, layer.block_size, run)  # [N, H, D]
    o = layer.norm(o.reshape(x.shape[0], -1))
    o = torch.sigmoid(layer.output_gate(x)) * o
    return layer.out_proj(o).unsqueeze(0), None  # [1, N, E]


def _selective_scan(
    batch: TreeBatch,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
) -> torch.Tensor:
    """transformers' ``mamba_selective_scan`` (Mamba v1, ``delta_softplus``), token-major, as GLA with
    one head per channel (H = I, K = S, V = 1): q = C, k = dt * B, v = x, g = dt * A, scale 1; dt, the
    D skip and the silu(z) gate in the stock dtypes.

    Args:
        x, dt, z: [N, I] (dt raw, before ``delta_bias`` and softplus); A: [I, S] fp32; B, C: [N, S];
            D, delta_bias: [I] fp32.

    Returns:
        [N, I] in the stock scan's dtype (fp32 once the fp32 D is added).
    """

    def discretize(raw: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Raw {"x", "dt", "B"} [n, ...] -> GLA {"k", "v", "g"} [n, I, ...]."""
        steps = raw["dt"] if delta_bias is None else raw["dt"] + delta_bias.to(raw["dt"].dtype)
        steps = F.softplus(steps).float()[..., None]  # [n, I, 1]
        return {"k": steps * raw["B"].float()[:, None], "v": raw["x"][..., None], "g": A * steps}

    values = {"x": x, "dt": dt, "B": B}  # what context tokens hand over: raw, I + I + S per token
    own = discretize(values)
    run = lambda context, states: tree_gla(
        C[:, None],  # [N, 1, S]: one key head shared by every channel
        own["k"],
        own["v"],
        own["g"],
        batch,
        scale=1.0,
        chunk_size=CHUNK_SIZE,  # the stock Mamba v1 scan is sequential: no grid to reproduce, any chunk is exact
        context=None if context is None else discretize(context),
        initial_states=states,
    )
    y = linear_call(batch, "selective_scan", values, CHUNK_SIZE, run)[..., 0]  # [N, I] in x's dtype
    if D is not None:
        y = y + x * D
    if z is not None:
        y = y * F.silu(z)
    return y


def _mamba_scan_forward(batch: TreeBatch, a: Arguments) -> torch.Tensor:
    """transformers 5.25's ``mamba_scan_forward(module, hidden_states, time_step, B, C, gate, cache)``
    (Mamba v1): without a cache it is ``mamba_selective_scan`` over the mixer's A, D and dt bias."""
    _stateless(a, CACHE)
    m = a["module"]
    y = _selective_scan(
        batch,
        _single_row(a["hidden_states"], "hidden_states").t(),  # [N, I]
        _single_row(a["time_step"], "time_step").t(),  # [N, I] raw dt
        -torch.exp(m.A_log.float()),
        _single_row(a["B"], "B"),  # [N, S]
        _single_row(a["C"], "C"),  # [N, S]
        m.D.float(),
        _single_row(a["gate"], "gate").t(),  # [N, I]
        m.dt_proj.bias.float() if m.dt_proj.bias is not None else None,
    )
    return y.t().unsqueeze(0)  # [1, I, N]


def _time_step(layer: torch.nn.Module, time_step: torch.Tensor, normed: bool) -> torch.Tensor:
    """[N, R] -> [N, I] raw dt as the mixer computes it; the normed mixers call a quantized dt_proj as a module."""
    if normed and _compat.is_quantized(layer.config):
        return layer.dt_proj(time_step) - layer.dt_proj.bias
    return (layer.dt_proj.weight @ time_step.t()).t()


def _mamba_v1_mixer(normed: bool) -> Callable[[TreeBatch, Arguments], torch.Tensor]:
    """A Mamba v1 mixer's ``forward`` (its selective scan gets no kwargs): the same projections, the
    conv and the scan on the tree, the same D skip, gate and output projection. ``normed``: B, C and
    dt pass the mixer's RMS norms first (Jamba, FalconMamba; plain Mamba has none)."""

    def call(batch: TreeBatch, a: Arguments) -> torch.Tensor:
        _stateless(a, CACHE)
        return _mamba_v1_mixer_tree(a["self"], batch, _single_row(a["hidden_states"], "hidden_states"), normed)

    return call


@_compat.accelerate_hooks(["conv1d", "dt_proj"])  # the stock forward's: their weights are read directly
def _mamba_v1_mixer_tree(layer: torch.nn.Module, batch: TreeBatch, hidden: torch.Tensor, normed: bool) -> torch.Tensor:
    """:func:`_mamba_v1_mixer` on hidden [N, E] -> [1, N, E]."""
    x, gate = layer.in_proj(hidden).chunk(2, dim=-1)  # [N, I] each
    x = _tree_conv(batch, x, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, layer.activation)
    time_step, B, C = torch.split(
        layer.x_proj(x), [layer.time_step_rank, layer.ssm_state_size, layer.ssm_state_size], dim=-1
    )  # [N, R], [N, S], [N, S]
    if normed:
        time_step, B, C = layer.dt_layernorm(time_step), layer.b_layernorm(B), layer.c_layernorm(C)
    bias = layer.dt_proj.bias.float() if layer.dt_proj.bias is not None else None
    y = _selective_scan(
        batch,
        x,
        _time_step(layer, time_step, normed),
        -torch.exp(layer.A_log.float()),
        B,
        C,
        layer.D.float(),
        gate,
        bias,
    )
    return layer.out_proj(y.to(hidden.dtype)).unsqueeze(0)  # [1, N, E]


def _jamba_mamba_layer(batch: TreeBatch, a: Arguments) -> torch.Tensor:
    """Jamba's ``JambaMambaDecoderLayer.forward``, which drops its kwargs: the same layer, handing
    the tree to its mixer."""
    layer = a["self"]
    residual = a["hidden_states"]  # [1, N, E]
    _stateless(a, CACHE)
    hidden_states = layer.mamba(
        hidden_states=layer.input_layernorm(residual), attention_mask=a["attention_mask"], **{TREE_KWARG: batch}
    )
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = layer.feed_forward(layer.pre_ff_layernorm(hidden_states))
    return residual + hidden_states


def _mamba_block(batch: TreeBatch, a: Arguments) -> torch.Tensor:
    """Mamba's ``MambaBlock.forward``, which drops its kwargs: the same norm and (fp32) residual,
    handing the tree to its mixer."""
    block = a["self"]
    residual = a["hidden_states"]  # [1, N, E]
    hidden_states = block.norm(residual.to(dtype=block.norm.weight.dtype))
    if block.residual_in_fp32:
        residual = residual.to(torch.float32)
    _stateless(a, CACHE)
    hidden_states = block.mixer(hidden_states, attention_mask=a["attention_mask"], **{TREE_KWARG: batch})
    return residual + hidden_states


def _mamba_model(batch: TreeBatch, a: Arguments) -> BaseModelOutput:
    """Mamba's ``MambaModel.forward``, which drops its kwargs: the same embeddings, blocks and final
    norm, handing the tree to every block."""
    _stateless(a, CACHE, "use_cache")
    model = a["self"]
    hidden_states = model.embeddings(a["input_ids"]) if a["inputs_embeds"] is None else a["inputs_embeds"]
    for block in model.layers:
        hidden_states = block(hidden_states, attention_mask=None, **{TREE_KWARG: batch})
    return BaseModelOutput(last_hidden_state=model.norm_f(hidden_states))


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

_MAMBA_V1_MIXER_PARAMS = ("self", "hidden_states", CACHE, "attention_mask", "kwargs")
_MAMBA_V1_MIXER_MARKERS = (
    '@force_accelerate_hooks(["conv1d", "dt_proj"])',
    "self.in_proj(hidden_states).transpose(1, 2)",
    "A = -torch.exp(self.A_log.float())",
    "hidden_states_B_C, gate = projected_states.chunk(2, dim=1)",
    "self.conv1d.weight.squeeze(1)",
    "activation=self.activation",
    "self.x_proj(hidden_states_B_C)",
    "[self.time_step_rank, self.ssm_state_size, self.ssm_state_size]",
    "time_step = self.dt_proj.weight @ time_step.transpose(1, 2)",
    "self.dt_proj.bias.float() if self.dt_proj.bias is not None else None",
    "D=self.D.float()",
    "z=gate",
    "delta_bias=time_proj_bias",
    "delta_softplus=True",
    "self.out_proj(scan_output.transpose(1, 2).to(dtype))",
)
_MAMBA_V1_SCAN = {  # the selective scan the tree mixers re-state (``_selective_scan``)
    "mamba_selective_scan": (
        "dt = dt + delta_bias.to(dt.dtype)[..., None]",
        "dt = F.softplus(dt)",
        "torch.exp(A[None, :, None, :] * dt[:, :, :, None])",
        "dt[:, :, :, None] * B[:, None, :, :].float()",
        "discrete_B * hidden_states[:, :, :, None].float()",
        "scan_output + hidden_states * D[None, :, None]",
        "scan_output * F.silu(z)",
    ),
}

_CONV_FORWARD_MARKERS = (
    "weight = conv1d.weight.squeeze(1)",
    "causal_conv1d_fn(hidden_states, weight, conv1d.bias, activation=activation",
)
_MAMBA_SCAN_FORWARD_MARKERS = (
    "A = -torch.exp(module.A_log.float())",
    "module.dt_proj.bias.float() if module.dt_proj.bias is not None else None",
    "D=module.D.float()",
    "z=chunked_gate",
    "delta_bias=time_proj_bias",
    "delta_softplus=True",
)
# transformers 5.25's MambaMixer: its training path may take mamba_ssm's fused ``mamba_inner_fn``,
# which gets no kwargs (a tree would bypass the seams), so the mixer is re-stated over the seams
_FUSED_MAMBA_MIXER_MARKERS = (
    '@force_accelerate_hooks(["conv1d", "dt_proj"])',
    "self.in_proj(hidden_states).transpose(1, 2)",
    "hidden_states_B_C, gate = projected_states.chunk(2, dim=1)",
    "causal_conv1d_forward(",
    "activation=self.activation",
    "self.x_proj(hidden_states_B_C)",
    "[self.time_step_rank, self.ssm_state_size, self.ssm_state_size]",
    "time_step = self.dt_proj.weight @ time_step.transpose(1, 2)",
    "mamba_scan_forward(",
    "self, hidden_states_B_C.transpose(1, 2), time_step, B, C, gate, cache",
    "self.out_proj(scan_output.transpose(1, 2).to(dtype))",
)

KINDS: dict[str, KernelKind] = {
    kind.name: kind
    for kind in (
        KernelKind("conv", ("hidden_states", "weight", "bias", "activation"), _conv, calls=_conv_calls),
        KernelKind(
            "conv_forward",
            ("conv1d", "hidden_states", CACHE, "layer_idx", "activation"),
            _conv_forward,
            source_markers=_CONV_FORWARD_MARKERS,
            calls=_conv_calls,
        ),
        KernelKind(
            "gated_delta",
            _DELTA_PARAMS + ("use_qk_l2norm_in_kernel",),
            _delta_rule("gated_delta", tree_gated_delta_rule),
            calls=_delta_calls("gated_delta", "head_k_dim", "head_v_dim"),
        ),
        KernelKind(
            "kda",
            _DELTA_PARAMS + ("use_qk_l2norm_in_kernel",),
            _delta_rule("kda", tree_kda),
            calls=_delta_calls("kda", "head_dim", "head_dim"),
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
            calls=_mamba2_calls,
        ),
        KernelKind(
            "mamba2_scan_forward",
            ("module", "hidden_states", "B", "C", "dt", CACHE),
            _mamba2_scan_forward,
            source_markers=(
                "A = -torch.exp(module.A_log.float())",
                "module.num_heads, module.head_dim",
                "module.n_groups, module.ssm_state_size",
                "chunk_size=module.chunk_size",
                "D=module.D,",
                "z=None",
                "dt_bias=module.dt_bias",
                "dt_softplus=True",
                "dt_limit=module.time_step_limit",
            ),
            calls=_mamba2_calls,
        ),
        KernelKind("mamba2_fused", ("zxbcdt",), _no_fused_path),
        KernelKind(
            "mamba_scan_forward",
            ("module", "hidden_states", "time_step", "B", "C", "gate", CACHE),
            _mamba_scan_forward,
            source_markers=_MAMBA_SCAN_FORWARD_MARKERS,
            restates=_MAMBA_V1_SCAN,
            calls=_selective_scan_calls,
        ),
        KernelKind(
            "fused_mamba_mixer",
            _MAMBA_V1_MIXER_PARAMS,
            _mamba_v1_mixer(normed=False),
            source_markers=_FUSED_MAMBA_MIXER_MARKERS,
            restates={
                "causal_conv1d_forward": _CONV_FORWARD_MARKERS,
                "mamba_scan_forward": _MAMBA_SCAN_FORWARD_MARKERS,
                **_MAMBA_V1_SCAN,
            },
            calls=_mamba_v1_calls,
        ),
        KernelKind(
            "lightning_mixer",
            ("self", "hidden_states", "attention_mask", CACHE, "kwargs"),
            _lightning_mixer,
            source_markers=(
                "self.act_fn(self.qkv_proj(hidden_states))",
                "self.slope_rate",
                "self.norm(attn_output)",
                "F.sigmoid(self.output_gate(hidden_states)) * attn_output",
                "self.out_proj(attn_output)",
            ),
            calls=_lightning_calls,
        ),
        KernelKind(
            "mamba_mixer",
            _MAMBA_V1_MIXER_PARAMS,
            _mamba_v1_mixer(normed=False),
            source_markers=_MAMBA_V1_MIXER_MARKERS,
            restates=_MAMBA_V1_SCAN,
            calls=_mamba_v1_calls,
        ),
        KernelKind(
            "normed_mamba_mixer",
            _MAMBA_V1_MIXER_PARAMS,
            _mamba_v1_mixer(normed=True),
            source_markers=_MAMBA_V1_MIXER_MARKERS
            + (
                "time_step = self.dt_layernorm(time_step)",
                "B = self.b_layernorm(B)",
                "C = self.c_layernorm(C)",
                'if hasattr(self.config, "_is_quantized"):',
                "time_step = (self.dt_proj(time_step) - self.dt_proj.bias).transpose(1, 2)",
            ),
            restates=_MAMBA_V1_SCAN,
            calls=_mamba_v1_calls,
        ),
        KernelKind(
            "jamba_mamba_layer",
            ("self", "hidden_states", "attention_mask", CACHE, "kwargs"),
            _jamba_mamba_layer,
            source_markers=(
                "hidden_states = self.input_layernorm(hidden_states)",
                "hidden_states = self.mamba(",
                "attention_mask=attention_mask",
                "hidden_states = residual + hidden_states",
                "hidden_states = self.pre_ff_layernorm(hidden_states)",
                "hidden_states = self.feed_forward(hidden_states)",
            ),
        ),
        KernelKind(
            "mamba_block",
            ("self", "hidden_states", CACHE, "attention_mask", "kwargs"),
            _mamba_block,
            source_markers=(
                "hidden_states = self.norm(hidden_states.to(dtype=self.norm.weight.dtype))",
                "if self.residual_in_fp32:",
                "residual = residual.to(torch.float32)",
                "hidden_states = self.mixer(hidden_states, cache",  # cache_params=cache_params (5.23), cache=cache
                "attention_mask=attention_mask)",
                "hidden_states = residual + hidden_states",
            ),
        ),
        KernelKind(
            "mamba_model",
            ("self", "input_ids", "inputs_embeds", CACHE, "use_cache", "attention_mask", "kwargs"),
            _mamba_model,
            source_markers=(
                "inputs_embeds = self.embeddings(input_ids)",
                "hidden_states = inputs_embeds",
                "for mixer_block in self.layers:",
                "hidden_states = self.norm_f(hidden_states)",
            ),
        ),
    )
}
