"""Segment kernels through fla's public chunk ops: the exact fallback layout (``cut=True``).

Every needed state is a segment's initial or final state, where fla's ops take ``initial_state``
and return ``final_state`` with gradients both ways (``dh0``, ``dht``), so no kernel change is
needed; the price is one extra sequential wave per cut on a chain (``waves.py``). fla is
imported on first use, so importing harts_hf never imports triton.

Signature: see ``driver.py`` (``chunks`` must be False here: fla's ops do not return per-chunk
states). fla takes a constant decay ``g_gamma`` too, but neutral tail padding needs g = 0, so
simple GLA always gets a per-token g (``backend.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _compat as fla
from .waves import Wave

__all__ = ["SEGMENT_OPS", "FlaChunkOp"]

T = torch.Tensor


@dataclass(frozen=True)
class FlaChunkOp:
    """One of fla's public chunk ops as a segment kernel (``driver.py`` signature).

    Args:
        op: the op (``_compat.chunk_gla``).
        delta_rule: the op takes ``beta`` and fla's in-kernel q/k l2norm (GDN, KDA).
    """

    op: fla.FlaName
    delta_rule: bool

    def __call__(
        self, q: T, k: T, v: T, g: T, beta: T | None, h0: T, wave: Wave, *, scale: float, chunks: bool, l2: bool = False
    ) -> tuple[T, None, T]:
        if chunks:
            raise ValueError("fla's public chunk ops return no per-chunk states: use the cut layout")
        delta = {"beta": beta, "use_qk_l2norm_in_kernel": l2} if self.delta_rule else {}
        o, ht = self.op(
            q=q,
            k=k,
            v=v,
            g=g,
            scale=scale,
            initial_state=h0,  # fp32, as chunk_kda wants
            output_final_state=True,
            cu_seqlens=wave.cu_seqlens,
            cu_seqlens_cpu=wave.cu_seqlens_cpu,
            **delta,
        )
        return o, None, ht


# kind -> segment kernel; tests swap entries for fla's naive references (no GPU).
SEGMENT_OPS = {
    "gated_delta": FlaChunkOp(fla.chunk_gated_delta_rule, delta_rule=True),
    "kda": FlaChunkOp(fla.chunk_kda, delta_rule=True),
    "gla": FlaChunkOp(fla.chunk_gla, delta_rule=False),
    "simple_gla": FlaChunkOp(fla.chunk_simple_gla, delta_rule=False),
}
