"""TRL trainers on rollout forests, drop-ins for TRL's pairs: ``HARTSGRPOTrainer`` / ``HARTSGRPOConfig``
and ``HARTSSFTTrainer`` / ``HARTSSFTConfig``."""

from .config import HARTSGRPOConfig, HARTSSFTConfig
from .grpo import HARTSGRPOTrainer
from .sft import HARTSSFTTrainer

__all__ = ["HARTSGRPOConfig", "HARTSGRPOTrainer", "HARTSSFTConfig", "HARTSSFTTrainer"]
