"""Peak memory of one region of code, per device, comparable between benchmark modes.

CUDA: the caching allocator's peak above what was allocated on entry. CPU: the process's peak
resident set size above the resident set on entry; Linux lets a process reset that peak
(``/proc/self/clear_refs``), and returning glibc's free heap first (``malloc_trim``) keeps one
mode's freed memory from hiding the next mode's growth. Elsewhere CPU peaks are not measured.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import torch

__all__ = ["PeakMemory"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _cpu_supported() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
        _status_kib("VmHWM")
    except OSError:
        return False
    return True


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak_bytes`` (None where unmeasurable)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.peak_bytes: int | None = None
        self._cpu = self.device.type == "cpu" and _cpu_supported()
        self._base = 0

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        elif self._cpu:
            _trim()
            _CLEAR_REFS.write_text("5")
            self._base = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        elif self._cpu:
            self.peak_bytes = _status_kib("VmHWM") * 1024 - self._base
