"""TRL trainers on rollout forests, drop-ins for TRL's pairs: ``HARTSGRPOTrainer`` / ``HARTSGRPOConfig``,
``HARTSRLOOTrainer`` / ``HARTSRLOOConfig``, ``HARTSSFTTrainer`` / ``HARTSSFTConfig`` and ``HARTSDPOTrainer`` /
``HARTSDPOConfig``; ``end_distributed`` ends a multi-process script cleanly (gloo's threads joined)."""

from .config import HARTSDPOConfig, HARTSGRPOConfig, HARTSRLOOConfig, HARTSSFTConfig
from .dpo import HARTSDPOTrainer
from .grpo import HARTSGRPOTrainer
from .rloo import HARTSRLOOTrainer
from .sft import HARTSSFTTrainer
from .teardown import end_distributed

__all__ = [
    "HARTSDPOConfig",
    "HARTSDPOTrainer",
    "HARTSGRPOConfig",
    "HARTSGRPOTrainer",
    "HARTSRLOOConfig",
    "HARTSRLOOTrainer",
    "HARTSSFTConfig",
    "HARTSSFTTrainer",
    "end_distributed",
]
