"""TRL trainers on rollout forests, drop-ins for TRL's pairs: ``HARTSGRPOTrainer`` / ``HARTSGRPOConfig``,
``HARTSRLOOTrainer`` / ``HARTSRLOOConfig``, ``HARTSSFTTrainer`` / ``HARTSSFTConfig`` and ``HARTSDPOTrainer`` /
``HARTSDPOConfig``."""

from .config import HARTSDPOConfig, HARTSGRPOConfig, HARTSRLOOConfig, HARTSSFTConfig
from .dpo import HARTSDPOTrainer
from .grpo import HARTSGRPOTrainer
from .rloo import HARTSRLOOTrainer
from .sft import HARTSSFTTrainer

__all__ = [
    "HARTSDPOConfig",
    "HARTSDPOTrainer",
    "HARTSGRPOConfig",
    "HARTSGRPOTrainer",
    "HARTSRLOOConfig",
    "HARTSRLOOTrainer",
    "HARTSSFTConfig",
    "HARTSSFTTrainer",
]
