"""The harts-hf command line: the workload command, its JSON output, errors, ``python -m``."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from harts_hf.cli import main

FIELDS = {
    "workload",
    "seed",
    "scale",
    "trajectories",
    "trajectory_tokens",
    "compact_tokens",
    "compression",
    "height",
    "leaves",
    "nodes",
    "depth_p50",
    "depth_p90",
    "depth_p99",
    "depth_max",
    "generate_seconds",
    "build_seconds",
}


def test_workload_prints_an_aligned_table(capsys):
    assert main(["workload", "swe-like", "--scale", "0.02"]) == 0
    lines = capsys.readouterr().out.splitlines()
    labels = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines)
    assert {"trajectories", "compact tokens", "compression", "height", "depth p99"} <= set(labels)
    assert len({len(line) - len(value) for line, value in zip(lines, labels.values())}) == 1  # one column
    assert 4.5 <= float(labels["compression"]) <= 7.0


def test_workload_json_fields(tmp_path, capsys):
    path = tmp_path / "stats.json"
    assert main(["workload", "swe-like", "--scale", "0.02", "--seed", "1", "--json", str(path)]) == 0
    stats = json.loads(path.read_text())
    assert set(stats) == FIELDS
    assert stats["workload"] == "swe-like" and stats["seed"] == 1 and stats["scale"] == 0.02
    assert stats["compression"] == pytest.approx(stats["trajectory_tokens"] / stats["compact_tokens"])
    assert stats["depth_p50"] <= stats["depth_p90"] <= stats["depth_p99"] <= stats["depth_max"]
    assert stats["leaves"] <= stats["nodes"] and stats["height"] >= 2
    assert f"{stats['trajectories']:,}" in capsys.readouterr().out


def test_unknown_workload_lists_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["workload", "swe"])
    assert exit_info.value.code == 2
    assert "caterpillar" in capsys.readouterr().err


def test_scale_refused_by_a_shape_without_it():
    with pytest.raises(SystemExit, match="'grpo-group' takes no scale"):
        main(["workload", "grpo-group", "--scale", "0.5"])


def test_bench_size_reaches_the_config():
    with pytest.raises(SystemExit, match="unknown size 'huge'; choose one of default, gpu, quick, tiny"):
        main(["bench", "--size", "huge"])


def test_python_dash_m():
    done = subprocess.run(
        [sys.executable, "-m", "harts_hf", "workload", "deep-chain", "--seed", "2"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "deep-chain" in done.stdout and "height" in done.stdout


def test_calibrate_writes_a_cost_model_plan_reads(tmp_path):
    from harts_hf.planner import CostModel

    path = tmp_path / "cost.json"
    assert main(["calibrate", "--size", "tiny", "--repeats", "1", "--json", str(path)]) == 0
    fitted = CostModel(**json.loads(path.read_text()))
    assert fitted.token > 0 or fitted.pair > 0
    out = tmp_path / "plan.json"
    args = ["plan", "--workload", "grpo-group", "--world-size", "2", "--cost-model", str(path), "--json", str(out)]
    assert main(args) == 0
    assert json.loads(out.read_text())["world_size"] == 2


def test_readme_test_command_is_what_ci_runs():
    from pathlib import Path

    root = Path(__file__).parents[1]
    ci = [line for line in (root / ".ci/run").read_text().splitlines() if line.startswith("pip install")]
    readme = (root / "README.md").read_text()
    assert len(ci) == 1 and ci[0] in readme
    assert "&& harts-hf train\n" in readme  # command 1: the main job


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["workload", "grpo-group", "--json", "{missing}/x.json"], "cannot write --json"),
        (["plan", "--workload", "grpo-group", "--world-size", "2", "--plot", "{missing}/x.png"], "cannot write --plot"),
        (["plan", "--workload", "grpo-group", "--world-size", "2", "--cost-model", "{missing}/c.json"], "No such file"),
        (["workload", "swe-like", "--scale", "nan"], "positive and finite"),
    ],
)
def test_bad_paths_and_values_are_one_line_errors(argv, message, tmp_path):
    """Output folders are checked before the work runs; files and values give one line, no traceback."""
    with pytest.raises(SystemExit, match=message):
        main([a.format(missing=tmp_path / "missing") for a in argv])


def test_counts_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--repeats", "0"])
    assert exit_info.value.code == 2 and "must be a positive integer" in capsys.readouterr().err
