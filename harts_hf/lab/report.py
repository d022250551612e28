"""The benchmark's outputs: the JSON record (the issue's fields first, extras after) and the table."""

from __future__ import annotations

import dataclasses
import os

import torch

from .flops import compact_work, ideal_speedup, trajectory_work
from .plan_report import legend
from .run import MODES, PHASES, BenchRun

__all__ = ["MODE_MEANINGS", "bench_record", "table"]

_MB = 1 << 20

MODE_MEANINGS = {
    "stock": "the unpatched transformers model on TRL-style padded rows: what a user runs instead",
    "unshared": "our kernels, one root per trajectory: no prefix sharing",
    "harts": "our kernels on the prefix forest: every shared prefix computed once, in microbatches of stock's tokens",
}
"""What each mode is, for the table's legend and the plot's caption."""

COLUMNS = {
    "forward s": "median seconds of the batch's forward pass (lower is better)",
    "backward s": "median seconds of its backward pass (lower is better)",
    "step s": "forward + backward (lower is better)",
    "peak MB": "peak memory of a step above what was held before it (lower is better)",
}
NUMBERS = {
    "speedup": "unshared (or stock) seconds / harts seconds (higher is better)",
    "ideal": "the speedup the FLOP count allows: unshared FLOPs / forest FLOPs",
    "efficiency": "measured step speedup vs stock / ideal (1 = every FLOP saved is time saved)",
    "numerics": "harts' log-probs vs stock's: within stock's self-diff (its rows vs one at a time) is exact",
    "grad cosine": "cosine of harts' and stock's gradients (1 = the same)",
}


def _machine() -> dict[str, object]:
    """Where the run happened: timings are only comparable on an otherwise idle machine."""
    return {
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_avg_1min": os.getloadavg()[0],
        "torch": torch.__version__,
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def bench_record(run: BenchRun) -> dict:
    """The JSON record of ``run``: workload, model, ideal and measured speedups, efficiency, peak
    memory, numerics; then the raw times, FLOP terms, configuration and machine."""
    forest, flops = run.forest, run.flops
    med = {m: {p: run.median(m, p) for p in PHASES} for m in MODES}
    cpu = {m: {p: run.median(m, p, "cpu") for p in PHASES} for m in MODES}
    ideal = ideal_speedup(flops, forest)
    speedup = {p: med["unshared"][p] / med["harts"][p] for p in PHASES}
    work = {"unshared": trajectory_work(forest), "harts": compact_work(forest)}
    step_flops = {"stock": flops.step(work["unshared"]), **{m: flops.step(w) for m, w in work.items()}}
    model = run.bench_model.model
    return {
        "workload": {
            "name": run.config.workload,
            "trajectories": forest.num_trajectories,
            "trajectory_tokens": forest.num_trajectory_tokens,
            "compact_tokens": forest.num_compact_tokens,
            "compression": forest.compression,
            "height": forest.height,
            "rounds": run.rounds,
            "max_length": forest.max_length,
            "arguments": run.config.workload_arguments(),
        },
        "model": {
            "family": run.bench_model.family,
            "layers": model.config.num_hidden_layers,
            "hidden": model.config.hidden_size,
            "params": sum(p.numel() for p in model.parameters()),
            "vocab": model.config.vocab_size,
            "arch": dataclasses.asdict(run.bench_model.arch),
        },
        "ideal_speedup": ideal,
        "speedup": speedup,
        "speedup_vs_stock": {p: med["stock"][p] / med["harts"][p] for p in PHASES},
        "efficiency": med["stock"]["step"] / med["harts"]["step"] / ideal,  # against what a user runs instead
        "peak_memory_mb": {m: None if run.peak_bytes[m] is None else run.peak_bytes[m] / _MB for m in MODES},
        "numerics": run.numerics,
        "times_s": med,
        "samples_s": {m: [[r.forward_s, r.backward_s] for r in run.samples[m]] for m in MODES},
        "cpu_times_s": cpu,
        "speedup_cpu": {p: cpu["unshared"][p] / cpu["harts"][p] for p in PHASES},
        "speedup_vs_stock_cpu": {p: cpu["stock"][p] / cpu["harts"][p] for p in PHASES},
        "flops": {
            "per_token": flops.token,
            "per_pair": flops.pair,
            "per_linear_token": flops.linear,
            "forward_shares_unshared": flops.shares(work["unshared"]),
            "step": step_flops,
            "achieved_gflops_per_s": {m: step_flops[m] / med[m]["step"] / 1e9 for m in MODES},
            "work": {m: dataclasses.asdict(w) for m, w in work.items()},
        },
        "stock_microbatch_rows": run.stock_rows,
        "harts_microbatches": run.harts_microbatches,
        "config": dataclasses.asdict(run.config),
        "seconds": run.seconds,
        "machine": _machine(),
    }


def table(record: dict) -> str:
    """A short text summary: times per mode and phase, speedups, memory and numerics."""
    w, t, mem, num = record["workload"], record["times_s"], record["peak_memory_mb"], record["numerics"]
    m, c, load = record["model"], record["config"], record["machine"]
    head = (
        f"{m['family']} ({m['params'] / 1e6:.1f}M params, {c['dtype']}, {c['device']}) on {w['name']}: "
        f"{w['trajectories']} trajectories, {w['trajectory_tokens']:,} -> {w['compact_tokens']:,} tokens "
        f"(compression {w['compression']:.2f}x, height {w['height']}, {w['rounds']} rounds)"
    )
    shape = (
        f"stock: microbatches of {record['stock_microbatch_rows']} rows padded to {w['max_length']} tokens; "
        f"harts: {record['harts_microbatches']} microbatch(es) of at most as many tokens "
        f"({record['stock_microbatch_rows'] * w['max_length']:,})"
    )
    lines = [head, shape, "", f"{'mode':<10}{'forward s':>11}{'backward s':>12}{'step s':>10}{'peak MB':>10}"]
    for mode in MODES:
        peak = "n/a" if mem[mode] is None else f"{mem[mode]:.0f}"
        lines.append(
            f"{mode:<10}{t[mode]['forward']:>11.3f}{t[mode]['backward']:>12.3f}{t[mode]['step']:>10.3f}{peak:>10}"
        )
    s, v = record["speedup"], record["speedup_vs_stock"]
    cpu = (
        f"process CPU time: step {record['speedup_cpu']['step']:.2f}x vs unshared, "
        f"{record['speedup_vs_stock_cpu']['step']:.2f}x vs stock (1-min load {load['load_avg_1min']:.1f} "
        f"on {load['cpus']} CPUs)"
    )
    numerics = (
        f"numerics: max |lp harts - stock| {num['max_abs_logprob_diff']:.2e}  stock self-diff "
        f"{num['stock_self_diff']:.2e}  grad cosine {num['grad_cosine']:.7f}"
    )
    lines += [
        "",
        f"speedup vs unshared: forward {s['forward']:.2f}x  backward {s['backward']:.2f}x  step {s['step']:.2f}x",
        f"speedup vs stock:    forward {v['forward']:.2f}x  backward {v['backward']:.2f}x  step {v['step']:.2f}x",
        f"ideal (FLOPs) {record['ideal_speedup']:.2f}x  efficiency {record['efficiency']:.2f}",
        cpu,
        numerics,
        "",
        legend(COLUMNS | MODE_MEANINGS | NUMBERS),
    ]
    return "\n".join(lines)
