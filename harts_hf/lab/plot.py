"""The benchmark's PNG: median seconds per phase for each mode, the ideal harts time marked, peak
memory per mode beside it, and a caption saying what the modes are."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .report import MODE_MEANINGS
from .run import MODES, PHASES

__all__ = ["plot_bench"]

_COLORS = {"stock": "#9e9e9e", "unshared": "#4c72b0", "harts": "#dd8452"}


def _times(ax, record: dict) -> None:
    """Bars per phase per mode; a black line on each harts bar marks stock's time / ideal (where the
    efficiency the console prints would be 1), the label above the taller of bar and line the speedup vs stock."""
    times, ideal = record["times_s"], record["ideal_speedup"]
    x = np.arange(len(PHASES))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        heights = [times[mode][p] for p in PHASES]
        bars = ax.bar(x + (i - 1) * width, heights, width, label=mode, color=_COLORS[mode])
        if mode != "harts":
            continue
        for j, (bar, phase) in enumerate(zip(bars, PHASES)):
            line = times["stock"][phase] / ideal
            ax.hlines(
                line,
                bar.get_x(),
                bar.get_x() + width,
                colors="black",
                linewidth=2,
                label=f"stock / ideal: efficiency 1 (ideal = unshared / forest FLOPs = {ideal:.2f}x)"
                if j == 0
                else None,
            )
            ax.annotate(
                f"{record['speedup_vs_stock'][phase]:.2f}x",
                (bar.get_x() + width / 2, max(bar.get_height(), line)),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(x, PHASES)
    ax.set_ylabel("median seconds per training step (lower is better)")
    ax.margins(y=0.12)
    ax.legend(fontsize=8, title="label on harts: speedup vs stock", title_fontsize=8)


def _memory(ax, record: dict) -> None:
    """Peak memory per mode (n/a where the device's peak is not measurable)."""
    peak = record["peak_memory_mb"]
    x = np.arange(len(MODES))
    ax.bar(x, [peak[m] or 0 for m in MODES], 0.6, color=[_COLORS[m] for m in MODES])
    for i, m in enumerate(MODES):
        ax.annotate(
            "n/a" if peak[m] is None else f"{peak[m]:.0f}", (i, peak[m] or 0), ha="center", va="bottom", fontsize=8
        )
    ax.set_xticks(x, MODES, fontsize=8)
    ax.set_ylabel("peak MB per step (lower is better)")
    ax.margins(y=0.15)


def plot_bench(record: dict, path: str | Path) -> None:
    """Draw ``record`` (:func:`~harts_hf.lab.bench_record`) to ``path``: seconds per phase and mode
    with the ideal harts time, peak memory per mode, and a caption defining the modes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, mem) = plt.subplots(1, 2, figsize=(9.5, 5.2), dpi=120, width_ratios=[3, 1])
    _times(ax, record)
    _memory(mem, record)
    w, m = record["workload"], record["model"]
    fig.suptitle(
        f"{m['family']} ({m['params'] / 1e6:.1f}M, {record['config']['dtype']}, {record['config']['device']}) on "
        f"{w['name']}: compression {w['compression']:.2f}x, efficiency {record['efficiency']:.2f} "
        "(step speedup vs stock / ideal)",
        fontsize=9,
    )
    caption = "\n".join(f"{mode}: {meaning}" for mode, meaning in MODE_MEANINGS.items())
    fig.text(0.01, 0.01, caption, fontsize=8, va="bottom")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path)
    plt.close(fig)
