"""Bad inputs to ``harts-hf`` and ``recipes/grpo_agentic.py``: each is refused before any work, in one
line that names the problem and the fix, with exit code 2 and no traceback. No case builds a model."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harts_hf.app.cli import main
from harts_hf.app.recipe import check_config, resolve_config

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/configs/qwen3_5_quick_agentic"
CONFIGS = {  # name -> YAML text, written to the test's folder
    "typo.yaml": "learning_rat: 0.1\n",
    "far.yaml": "zzzqqq: 1\n",
    "list.yaml": "- learning_rate\n",
    "broken.yaml": "learning_rate: [0.1\nbeta: 0\n",
    "no_turns.yaml": "max_turns: 0\n",
    "group.yaml": "num_generations: 8\n",
}


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The test's folder with the CONFIGS written and an empty folder ``empty/``."""
    for name, text in CONFIGS.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "empty").mkdir()
    return tmp_path


def _one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _refused(run, argv: list[str], capsys) -> str:
    """The one stderr line of ``run(argv)``, which must exit with code 2."""
    with pytest.raises(SystemExit) as exit_info:
        run(argv)
    assert exit_info.value.code == 2
    return _one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        pytest.param(
            ["train", "--config", "nope.yaml"],
            "harts-hf train: error: --config nope.yaml: no such file or directory",
            id="train-missing-config",
        ),
        pytest.param(
            ["train", "--config", "configs/nope.yml"],
            "harts-hf train: error: --config configs/nope.yml: no such file or directory",
            id="train-missing-config-in-folder",
        ),
        pytest.param(["train", "--config", "{dir}/empty"], "a directory without config.yaml", id="train-empty-dir"),
        pytest.param(
            ["train", "--config", "{dir}/typo.yaml"],
            "harts-hf train: error: unknown key 'learning_rat' in {dir}/typo.yaml (did you mean 'learning_rate'?)",
            id="train-typo-key",
        ),
        pytest.param(
            ["train-compare", "--config", "{dir}/far.yaml"],
            "unknown key 'zzzqqq' in {dir}/far.yaml (not a field of HARTSGRPOConfig or AgenticArguments)",
            id="compare-unknown-key",
        ),
        pytest.param(
            ["train", "--config", "{dir}/list.yaml"], "must be a mapping of recipe keys, got list", id="train-list"
        ),
        pytest.param(["train", "--config", "{dir}/broken.yaml"], "not valid YAML", id="train-broken-yaml"),
        pytest.param(
            ["train", "--config", "{dir}/no_turns.yaml"],
            "AgenticArguments: max_turns must be a positive integer, got 0",
            id="train-zero-turns",
        ),
        pytest.param(
            ["train", "--config", "{dir}/group.yaml"],
            "num_generations must be episodes_per_task x samples per episode = 12 (4 x 3), got 8",
            id="train-group",
        ),
        pytest.param(
            ["train", "--max-steps", "0"],
            "harts-hf train: error: max_steps must be a positive number of steps (or -1: train num_train_epochs), got 0",
            id="train-zero-steps",
        ),
        pytest.param(["train-compare", "--max-steps", "-2"], "got -2", id="compare-negative-steps"),
        pytest.param(
            ["plan", "--workload", "grpo-group", "--world-size", "0"],
            "harts-hf plan: error: argument --world-size: must be a positive integer, got 0",
            id="plan-world-size",
        ),
        pytest.param(
            ["plan", "--workload", "grpo-group", "--world-size", "2", "--max-tokens", "0"],
            "argument --max-tokens: must be a positive integer, got 0",
            id="plan-max-tokens",
        ),
        pytest.param(
            ["plan", "--workload", "grpo-group"],
            "the following arguments are required: --world-size",
            id="plan-required",
        ),
        pytest.param(
            ["plan", "--workload", "swe-like", "--world-size", "2", "--set", "num_tasks"],
            "harts-hf plan: error: argument --set: expected KEY=VALUE, got 'num_tasks'",
            id="plan-set-no-value",
        ),
        pytest.param(
            ["plan", "--workload", "swe-like", "--world-size", "2", "--set", "tasks=64"],
            "harts-hf plan: error: workload 'swe-like' takes no tasks; it takes scale, seed, num_tasks",
            id="plan-set-unknown-key",
        ),
        pytest.param(
            ["plan", "--workload", "grpo-group", "--world-size", "2", "--cost-model", "{dir}/missing.json"],
            "No such file or directory",
            id="plan-cost-model",
        ),
        pytest.param(
            ["workload", "swe-like", "--seed", "-1"],
            "harts-hf workload: error: argument --seed: must be a non-negative integer, got -1",
            id="workload-seed",
        ),
        pytest.param(
            ["workload", "swe-like", "--scale", "nan"],
            "argument --scale: must be positive and finite, got nan",
            id="workload-scale-nan",
        ),
        pytest.param(
            ["workload", "swe-like", "--scale", "inf"], "must be positive and finite", id="workload-scale-inf"
        ),
        pytest.param(["workload", "swe"], "invalid choice: 'swe' (choose from 'caterpillar'", id="workload-name"),
        pytest.param(
            ["workload", "grpo-group", "--scale", "0.5"],
            "harts-hf workload: error: workload 'grpo-group' takes no scale",
            id="workload-scale-unused",
        ),
        pytest.param(
            ["bench", "--scale", "0"], "argument --scale: must be positive and finite, got 0", id="bench-scale"
        ),
        pytest.param(
            ["bench", "--size", "huge"],
            "harts-hf bench: error: unknown size 'huge'; choose one of default, gpu, quick, tiny",
            id="bench-size",
        ),
        pytest.param(["bench-ops", "--tasks", "0"], "argument --tasks: must be a positive integer", id="ops-tasks"),
        pytest.param(
            ["bench-ops", "--repeats", "-1"], "argument --repeats: must be a positive integer", id="ops-repeats"
        ),
        pytest.param(
            ["bench-ops", "--threads", "two"], "argument --threads: must be a positive integer", id="ops-threads"
        ),
        pytest.param(["bench-ops", "--scale", "-0.1"], "argument --scale: must be positive and finite", id="ops-scale"),
        pytest.param(
            ["calibrate", "--repeats", "0"], "argument --repeats: must be a positive integer, got 0", id="calibrate"
        ),
    ],
)
def test_harts_hf_refuses_in_one_line(argv, line, workdir, capsys):
    out = workdir / "out"
    sink = ["--output-dir", str(out)] if argv[0].startswith("train") else ["--json", str(out)]
    got = _refused(main, [a.format(dir=workdir) for a in argv] + sink, capsys)
    assert line.format(dir=workdir) in got
    assert not out.exists()  # refused before any work


