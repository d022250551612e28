"""Every table and plot explains itself: the CLI tables end in their legends, the calibration output
says why a coefficient is 0, and the PNGs are written with a legend (plan) or a caption and the
ideal in the legend (bench). Records are real but cheap: small forests, fixed bench timings."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
import torch

from harts_hf.lab import (
    BenchConfig,
    BenchRun,
    FlopModel,
    bench_record,
    build_model,
    plan_record,
    plot_bench,
    plot_plan,
    record_table,
    table,
)
from harts_hf.lab.calibrate import FEATURE_MEANINGS, format_cost_model
from harts_hf.lab.modes import StepResult
from harts_hf.lab.ops import COLUMNS as OPS_COLUMNS
from harts_hf.lab.ops import bench_ops, format_table
from harts_hf.lab.plan_plot import PANELS
from harts_hf.lab.plan_report import COLUMNS as PLAN_COLUMNS
from harts_hf.lab.plan_report import GAP, PLANNERS
from harts_hf.lab.report import COLUMNS as BENCH_COLUMNS
from harts_hf.lab.report import MODE_MEANINGS, NUMBERS
from harts_hf.planner import CostModel, plan
from harts_hf.sources import grpo_group, random_tree

PNG = b"\x89PNG\r\n\x1a\n"


def assert_legend_below(text: str, meanings: dict[str, str], table_head: str) -> None:
    """Every ``name  meaning`` of ``meanings`` is a line of ``text`` (padded to any width), after the
    table's head row."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith(table_head))
    below = [" ".join(line.split()) for line in lines[head + 1 :]]
    for name, meaning in meanings.items():
        assert f"{name} {' '.join(meaning.split())}" in below, f"legend line missing: {name}"


@pytest.fixture
def figures(monkeypatch) -> list:
    """The figures the plot functions draw, kept open (``plt.close`` captured) for inspection."""
    kept: list = []
    close = plt.close
    monkeypatch.setattr(plt, "close", kept.append)
    yield kept
    for fig in kept:
        close(fig)


# ---------------------------------------------------------------- harts-hf plan
@pytest.fixture(scope="module")
def small_plan():
    """Three GRPO groups and a two-root random tree on two ranks, with every baseline's record."""
    forests = [grpo_group(prompt_len=20 + 5 * s, G=4, seed=s).forest() for s in range(3)]
    forests.append(random_tree(30, roots=2, seed=0).forest())
    budget = max(f.max_length for f in forests) + 64
    ours = plan(forests, world_size=2, max_tokens_per_microbatch=budget)
    return forests, ours, plan_record(forests, ours, exact_seconds=2)


def test_plan_table_ends_in_its_legend(small_plan):
    _, ours, record = small_plan
    text = record_table(record)
    (by_slot,) = [line for line in text.splitlines() if line.startswith("step by slot")]
    slowest = [float(pair.split("/")[0]) for pair in by_slot.split(": ")[1].split()]
    assert len(slowest) == ours.num_slots and sum(slowest) <= ours.step_seconds + 1e-9  # replays add to the sum
    gap = GAP if record["baselines"]["exact"].get("gap") is not None else {}
    assert_legend_below(text, PLAN_COLUMNS | PLANNERS | gap, "planner")
    assert set(PLANNERS) == {"harts", *record["baselines"]}  # every row of the table is explained


def test_plan_png_has_a_legend_and_the_baselines(small_plan, figures, tmp_path):
    forests, ours, record = small_plan
    path = tmp_path / "plan.png"
    plot_plan(ours, forests, path, record=record, workload="three groups")
    assert path.read_bytes()[:8] == PNG
    (fig,) = figures
    trajectories = sum(f.num_trajectories for f in forests)
    title = f"three groups: {trajectories} trajectories, {ours.num_compact_tokens:,} compact tokens, budget "
    assert fig.axes[0].get_title().startswith(f"{title}{ours.budget.tokens:,} tokens per microbatch\n")
    assert "seconds from the built-in H100 estimate" in fig.axes[0].get_title()
    (box,) = fig.legends
    labels = [t.get_text() for t in box.get_texts()]
    assert box.get_title().get_text() == "colour = tree"
    assert [x for x in labels if x.startswith("tree ")] == [f"tree {t}" for t in range(5)]  # 3 groups + 2 roots
    assert any("shared chain" in x for x in labels) and any("replica" in x for x in labels)
    panels = [ax for ax in fig.axes if ax.get_title() in PANELS]
    assert len(panels) == len(PANELS) == 4
    for ax in panels:
        assert [t.get_text() for t in ax.get_yticklabels()] == list(PLANNERS)


