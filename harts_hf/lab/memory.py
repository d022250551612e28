"""Peak memory of one region of code, per device, comparable between benchmark modes.

The peak of torch's allocator above what it held on entry: the live tensor bytes, what the memory
model prices. CUDA reports it (``max_memory_allocated``); on CPU the profiler's memory events
carry the allocator's running total (``profile_memory``), which slows the region by about a third:
time a CPU region in a run of its own (``PeakMemory.slows``). The process's resident set is not a
measure of this: glibc keeps freed tensors' pages mapped (measured +25-70% over the allocator's
peak on the memory sweep's longest pieces).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator

import torch
from torch._C._profiler import _EventType

__all__ = ["PeakMemory"]


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto prints a line to the C stderr when a profiler starts and stops: hide those two."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _allocator_peak(profile: torch.profiler.profile) -> int:
    """The highest running total of the allocations the profile recorded (0 at its start)."""
    peak, stack = 0, list(profile.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            peak = max(peak, event.extra_fields.total_allocated)
        stack.extend(event.children)
    return peak


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak_bytes``."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.peak_bytes: int | None = None
        self.slows = self.device.type == "cpu"  # the region runs slower than it would untracked
        self._base = 0
        self._profile: torch.profiler.profile | None = None

    def tracks(self, timed: bool) -> bool:
        """Whether a run that is (not) ``timed`` is tracked: every timed run, unless tracking slows
        the run; then the untimed ones (warm-ups, a run of its own)."""
        return timed != self.slows

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            activities = [torch.profiler.ProfilerActivity.CPU]
            self._profile = torch.profiler.profile(activities=activities, profile_memory=True)
            with _quiet_stderr():
                self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        with _quiet_stderr():
            self._profile.__exit__(*exc)
        self.peak_bytes = _allocator_peak(self._profile)
        self._profile = None
