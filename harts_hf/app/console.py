"""What a recipe run prints besides its own lines (``progress.StepLine``).

:func:`quiet_console` takes transformers' console loggers off a trainer (the raw metrics dict after
every step, a second progress bar) unless asked for: the metrics still reach ``report_to``.
:func:`quiet_third_party`: other libraries' messages that do not concern the person running the
recipe are filtered where they are raised, one filter per message; every other warning still shows.

- transformers' "`<kernel>` is falling back to its reference PyTorch implementation ... install
  `flash-linear-attention`": advice for GPUs (fla and causal-conv1d need one), printed on a CPU
  machine too, where it is wrong; on a GPU it stays (it concerns generation, which runs the stock
  kernels).
- transformers' FutureWarnings on the `gradient_checkpointing` names: TRL 1.16's configs and trainer
  use them, the user cannot change that.
- TRL's "You are using 'rollout_func', which is an experimental feature": the recipe's own choice.

:func:`no_progress_bars` keeps the bars of ``datasets`` (TRL tokenizing the built-in data) and of
transformers (loading a reference copy) off while a recipe builds its trainer: small, fast, and
they push the run's own lines apart.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from datasets.utils import logging as datasets_logging
from transformers import PrinterCallback, ProgressCallback, Trainer
from transformers.utils import logging as transformers_logging

__all__ = ["no_progress_bars", "quiet_console", "quiet_third_party"]

KERNEL_FALLBACK = "is falling back to its reference PyTorch implementation"
CHECKPOINTING_RENAME = r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated"
ROLLOUT_FUNC = "You are using 'rollout_func', which is an experimental feature"


class _DropOnCpu(logging.Filter):
    """Drops the kernel-fallback advice when no GPU is present (it asks for GPU-only packages)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return torch.cuda.is_available() or KERNEL_FALLBACK not in record.getMessage()


def quiet_third_party() -> None:
    """Install the filters of the module docstring (idempotent)."""
    hub_kernels = logging.getLogger("transformers.integrations.hub_kernels")
    if not any(isinstance(f, _DropOnCpu) for f in hub_kernels.filters):
        hub_kernels.addFilter(_DropOnCpu())
    warnings.filterwarnings("ignore", message=CHECKPOINTING_RENAME, category=FutureWarning)
    warnings.filterwarnings("ignore", message=ROLLOUT_FUNC, category=UserWarning)


def quiet_console(trainer: Trainer, verbose: bool) -> Trainer:
    """``trainer`` without transformers' console callbacks (``PrinterCallback`` prints TRL's full metrics
    dict every logged step, ``ProgressCallback`` draws a second bar), unless ``verbose``."""
    if not verbose:
        for callback in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(callback)
    return trainer


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """``datasets``' and transformers' progress bars off inside the block, as they were after it."""
    libraries = [lib for lib in (datasets_logging, transformers_logging) if lib.is_progress_bar_enabled()]
    for lib in libraries:
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib in libraries:
            lib.enable_progress_bar()
