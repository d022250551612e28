"""harts-hf memory: a sweep at tiny lengths (256, 512 tokens at a budget of 128) run in process through
the CLI; its record, table and PNG, the modes left out beyond their caps, and the refusals. No timing
or measured peak is asserted: both depend on the machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harts_hf.app.cli import main
from harts_hf.lab import MemorySweepConfig, memory_table
from harts_hf.lab.memory_sweep import COLUMNS

PNG = b"\x89PNG\r\n\x1a\n"
ARGS = ["--lengths", "512", "256", "--budget", "128", "--one-unit-max-tokens", "512", "--stock-max-tokens", "256"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[dict, Path]:
    """The record (read back from ``--json``) and the ``--plot`` PNG of the tiny sweep."""
    out = tmp_path_factory.mktemp("memory")
    assert main(["memory", *ARGS, "--json", str(out / "memory.json"), "--plot", str(out / "memory.png")]) == 0
    return json.loads((out / "memory.json").read_text()), out / "memory.png"


def test_every_length_is_planned_in_more_slots_as_it_grows(sweep):
    record, _ = sweep
    entries = record["lengths"]
    assert [e["length"] for e in entries] == [256, 512]  # sorted
    assert [e["compact_tokens"] for e in entries] == [384, 768]  # the prompt once, two completions
    slots = [e["slots"] for e in entries]
    assert 1 < slots[0] < slots[1]
    assert all(e["harts"]["slots"] == e["slots"] for e in entries)
    assert set(record["memory_model"]) == {"token", "context", "head", "head_chunk", "fixed", "layer"}


def test_predicted_peaks_stay_within_the_budget(sweep):
    record, _ = sweep
    budget_mb = record["budget"]["bytes"] / (1 << 20)
    first = record["lengths"][0]
    for e in record["lengths"]:
        assert 0 < e["harts"]["predicted_mb"] <= budget_mb * (1 + 1e-9)
    assert first["one_unit"]["slots"] == 1 and first["one_unit"]["predicted_mb"] > budget_mb  # 384 > 128 tokens


def test_modes_beyond_their_caps_are_left_out(sweep):
    record, _ = sweep
    short, long = record["lengths"]
    assert short["one_unit"] is not None and short["stock"] is not None  # 2 * 256 <= 512, 256 <= 256
    assert long["one_unit"] is None and long["stock"] is None
    rows = memory_table(record).splitlines()
    row = next(line for line in rows if line.split()[:1] == ["512"])
    assert row.split()[-4:] == ["-"] * 4


def test_every_mode_trains_the_same_loss(sweep):
    short = sweep[0]["lengths"][0]
    assert short["one_unit"]["loss"] == pytest.approx(short["harts"]["loss"], rel=1e-4)
    assert short["stock"]["loss"] == pytest.approx(short["harts"]["loss"], rel=1e-4)


def test_table_ends_in_its_legend_and_the_png_is_written(sweep):
    record, png = sweep
    legend = [" ".join(line.split()) for line in memory_table(record).splitlines()]
    for name, meaning in COLUMNS.items():
        assert f"{name} {' '.join(meaning.split())}" in legend
    assert png.read_bytes()[:8] == PNG


def test_a_budget_below_the_longest_context_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["memory", "--lengths", "16384", "--budget", "64"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("harts-hf memory: error: length 16,384: max_tokens_per_microbatch=64 is below")
    assert "raise the budget" in line and "holds trajectories of up to" in line


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        pytest.param(["--budget", "0"], "--budget: must be a positive integer, got 0", id="zero-budget"),
        pytest.param(["--lengths", "1"], "lengths must be whole numbers >= 2", id="one-token"),
        pytest.param(["--repeats", "-1"], "--repeats: must be a positive integer, got -1", id="negative-repeats"),
    ],
)
def test_bad_numbers_are_refused_before_any_work(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["memory", *argv])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("harts-hf memory: error: ") and says in line


def test_config_refuses_what_the_cli_cannot_catch():
    with pytest.raises(ValueError, match="positive whole numbers"):
        MemorySweepConfig(budget=0)
    with pytest.raises(ValueError, match="unknown size"):
        MemorySweepConfig(size="huge")
