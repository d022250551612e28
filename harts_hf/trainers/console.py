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
"""

from __future__ import annotations

import logging
import warnings

import torch
from transformers import PrinterCallback, ProgressCallback, Trainer

__all__ = ["quiet_console", "quiet_third_party"]

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
