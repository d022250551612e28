"""The lab: what measures the library rather than being it (``harts-hf bench``, ``memory``,
``calibrate``, ``plan``'s baselines, reports and plots) and the model families as the project builds
them (``models.py``: one declaration per family, read by the bench, the tests and the stand-ins).

``harts-hf bench``: stock vs trajectory-wise vs forest training of one model on one workload.

Times forward, backward and the whole step of each mode (interleaved repetitions, medians),
measures peak memory and the numerics (log-probs and gradients against the stock model), and
compares the measured speedup with the ideal one from an analytic FLOP count.

``harts-hf memory`` (``memory_sweep.py``): peak memory and step time against trajectory length at
one microbatch budget, the memory model's predicted peak beside the measured one.

``harts-hf plan`` (``plan_report.py``, ``plan_plot.py``): the planner beside its baselines
(``baselines.py``).
"""

from .baselines import BASELINES, run_baselines
from .config import BenchConfig, default_config
from .flops import FlopModel, Work, compact_work, ideal_speedup, trajectory_work
from .memory_sweep import MemorySweepConfig, memory_sweep, memory_table, plot_memory_sweep
from .models import BENCH_FAMILIES, FAMILIES, SIZES, Arch, BenchModel, Family, ModelSize, build_model
from .plan_plot import plot_plan
from .plan_report import plan_record, record_table
from .plot import plot_bench
from .report import bench_record, table
from .run import MODES, PHASES, BenchRun, run_bench

__all__ = [
    "BASELINES",
    "BENCH_FAMILIES",
    "FAMILIES",
    "MODES",
    "PHASES",
    "SIZES",
    "Arch",
    "BenchConfig",
    "BenchModel",
    "BenchRun",
    "Family",
    "FlopModel",
    "MemorySweepConfig",
    "ModelSize",
    "Work",
    "bench_record",
    "build_model",
    "compact_work",
    "default_config",
    "ideal_speedup",
    "memory_sweep",
    "memory_table",
    "plan_record",
    "plot_bench",
    "plot_memory_sweep",
    "plot_plan",
    "record_table",
    "run_baselines",
    "run_bench",
    "table",
    "trajectory_work",
]
