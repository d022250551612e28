"""Hugging Face models on rollout trees: patching, per-trajectory log-probs, verification."""

from .adapters import ADAPTERS, FamilyAdapter, supported_families
from .errors import UnsupportedModelError
from .logprobs import TreeOutput, tree_forward, tree_logprobs
from .patch import from_pretrained, patch_model, unpatch_model
from .registry import is_patched
from .verify import VerifyReport, verify

__all__ = [
    "ADAPTERS",
    "FamilyAdapter",
    "TreeOutput",
    "UnsupportedModelError",
    "VerifyReport",
    "from_pretrained",
    "is_patched",
    "patch_model",
    "supported_families",
    "tree_forward",
    "tree_logprobs",
    "unpatch_model",
    "verify",
]
