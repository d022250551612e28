"""The benchmark's PNG: median seconds per phase for each mode, the ideal harts time marked."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .run import MODES, PHASES

__all__ = ["plot_bench"]

_COLORS = {"stock": "#9e9e9e", "unshared": "#4c72b0", "harts": "#dd8452"}


def plot_bench(record: dict, path: str | Path) -> None:
    """Bars per phase per mode; a black line on each harts bar marks unshared / ideal speedup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times, ideal = record["times_s"], record["ideal_speedup"]
    x = np.arange(len(PHASES))
    width = 0.8 / len(MODES)
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for i, mode in enumerate(MODES):
        heights = [times[mode][p] for p in PHASES]
        bars = ax.bar(x + (i - 1) * width, heights, width, label=mode, color=_COLORS[mode])
        if mode == "harts":
            for j, (bar, phase) in enumerate(zip(bars, PHASES)):
                ax.hlines(
                    times["unshared"][phase] / ideal, bar.get_x(), bar.get_x() + width, colors="black",
                    linewidth=2, label=f"ideal ({ideal:.2f}x vs unshared)" if j == 0 else None,
                )
                ax.annotate(
                    f"{record['speedup'][phase]:.2f}x", (bar.get_x() + width / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8,
                )
    w, m = record["workload"], record["model"]
    ax.set_title(
        f"{m['family']} ({m['params'] / 1e6:.1f}M, {record['config']['dtype']}, {record['config']['device']}) on "
        f"{w['name']}: compression {w['compression']:.2f}x, efficiency {record['efficiency']:.2f}",
        fontsize=9,
    )
    ax.set_xticks(x, PHASES)
    ax.set_ylabel("median seconds per training step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
