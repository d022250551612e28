"""The harts-hf command line: the workload command, its JSON output, ``python -m`` (bad inputs:
test_cli_inputs.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from harts_hf.app.cli import main

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


def test_plan_takes_workload_arguments_and_a_models_memory_model(tmp_path, capsys):
    """``--set`` reaches the workload's generator; ``--model`` prices the context at the model's K/V, so
    trajectories longer than the budget plan (under the default, a context token costs an own token)."""
    args = ["plan", "--workload", "swe-like", "--scale", "0.01", "--set", "num_tasks=2", "--world-size", "2"]
    args += ["--max-tokens", "300"]
    with pytest.raises(SystemExit):
        main(args)
    assert "below the longest trajectory's need" in capsys.readouterr().err
    out = tmp_path / "plan.json"
    assert main([*args, "--model", "qwen3_5", "--size", "tiny", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["world_size"] == 2 and record["pieces"] > 2 and record["baselines"]


def test_plan_takes_a_memory_model_file_and_host_memory(tmp_path, capsys):
    """``--memory-model`` prices the plan with a JSON memory model (as ``--model``'s, not both);
    ``--host-memory`` keeps the graphs the budget cannot hold in host memory instead of rerunning
    them: the report says how many and how much a rank holds, and the step is lower."""
    from harts_hf.planner import MemoryModel

    path = tmp_path / "memory.json"
    path.write_text(json.dumps(MemoryModel(token=1.0, context=0.1).as_dict()))
    args = ["plan", "--workload", "grpo-group", "--world-size", "2", "--max-tokens", "40"]
    args += ["--memory-model", str(path)]
    steps = []
    for extra in ([], ["--host-memory", "1"]):
        out = tmp_path / f"plan{len(extra)}.json"
        assert main([*args, *extra, "--json", str(out)]) == 0
        record = json.loads(out.read_text())
        steps.append(record["step_seconds"])
        host, rerun = record["graphs"]["host"], record["graphs"]["rerun"]
        assert (host > 0 and rerun == 0) if extra else (host == 0 and rerun > 0)
    printed = capsys.readouterr().out
    assert "graphs in host memory:" in printed and steps[1] < steps[0]
    with pytest.raises(SystemExit):
        main([*args, "--model", "qwen3_5"])
    assert "give --model or --memory-model, not both" in capsys.readouterr().err


def test_calibrate_memory_writes_a_memory_model_the_trainer_reads(tmp_path, capsys):
    from harts_hf.planner import MemoryModel
    from harts_hf.trainers import HARTSGRPOConfig

    path = tmp_path / "memory.json"
    assert main(["calibrate", "--memory", "--size", "tiny", "--tokens", "128", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "measured" in out and "full_attention" in out and "K/V B/row" in out  # the breakdown by layer kind
    fitted = MemoryModel(**json.loads(path.read_text()))
    assert fitted.token > 0 and fitted.context >= 0 and fitted.head > 0
    args = HARTSGRPOConfig(str(tmp_path / "out"), use_cpu=True, harts_memory_model=str(path.read_text()))
    assert MemoryModel(**args.harts_memory_model) == fitted


def test_readme_test_command_is_what_ci_runs():
    from pathlib import Path

    root = Path(__file__).parents[1]
    ci = [line for line in (root / ".ci/run").read_text().splitlines() if line.startswith("pip install")]
    readme = (root / "README.md").read_text()
    assert len(ci) == 2 and all(line in readme for line in ci)  # the suite; the modeling suites on 5.25
    assert "&& harts-hf train\n" in readme  # command 1: the main job
