"""Engine: runs a rank's planned microbatch slots on a patched model (``TreeEngine``)."""

from .engine import Recording, TreeEngine

__all__ = ["Recording", "TreeEngine"]
