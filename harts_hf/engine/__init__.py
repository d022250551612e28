"""Engine: runs a rank's planned microbatch slots on a patched model (``TreeEngine``)."""

from .engine import Recording, TreeEngine
from .memory import memory_model

__all__ = ["Recording", "TreeEngine", "memory_model"]
