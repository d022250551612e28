"""harts-hf: train Hugging Face hybrid-attention language models on rollout trees.

Every shared prefix of a batch of agentic rollouts is computed once (forward and backward);
per-trajectory log-probs come back in the layout TRL's objectives expect, with the same
gradients as trajectory-wise training.
"""

from .engine import TreeEngine
from .forest import RolloutForest
from .modeling import (
    TreeOutput,
    UnsupportedModelError,
    VerifyReport,
    from_pretrained,
    is_patched,
    patch_model,
    supported_families,
    tree_forward,
    tree_logprobs,
    unpatch_model,
    verify,
)
from .planner import CostModel, Plan, plan

__version__ = "0.1.0"

__all__ = [
    "CostModel",
    "Plan",
    "RolloutForest",
    "TreeEngine",
    "TreeOutput",
    "UnsupportedModelError",
    "VerifyReport",
    "__version__",
    "from_pretrained",
    "is_patched",
    "patch_model",
    "plan",
    "supported_families",
    "tree_forward",
    "tree_logprobs",
    "unpatch_model",
    "verify",
]
