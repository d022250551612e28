"""The fla (GPU) backend of the tree ops: fla's chunk kernels per packed varlen wave, fla's
causal conv over the tree's chains, plus our own Triton kernel for the delta-rule state-gradient
recurrence. Importing this package registers the backend; fla and triton themselves are imported
only when a kernel first runs."""

from . import backend, conv
from .backend import WAVES_LAYOUT, fla_available

__all__ = ["WAVES_LAYOUT", "backend", "conv", "fla_available"]
