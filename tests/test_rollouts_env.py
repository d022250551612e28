"""The built-in tool environment, the episode -> TRL rows bridge, and the agentic recipe end to end."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harts_hf.app.recipe import DEFAULT_RECIPE, parse_recipe, resolve_config
from harts_hf.forest import RolloutForest
from harts_hf.sources import LedgerEnv, LedgerRunner, Sample, build_tokenizer, episode_rollout, sample_reward

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "configs" / "qwen3_5_quick_agentic"


def test_ledger_env_is_deterministic_and_scores_answers():
    a, b = LedgerEnv(), LedgerEnv()
    assert a.reset(7) == b.reset(7) and a.reset(7) != a.reset(8)
    a.reset(7)
    first = a.asked[0]
    assert a.step(f"get {first}") == str(a.balances[first])
    assert a.step("add 2 40") == "42"
    assert a.step(f"answer {a.target}") == "submitted" and a.done
    assert a.reward() == pytest.approx(1.0)
    b.reset(7)
    b.step("?!")
    assert b.step("get nowhere").startswith("error") and b.reward() < 0.2


class _Trainer:
    num_generations = 6
    num_generations_eval = 6

    class model:
        training = True


def _sample(prompt: list[int], completion: list[int], reward: float) -> Sample:
    return Sample(prompt, completion, [1] * len(completion), [0.0] * len(completion), reward)


def test_episode_rollout_rows_groups_and_fillers():
    def runner(tasks, episodes, trainer):
        assert episodes == 2
        return [[[_sample([1, 2], [3], 0.5), _sample([1, 2, 3], [4], 0.5)], [_sample([1, 2], [5], 1.0)]] for _ in tasks]

    out = episode_rollout(runner, 3)(["a"] * 6 + ["b"] * 6, _Trainer())
    assert len(out["prompt_ids"]) == 12 and out["sample_reward"][:6] == [0.5, 0.5, 0.5, 1.0, 1.0, 1.0]
    assert out["env_mask"][2] == [0] and out["env_mask"][5] == [0]  # fillers: masked copies
    assert sample_reward(None, out["sample_reward"]) == out["sample_reward"]
    with pytest.raises(ValueError, match="multiple"):
        episode_rollout(runner, 4)(["a"] * 6, _Trainer())
    with pytest.raises(ValueError, match="one value per"):
        Sample([1], [2, 3], [1], [0.0, 0.0], 0.0)


def test_recipe_config_matches_the_embedded_default():
    values = yaml.safe_load(resolve_config(RECIPE).read_text())
    assert {k: values[k] for k in DEFAULT_RECIPE} == DEFAULT_RECIPE
    script_args, training_args = parse_recipe(values)
    assert training_args.harts_enable and training_args.num_generations == 12
    assert script_args.runner().samples_per_episode == 3


def test_recipe_dir_is_a_loadable_model_card():
    from huggingface_hub import ModelCard

    card = ModelCard.load(RECIPE / "README.md")
    assert "harts" in card.data.tags and "config.yaml" in card.text


@pytest.mark.slow
def test_recipe_trains_per_turn_samples_on_forests(tmp_path):
    """recipes/grpo_agentic.py on the local config directory (with a KL reference): per-turn samples
    share prefixes."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "grpo_agentic.py"),
        "--config",
        str(RECIPE),
        "--max_steps",
        "1",
        "--per_device_train_batch_size",
        "12",
        "--output_dir",
        str(out),
        "--num_tasks",
        "4",
        "--beta",  # the KL reference of the in-code model is reloaded from a saved copy, as TRL reloads one
        "0.1",
    ]
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    assert (out / "reference-model" / "model.safetensors").exists()
    line = next(x for x in run.stdout.splitlines() + run.stderr.splitlines() if "compression" in x and "step" in x)
    assert float(line.split("compression ")[1].split("x")[0]) > 2.0


def test_per_turn_samples_drop_reasoning_and_share_prefixes():
    """LedgerRunner with a tiny random hybrid: sample t + 1's context is sample t's context plus
    its action and observation, never its reasoning; scaffold tokens are masked; samples share."""
    from types import SimpleNamespace

    import torch
    from accelerate import Accelerator

    from harts_hf.lab.models import build_model

    torch.manual_seed(0)
    trainer = SimpleNamespace(
        processing_class=build_tokenizer(),
        model_wrapped=build_model("qwen3_5", "tiny").model,
        accelerator=Accelerator(cpu=True),
        temperature=1.0,
    )
    runner = LedgerRunner(max_turns=3, reasoning_tokens=4, action_tokens=3, mode="per_turn")
    (episodes,) = runner(["5"], 2, trainer)
    rows = []
    for episode in episodes:
        for s, nxt in itertools.pairwise(episode):
            act = s.completion_ids.index(7)  # reasoning is completion[:act]
            assert nxt.prompt_ids[: len(s.prompt_ids)] == s.prompt_ids
            assert nxt.prompt_ids[len(s.prompt_ids)] == 7  # the action follows directly: reasoning dropped
            assert s.env_mask[act] == (act < 4)  # <|act|> is the model's unless the scaffold appended it
            assert 1 <= act and s.completion_ids[-1] == 2 and all(s.env_mask[:act])
        rows += [s.prompt_ids + s.completion_ids for s in episode]
    assert RolloutForest.from_sequences(rows).compression > 3.0