@pytest.mark.parametrize(
    ("option", "path"),
    [("--json", "{dir}/missing/x.json"), ("--plot", "{dir}/missing/x.png"), ("--plot", "{dir}")],
    ids=["json-folder", "plot-folder", "plot-is-a-folder"],
)
def test_outputs_are_checked_before_the_work(option, path, workdir, capsys):
    path = path.format(dir=workdir)
    got = _refused(main, ["plan", "--workload", "grpo-group", "--world-size", "2", option, path], capsys)
    assert got == f"harts-hf plan: error: cannot write {option} {path}: not a file in an existing folder"


@pytest.mark.parametrize(
    "ref", ["nope.yaml", "configs/nope.yaml", "owner/name.yml", "./owner/name", "/owner/name", "a/b/c", "owner--x/y"]
)
def test_a_missing_path_is_no_hub_id(ref, monkeypatch):
    """Only the ``owner/name`` shape of a Hub repo id is looked up; any other missing path is missing."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda **kwargs: pytest.fail(f"looked up {kwargs}"))
    with pytest.raises(FileNotFoundError, match=f"^--config {re.escape(ref)}: no such file or directory$"):
        resolve_config(ref)


def test_a_hub_id_offline_is_one_line(tmp_path):
    """The Hub client's retries and its multi-line error stay off the terminal."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    done = subprocess.run(
        [sys.executable, "-m", "harts_hf", "train", "--config", "owner/name", "--output-dir", str(tmp_path / "out")],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 2
    assert _one_line(done.stderr) == (
        "harts-hf train: error: --config owner/name: no such file or directory, and config.yaml of Hub repo "
        "owner/name cannot be downloaded (LocalEntryNotFoundError); check the path, the repo id and the network"
    )
    assert not (tmp_path / "out").exists()


def test_the_shipped_recipe_passes():
    assert check_config(RECIPE) == RECIPE / "config.yaml"


@pytest.fixture(scope="module")
def launch_script():
    """``main`` of recipes/grpo_agentic.py (a script, not a module of the package)."""
    spec = importlib.util.spec_from_file_location("grpo_agentic", ROOT / "recipes/grpo_agentic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        pytest.param(["--config", "nope.yaml"], "error: --config nope.yaml: no such file or directory", id="missing"),
        pytest.param(["--config"], "error: argument --config: expected one argument", id="no-value"),
        pytest.param(
            ["--config", "{dir}/typo.yaml"],
            "error: unknown key 'learning_rat' in {dir}/typo.yaml (did you mean 'learning_rate'?)",
            id="typo-key",
        ),
        pytest.param(
            ["--config", str(RECIPE), "--learnig_rate", "0.1"],
            "error: unknown argument '--learnig_rate' (did you mean '--learning_rate'?)",
            id="typo-flag",
        ),
        pytest.param(
            ["--config", str(RECIPE), "--max_steps", "0"], "error: max_steps must be a positive number", id="zero-steps"
        ),
        pytest.param(
            ["--config", str(RECIPE), "--max_steps", "many"], "argument --max_steps/--max-steps: invalid int", id="int"
        ),
    ],
)
def test_launch_script_refuses_in_one_line(argv, line, launch_script, workdir, capsys):
    out = workdir / "out"
    got = _refused(launch_script, ["--output_dir", str(out)] + [a.format(dir=workdir) for a in argv], capsys)
    assert line.format(dir=workdir) in got
    assert not out.exists()
