"""What the fla backend does to a batch's sequential work, for bench output: the exact cut
fallback (``waves.py``) adds sequential waves on chains of mid-path branches, and a fragmented
batch runs the conv on the torch gather (``conv.py``). Both say so only when the registry
actually sends the call to the fla backend (``HARTS_BACKEND``, device, availability)."""

from __future__ import annotations

from ..chunking import CHUNK_SIZE
from ..ops.backends import Call, choose
from ..ops.fla import backend, conv
from ..ops.fla.waves import waves_of
from ..ops.rounds import rounds_of
from ..ops.tree_batch import TreeBatch

__all__ = ["fallback_note", "fla_serves", "sequential_calls"]

_FLA_OPS = {
    "conv": conv.tree_causal_conv1d_fla,
    "gated_delta": backend.tree_gated_delta_rule_fla,
    "kda": backend.tree_kda_fla,
    "gla": backend.tree_gla_fla,
    "simple_gla": backend.tree_simple_gla_fla,
}


def fla_serves(kind: str, batch: TreeBatch, chunk_size: int = CHUNK_SIZE) -> bool:
    """Whether the registry runs a ``kind`` call on ``batch`` (tensors on its device) on fla."""
    if kind not in _FLA_OPS:
        return False
    call = Call(kind, batch.device, chunk_size, key_dim=64, value_dim=64, width=4)  # a layer with 64-dim heads
    return choose(call).fn is _FLA_OPS[kind]


def sequential_calls(kind: str, batch: TreeBatch, chunk_size: int = CHUNK_SIZE) -> int:
    """Sequential kernel calls one linear-attention layer makes on ``batch``: the fla waves when
    fla serves ``kind``, else the tree's rounds (the torch backend's)."""
    if kind not in backend.WAVES_LAYOUT:
        raise ValueError(f"{kind!r} is not a linear-attention kind; choose from {sorted(backend.WAVES_LAYOUT)}")
    if fla_serves(kind, batch, chunk_size):
        return waves_of(batch, chunk_size, backend.WAVES_LAYOUT[kind] == "cut").num_waves
    return rounds_of(batch, chunk_size).num_rounds


def fallback_note(kind: str, batch: TreeBatch, chunk_size: int = CHUNK_SIZE) -> str | None:
    """One line for bench output when fla serves ``kind`` on ``batch`` through a fallback; None
    when it does not (torch backend, or fla's direct path)."""
    if not fla_serves(kind, batch, chunk_size):
        return None
    if kind == "conv":
        if not conv.uses_gather(batch):
            return None
        return (
            f"conv: fragmented batch (mean run {conv.mean_run(batch):.1f} < "
            f"{conv.GATHER_BELOW_MEAN_RUN:g} tokens) runs the torch gather, not fla's kernel"
        )
    if backend.WAVES_LAYOUT[kind] != "cut":
        return None
    waves = sequential_calls(kind, batch, chunk_size)
    rounds = rounds_of(batch, chunk_size).num_rounds
    return (
        f"{kind}: fla exact cut-path fallback (no interior-boundary state gradients), "
        f"{waves} sequential waves vs {rounds} rounds"
    )
