"""TRL trainers on rollout forests: ``HARTSGRPOTrainer`` / ``HARTSGRPOConfig``, drop-ins for TRL's pair."""

from .config import HARTSGRPOConfig
from .grpo import HARTSGRPOTrainer

__all__ = ["HARTSGRPOConfig", "HARTSGRPOTrainer"]
