"""Engine: runs a rank's planned microbatch slots on a patched model (``TreeEngine``)."""

from .engine import TreeEngine

__all__ = ["TreeEngine"]
