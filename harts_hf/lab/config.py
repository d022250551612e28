"""Benchmark configuration: the default run and the ``--quick`` one, as validated dataclasses."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from ..sources import WORKLOADS
from .models import BENCH_FAMILIES, SIZES

__all__ = ["DEFAULT_SCALE", "DTYPES", "QUICK_SCALE", "SWE_LIKE", "BenchConfig", "default_config"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# The swe-like workload with one task of 8 GRPO samples: at scale 0.005 232 trajectories, ~26K
# trajectory tokens, compression 5.62. The quick run keeps 4 samples at scale 0.002 (87
# trajectories, ~4.6K tokens, compression 5.49).
SWE_LIKE = {"num_tasks": 1}
QUICK_SWE_LIKE = {"num_tasks": 1, "group_size": 4}
DEFAULT_SCALE = 0.005
QUICK_SCALE = 0.002


def check_model_options(model: str, size: str, dtype: str, device: str) -> None:
    """Refuse a bench model, size, dtype or device this machine cannot build (one clear line)."""
    if model not in BENCH_FAMILIES:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(sorted(BENCH_FAMILIES))}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(sorted(SIZES))}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch sees no CUDA device")


@dataclass
class BenchConfig:
    model: str = field(default="qwen3_5", metadata={"help": "model family (harts_hf.lab.BENCH_FAMILIES)"})
    size: str = field(default="default", metadata={"help": "model size (harts_hf.lab.SIZES)"})
    workload: str = field(default="swe-like", metadata={"help": "workload name (harts_hf.sources.WORKLOADS)"})
    scale: float | None = field(default=None, metadata={"help": "length scale of the workload (swe-like)"})
    workload_kwargs: dict = field(default_factory=dict, metadata={"help": "further keyword arguments of the workload"})
    dtype: str = field(default="fp32", metadata={"help": "model and compute dtype: fp32 or bf16"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    warmup: int = field(default=1, metadata={"help": "untimed repetitions of every mode first"})
    reps: int = field(default=3, metadata={"help": "timed repetitions of every mode (medians are reported)"})
    stock_tokens: int = field(
        default=4096, metadata={"help": "padded tokens per stock microbatch (rows = a power of two that fits)"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the model weights, the workload and the row shuffle"})

    def __post_init__(self) -> None:
        check_model_options(self.model, self.size, self.dtype, self.device)
        if self.reps < 3 or self.warmup < 0:
            raise ValueError(f"need reps >= 3 (a median of at least 3) and warmup >= 0, got {self.reps}, {self.warmup}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose one of {', '.join(sorted(WORKLOADS))}")
        if self.scale is not None and self.scale <= 0:
            raise ValueError(f"scale must be positive, got {self.scale}")
        taken = inspect.signature(WORKLOADS[self.workload]).parameters
        unknown = sorted(set(self.workload_arguments()) - set(taken))
        if unknown:
            raise ValueError(f"workload {self.workload!r} takes no {', '.join(unknown)}; it takes {', '.join(taken)}")
        if self.stock_tokens < 1:
            raise ValueError(f"stock_tokens must be positive, got {self.stock_tokens}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def workload_arguments(self) -> dict:
        """Keyword arguments of ``get_workload`` (the seed and, where set, the scale included)."""
        kwargs = dict(self.workload_kwargs)
        kwargs["seed"] = self.seed
        kwargs["vocab"] = SIZES[self.size].vocab
        if self.scale is not None:
            kwargs["scale"] = self.scale
        return kwargs


def default_config(quick: bool = False, **overrides) -> BenchConfig:
    """The default benchmark (under 5 minutes on 2 CPU cores) or the quick one (under 45 s);
    ``overrides`` replace fields (None values are ignored)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    preset: dict = {"size": "quick"} if quick else {}
    if overrides.get("workload", "swe-like") == "swe-like":
        preset.update(
            scale=QUICK_SCALE if quick else DEFAULT_SCALE, workload_kwargs=dict(QUICK_SWE_LIKE if quick else SWE_LIKE)
        )
    return BenchConfig(**{**preset, **overrides})
