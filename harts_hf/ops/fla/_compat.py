"""Every fla name the fla backend reads, in one place: fla's lower-level chunk functions, one raw
Triton kernel, constants and its public ops (checked against fla 0.6.0).

Most of these are fla internals with no stable API, so the backend takes them only from the fla
release it was checked against: with another one installed, :func:`fla_checked` is False (warned
once) and the linear-attention tree ops run on the exact torch backend. Each name is imported on
first use (importing harts_hf never imports triton); ``tests/fla_interpreter_cases.py`` resolves
every entry of :data:`NAMES`, so a name that moves fails a test, not a user's run.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["CHECKED_FLA", "NAMES", "FlaName", "fla_checked"]

logger = logging.getLogger(__name__)

CHECKED_FLA = "0.6.0"


@functools.cache
def fla_checked() -> bool:
    """The installed fla (``fla-core``) is the release the backend was checked against."""
    try:
        found = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return False
    if found != CHECKED_FLA:
        logger.warning(
            "harts-hf: fla %s found, the fla backend is checked against fla %s: linear-attention tree ops run on "
            "the torch backend (pip install flash-linear-attention==%s for fla's kernels)",
            found,
            CHECKED_FLA,
            CHECKED_FLA,
        )
    return found == CHECKED_FLA


@dataclass(frozen=True)
class FlaName:
    """``module.attr`` of fla, imported on first use; calling it calls the function."""

    module: str
    attr: str

    def get(self) -> Any:
        if not fla_checked():
            raise ImportError(f"harts-hf's fla backend needs fla {CHECKED_FLA} ({self.module}.{self.attr})")
        return getattr(importlib.import_module(self.module), self.attr)

    def __call__(self, *args, **kwargs) -> Any:
        return self.get()(*args, **kwargs)


NAMES: dict[str, FlaName] = {}
"""Every entry below, by its attribute name here."""


def _name(attr: str, module: str, alias: str | None = None) -> FlaName:
    NAMES[alias or attr] = entry = FlaName(module, attr)
    return entry


# shared: the launch guard, constants, chunk bookkeeping, the q/k l2norm
input_guard = _name("input_guard", "fla.utils")
IS_NVIDIA_HOPPER = _name("IS_NVIDIA_HOPPER", "fla.utils")
TRITON_ABOVE_3_4_0 = _name("TRITON_ABOVE_3_4_0", "fla.utils")
TRITON_ABOVE_3_7_1 = _name("TRITON_ABOVE_3_7_1", "fla.utils")
RCP_LN2 = _name("RCP_LN2", "fla.ops.utils.constant")
prepare_chunk_indices = _name("prepare_chunk_indices", "fla.ops.utils")
prepare_chunk_offsets = _name("prepare_chunk_offsets", "fla.ops.utils")
chunk_local_cumsum = _name("chunk_local_cumsum", "fla.ops.utils")
l2norm_fwd = _name("l2norm_fwd", "fla.modules.norm.l2norm")
l2norm_bwd = _name("l2norm_bwd", "fla.modules.norm.l2norm")
causal_conv1d = _name("causal_conv1d", "fla.modules.causal_conv1d")

# chunk states and outputs (common to the kinds)
chunk_fwd_h = _name("chunk_fwd_h", "fla.ops.common.chunk_h")
chunk_bwd_dh = _name("chunk_bwd_dh", "fla.ops.common.chunk_h")
delta_fwd_h_kernel = _name(
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "fla.ops.common.chunk_delta_h", alias="delta_fwd_h_kernel"
)
chunk_fwd_o = _name("chunk_fwd_o", "fla.ops.common.chunk_o")
chunk_bwd_dv = _name("chunk_bwd_dv", "fla.ops.common.chunk_o")
chunk_bwd_dv_local = _name("chunk_bwd_dv_local", "fla.ops.common.chunk_o")
chunk_bwd_dqkwg = _name("chunk_bwd_dqkwg", "fla.ops.common.chunk_o")

# gated delta rule
chunk_gated_delta_rule_fwd_intra = _name("chunk_gated_delta_rule_fwd_intra", "fla.ops.gated_delta_rule.chunk_fwd")
recompute_w_u_fwd = _name("recompute_w_u_fwd", "fla.ops.gated_delta_rule.wy_fast")
prepare_wy_repr_bwd = _name("prepare_wy_repr_bwd", "fla.ops.gated_delta_rule.wy_fast")

# KDA
chunk_kda_fwd_intra = _name("chunk_kda_fwd_intra", "fla.ops.kda.chunk_intra")
chunk_kda_bwd_intra = _name("chunk_kda_bwd_intra", "fla.ops.kda.chunk_intra")
kda_recompute_w_u_fwd = _name("recompute_w_u_fwd", "fla.ops.kda.wy_fast", alias="kda_recompute_w_u_fwd")
chunk_kda_bwd_dAv = _name("chunk_kda_bwd_dAv", "fla.ops.kda.chunk_bwd")
chunk_kda_bwd_wy_dqkg_fused = _name("chunk_kda_bwd_wy_dqkg_fused", "fla.ops.kda.chunk_bwd")

# GLA (per-channel decay; KDA's output too)
chunk_gla_fwd_intra_gk = _name("chunk_gla_fwd_intra_gk", "fla.ops.gla.chunk")
chunk_gla_fwd_o_gk = _name("chunk_gla_fwd_o_gk", "fla.ops.gla.chunk")
chunk_gla_bwd_dv = _name("chunk_gla_bwd_dv", "fla.ops.gla.chunk")
chunk_gla_bwd_dA = _name("chunk_gla_bwd_dA", "fla.ops.gla.chunk")
chunk_gla_bwd_dqk_intra = _name("chunk_gla_bwd_dqk_intra", "fla.ops.gla.chunk")
chunk_gla_bwd_dqkg = _name("chunk_gla_bwd_dqkg", "fla.ops.gla.chunk")

# public chunk ops (the exact cut layout)
chunk_gated_delta_rule = _name("chunk_gated_delta_rule", "fla.ops.gated_delta_rule")
chunk_kda = _name("chunk_kda", "fla.ops.kda")
chunk_gla = _name("chunk_gla", "fla.ops.gla")
chunk_simple_gla = _name("chunk_simple_gla", "fla.ops.simple_gla")
