"""Segment kernels through fla's public chunk ops: the exact fallback layout (``cut=True``).

Every needed state is a segment's initial or final state, where fla's ops take ``initial_state``
and return ``final_state`` with gradients both ways (``dh0``, ``dht``), so no kernel change is
needed; the price is one extra sequential wave per cut on a chain (``waves.py``). fla is
imported on first use, so importing harts_hf never imports triton.

Signature: see ``driver.py`` (``chunks`` must be False here: fla's ops do not return per-chunk
states). fla takes a constant decay ``g_gamma`` too, but neutral tail padding needs g = 0, so
simple GLA always gets a per-token g.
"""

from __future__ import annotations

import torch

from .waves import Wave

__all__ = ["SEGMENT_OPS", "gated_delta_segments", "gla_segments", "kda_segments", "simple_gla_segments"]

T = torch.Tensor


def _varlen(wave: Wave) -> dict:
    return {"cu_seqlens": wave.cu_seqlens, "cu_seqlens_cpu": wave.cu_seqlens_cpu}


def _no_chunks(chunks: bool) -> None:
    if chunks:
        raise ValueError("fla's public chunk ops return no per-chunk states: use the cut layout")


def gated_delta_segments(
    q: T, k: T, v: T, g: T, beta: T, h0: T, wave: Wave, *, scale: float, chunks: bool, l2: bool = False
) -> tuple[T, None, T]:
    """GDN segments through ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    _no_chunks(chunks)
    o, ht = chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2,
        **_varlen(wave),
    )
    return o, None, ht


def kda_segments(
    q: T, k: T, v: T, g: T, beta: T, h0: T, wave: Wave, *, scale: float, chunks: bool, l2: bool = False
) -> tuple[T, None, T]:
    """KDA segments through ``fla.ops.kda.chunk_kda`` (fp32 initial state, as fla wants)."""
    from fla.ops.kda import chunk_kda

    _no_chunks(chunks)
    o, ht = chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2,
        **_varlen(wave),
    )
    return o, None, ht


def gla_segments(
    q: T, k: T, v: T, g: T, beta: None, h0: T, wave: Wave, *, scale: float, chunks: bool, l2: bool = False
) -> tuple[T, None, T]:
    """GLA segments through ``fla.ops.gla.chunk_gla``."""
    from fla.ops.gla import chunk_gla

    _no_chunks(chunks)
    o, ht = chunk_gla(q, k, v, g, scale=scale, initial_state=h0, output_final_state=True, **_varlen(wave))
    return o, None, ht


def simple_gla_segments(
    q: T, k: T, v: T, g: T, beta: None, h0: T, wave: Wave, *, scale: float, chunks: bool, l2: bool = False
) -> tuple[T, None, T]:
    """Simple GLA segments through ``fla.ops.simple_gla.chunk_simple_gla``."""
    from fla.ops.simple_gla import chunk_simple_gla

    _no_chunks(chunks)
    o, ht = chunk_simple_gla(q, k, v, g, scale=scale, initial_state=h0, output_final_state=True, **_varlen(wave))
    return o, None, ht


# kind -> segment kernel; tests swap entries for fla's naive references (no GPU).
SEGMENT_OPS = {
    "gated_delta": gated_delta_segments,
    "kda": kda_segments,
    "gla": gla_segments,
    "simple_gla": simple_gla_segments,
}