def test_plan_png_says_when_colours_cycle(figures, tmp_path):
    forests = [grpo_group(prompt_len=10, G=2, seed=s).forest() for s in range(12)]
    ours = plan(forests, world_size=2, max_tokens_per_microbatch=max(f.max_length for f in forests) + 16)
    plot_plan(ours, forests, tmp_path / "plan.png")
    (fig,) = figures
    assert fig.legends[0].get_title().get_text() == "colour = tree, cycled over 12 trees"


def test_a_lone_tree_is_coloured_by_its_branches(figures, tmp_path):
    forest = grpo_group(prompt_len=40, G=3, seed=0).forest()
    plot_plan(plan(forest, world_size=2, max_tokens_per_microbatch=forest.max_length + 8), forest, tmp_path / "p.png")
    (fig,) = figures
    box = fig.legends[0]
    assert "branch" in box.get_title().get_text()
    assert [t.get_text() for t in box.get_texts()][:3] == ["tree 0", "tree 1", "tree 2"]


# ---------------------------------------------------------------- harts-hf bench-ops and calibrate
def test_ops_table_ends_in_its_legend():
    sequences = [list(range(40)) + [1000 * (i + 1) + t for t in range(n)] for i, n in enumerate([9, 12])]
    report = bench_ops(sequences, ("attention", "simple_gla"), repeats=1, progress=False)
    assert_legend_below(format_table(report), OPS_COLUMNS, "kind")


def test_calibration_explains_a_zero_coefficient():
    title = "cost model of tiny in 1.0 s:"
    text = format_cost_model(CostModel(token=2e-5, pair=0.0, round=1e-3, microbatch=0.0), title)
    assert text.startswith(title)
    for name, meaning in FEATURE_MEANINGS.items():
        assert name in text and meaning in text
    assert "0 (pair, microbatch): dropped by the non-negative least-squares fit" in text
    assert "dropped" not in format_cost_model(CostModel(token=2e-5, pair=1e-9, round=1e-3, microbatch=5e-3), title)


# ---------------------------------------------------------------- harts-hf bench
@pytest.fixture(scope="module")
def bench_record_of_a_tiny_run() -> dict:
    """A real record of a tiny model on a small GRPO group, with fixed timings instead of a run (the
    timings are not what is tested) and CPU peak memory unmeasured for one mode."""
    config = BenchConfig(size="tiny", workload="grpo-group", workload_kwargs={"prompt_len": 8, "G": 3})
    bench = build_model(config.model, config.size)
    forest = grpo_group(prompt_len=8, G=3, seed=0, vocab=128).forest()
    step = {"stock": (0.3, 0.5), "unshared": (0.2, 0.4), "harts": (0.1, 0.2)}
    samples = {m: [StepResult(f, b, f, b, torch.zeros(0))] * 3 for m, (f, b) in step.items()}
    run = BenchRun(
        config=config,
        bench_model=bench,
        forest=forest,
        rounds=2,
        flops=FlopModel.of(bench.model, bench.arch),
        stock_rows=4,
        harts_microbatches=1,
        samples=samples,
        peak_bytes={"stock": 30 << 20, "unshared": 12 << 20, "harts": None},
        numerics={"max_abs_logprob_diff": 1e-7, "stock_self_diff": 2e-7, "grad_cosine": 1.0},
        seconds={"forest_build": 0.0, "total": 1.0},
    )
    return bench_record(run)


def test_bench_table_ends_in_its_legend(bench_record_of_a_tiny_run):
    assert_legend_below(table(bench_record_of_a_tiny_run), BENCH_COLUMNS | MODE_MEANINGS | NUMBERS, "mode")


def test_bench_png_has_a_caption_memory_and_the_ideal(bench_record_of_a_tiny_run, figures, tmp_path):
    path = tmp_path / "bench.png"
    plot_bench(bench_record_of_a_tiny_run, path)
    assert path.read_bytes()[:8] == PNG
    (fig,) = figures
    times, memory = fig.axes
    ideal = bench_record_of_a_tiny_run["ideal_speedup"]
    ideal = f"stock / ideal: efficiency 1 (ideal = unshared / forest FLOPs = {ideal:.2f}x)"
    assert ideal in [t.get_text() for t in times.get_legend().get_texts()]  # the console's definitions
    for label, bar in zip(times.texts, times.containers[-1]):  # each speedup label clears bar and ideal line
        assert label.xy[1] >= bar.get_height()
    assert [t.get_text() for t in memory.get_xticklabels()] == list(MODE_MEANINGS)
    assert "n/a" in [t.get_text() for t in memory.texts]  # harts' peak was not measured
    caption = "\n".join(t.get_text() for t in fig.texts)
    for mode, meaning in MODE_MEANINGS.items():
        assert f"{mode}: {meaning}" in caption
