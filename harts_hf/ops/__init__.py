"""Tree-aware layer kernels: one file per layer kind, torch reference backend + registry.

Every op takes the piece's own tokens in DFS order plus a :class:`TreeBatch` and equals running
the layer on every root-to-leaf trajectory separately.
"""

from . import fla  # noqa: F401  registers the fla backend; imports neither fla nor triton
from .attention import tree_attention
from .conv import tree_causal_conv1d
from .gated_delta import tree_gated_delta_rule
from .gla import tree_gla, tree_lightning, tree_mamba2_ssd, tree_simple_gla
from .kda import tree_kda
from .rounds import rounds_of
from .tree_batch import TreeBatch

__all__ = [
    "TreeBatch",
    "rounds_of",
    "tree_attention",
    "tree_causal_conv1d",
    "tree_gated_delta_rule",
    "tree_gla",
    "tree_kda",
    "tree_lightning",
    "tree_mamba2_ssd",
    "tree_simple_gla",
]
