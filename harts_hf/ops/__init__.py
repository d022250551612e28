"""Tree-aware layer kernels: one file per layer kind, torch reference backend + registry."""

from .tree_batch import TreeBatch

__all__ = ["TreeBatch"]
