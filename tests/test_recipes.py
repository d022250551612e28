"""The four recipes (GRPO, RLOO, SFT, DPO): each shipped config, loaded back from its local
directory (the Hub layout), is its kind's embedded default and a loadable model card, and trains a
step at tiny sizes, HARTS and stock; the built-in data they train on; and the new bad inputs, each
refused in one line before any work (exit code 2)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.data import SequentialSampler
from trl.data_utils import is_conversational

from harts_hf.app.cli import main
from harts_hf.app.recipe import RECIPES, build_trainer, check_config, parse_recipe
from harts_hf.sources import LedgerEnv, agent_preference_pairs, build_tokenizer, ledger_prompts, ledger_turn_reward

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"grpo": "agentic", "rloo": "rloo", "sft": "sft", "dpo": "dpo"}  # kind -> recipes/configs/qwen3_5_quick_*
TINY = {  # a step in about a second: two tasks or conversations, short generations
    "grpo": dict(num_tasks=2, max_turns=1, episodes_per_task=2, num_generations=2, per_device_train_batch_size=4,
                 reasoning_tokens=4, action_tokens=4, max_completion_length=16),
    "rloo": dict(num_tasks=2, num_generations=2, per_device_train_batch_size=4, max_completion_length=8),
    "sft": dict(num_conversations=2, turns=1, per_device_train_batch_size=2),
    "dpo": dict(num_conversations=2, turns=1, per_device_train_batch_size=2),
}  # fmt: skip


def config_dir(kind: str) -> Path:
    return ROOT / "recipes" / "configs" / f"qwen3_5_quick_{CONFIGS[kind]}"


def shipped(kind: str) -> dict:
    return yaml.safe_load(check_config(config_dir(kind), kind).read_text())


@pytest.mark.parametrize("kind", list(RECIPES))
def test_shipped_config_is_the_embedded_default_and_a_model_card(kind):
    from huggingface_hub import ModelCard

    values, defaults = shipped(kind), RECIPES[kind].defaults
    assert {k: values[k] for k in defaults} == defaults
    from_file, embedded = parse_recipe(values, kind), parse_recipe(dict(defaults), kind)
    assert from_file[0] == embedded[0] and from_file[1].to_dict() == embedded[1].to_dict()
    card = ModelCard.load(config_dir(kind) / "README.md")
    assert {"harts", kind} <= set(card.data.tags) and f"recipes/{kind}_agentic.py" in card.text


@pytest.mark.parametrize("harts", [True, False], ids=["harts", "stock"])
@pytest.mark.parametrize("kind", list(RECIPES))
def test_each_recipe_trains_a_step_from_its_config(kind, harts, tmp_path):
    values = shipped(kind) | TINY[kind] | dict(max_steps=1, output_dir=str(tmp_path), disable_tqdm=True)
    args, training_args = parse_recipe(values | dict(harts_enable=harts), kind)
    trainer = build_trainer(args, training_args)
    assert type(trainer) is RECIPES[kind].trainer and trainer.args.harts_enable is harts
    if kind in ("sft", "dpo"):  # conversation order: whole conversations per microbatch
        assert isinstance(trainer._get_train_sampler(), SequentialSampler)
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert log["loss"] == log["loss"]  # not NaN
    assert ("harts/compression" in log) is harts  # every trainer logs its sharing


def test_preference_pairs_are_trls_conversational_format():
    pairs = agent_preference_pairs(2, turns=2, seed=3)
    assert len(pairs) == 2 * 3
    assert all(is_conversational(p) and set(p) == {"prompt", "chosen", "rejected"} for p in pairs)
    assert [p["prompt"][-1]["role"] for p in pairs[:3]] == ["user", "tool", "tool"]
    for p in pairs:
        (chosen,), (rejected,) = p["chosen"], p["rejected"]
        assert chosen["role"] == rejected["role"] == "assistant" and chosen != rejected
        assert bool(chosen.get("tool_calls")) is not bool(rejected.get("tool_calls"))  # the other move
    assert pairs[1]["prompt"][:4] == pairs[2]["prompt"][:4]  # a conversation's pairs share its history
    assert "reasoning_content" not in pairs[1]["prompt"][2]  # earlier reasoning dropped
    assert agent_preference_pairs(2, turns=2, seed=3) == pairs


def test_ledger_turn_reward_plays_the_call():
    tok, env = build_tokenizer(), LedgerEnv()
    env.reset(5)
    row = ledger_prompts(1, start=5)[0]
    assert row["task"] == 5 and row["prompt"][1]["content"] == LedgerEnv().reset(5)
    right = tok(f"sum it<|act|>answer {env.target}<eos>")["input_ids"]
    no_reasoning = tok(f"answer {env.target}")["input_ids"]
    assert ledger_turn_reward([right, no_reasoning, []], [5, 5, 5]) == [1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        pytest.param(
            ["--trainer", "ppo"],
            "harts-hf train: error: argument --trainer: invalid choice: 'ppo' (choose from 'dpo', 'grpo', 'rloo', "
            "'sft')",
            id="unknown-trainer",
        ),
        pytest.param(
            ["--config", str(config_dir("sft"))],
            "unknown key 'num_conversations' in {sft} (a key of the sft and dpo recipes, not of grpo)",
            id="config-of-another-trainer",
        ),
        pytest.param(
            ["--trainer", "sft", "--config", "{dir}/batch.yaml"],
            "harts-hf train: error: per_device_train_batch_size must be a multiple of the per-turn samples per "
            "conversation = turns + 1 = 4 (whole conversations per microbatch), got 6",
            id="sft-batch-splits-conversations",
        ),
        pytest.param(
            ["--trainer", "rloo", "--config", "{dir}/no_tasks.yaml"],
            "LedgerTurnArguments: num_tasks must be a positive integer, got 0",
            id="rloo-no-tasks",
        ),
        pytest.param(
            ["--model_name_or_path", "builtin:qwen3_5-huge"],
            "a built-in model is builtin:FAMILY-SIZE with FAMILY one of bailing_hybrid",
            id="builtin-model-size",
        ),
        pytest.param(
            ["--max_steps", "ten"], "harts-hf train: error: max_steps must be an integer, got 'ten'", id="steps-text"
        ),
        pytest.param(["--learning_rate=fast"], "learning_rate must be a number, got 'fast'", id="rate-text"),
        pytest.param(["--bf16", "maybe"], "bf16 must be true or false, got 'maybe'", id="switch-text"),
        pytest.param(["--loss_type", "ppo"], "loss_type 'ppo' is not one of TRL's: grpo, dr_grpo", id="grpo-loss"),
        pytest.param(
            ["--trainer", "dpo", "--loss_type", "ipo", "nope"], "loss_type 'nope' is not one of TRL's", id="dpo-loss"
        ),
        pytest.param(
            ["--lerning_rate", "1e-3"],
            "unknown argument '--lerning_rate' (did you mean '--learning_rate'?)",
            id="flag-typo",
        ),
        pytest.param(
            ["--resume_from_checkpoint", "true"],
            "resume_from_checkpoint=true: no checkpoint-N directory in output_dir '{dir}/out'",
            id="resume-without-checkpoint",
        ),
    ],
)
def test_train_refuses_in_one_line(argv, line, tmp_path, capsys):
    (tmp_path / "batch.yaml").write_text("per_device_train_batch_size: 6\n")
    (tmp_path / "no_tasks.yaml").write_text("num_tasks: 0\n")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *(a.format(dir=tmp_path) for a in argv), "--output-dir", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert line.format(dir=tmp_path, sft=config_dir("sft")) in err
    assert not out.exists()


def test_an_unknown_trainer_kind_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"^unknown trainer 'ppo'; choose one of dpo, grpo, rloo, sft$"):
        parse_recipe({}, "ppo")


@pytest.mark.parametrize(
    ("kind", "flag", "line"),
    [
        ("sft", ["--per_device_train_batch_size", "3"], "multiple of the per-turn samples per conversation = turns"),
        ("dpo", ["--turns", "0"], "PreferenceArguments: turns must be a positive integer, got 0"),
        ("rloo", ["--num_conversations", "2"], "unknown argument '--num_conversations' (a key of the sft and dpo"),
    ],
    ids=["sft", "dpo", "rloo"],
)
def test_launch_scripts_refuse_in_one_line(kind, flag, line, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(f"{kind}_agentic", ROOT / f"recipes/{kind}_agentic.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--config", str(config_dir(kind)), "--output_dir", str(tmp_path / "out"), *flag])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and line in err, err


def test_the_step_time_config_is_the_grpo_recipe_on_the_default_model_under_a_smaller_budget():
    """``qwen3_5_default_agentic`` (what the README's train-compare figures run) changes the GRPO
    recipe only in its model, its microbatches (stock's of 2 rows, HARTS' budget), its calibrated
    cost model, its steps and its output."""
    from huggingface_hub import ModelCard

    directory = ROOT / "recipes" / "configs" / "qwen3_5_default_agentic"
    values = yaml.safe_load(check_config(directory, "grpo").read_text())
    changed = {k for k in values.keys() | shipped("grpo").keys() if values.get(k) != shipped("grpo").get(k)}
    assert changed == {
        "model_name_or_path", "per_device_train_batch_size", "gradient_accumulation_steps",
        "harts_max_tokens_per_microbatch", "harts_cost_model", "max_steps", "output_dir",
    }  # fmt: skip
    args, training_args = parse_recipe(values, "grpo")
    assert args.model_name_or_path == "builtin:qwen3_5-default" and training_args.harts_max_tokens_per_microbatch == 768
    assert training_args.harts_cost_model["token"] > 0
    assert "train-compare" in ModelCard.load(directory / "README.md").text


def test_a_stopped_run_resumes_where_it_stopped(tmp_path, capsys):
    """``--resume_from_checkpoint true`` (TRL's flag, as TRL's scripts take it): steps 3-4 after a stop
    at step 2 end with the parameters of the run that went straight through, through ``harts-hf
    train`` and through the recipe script's ``launch``."""
    from safetensors.torch import load_file

    from harts_hf.app.recipe import launch

    tiny = [f"--{key}={value}" for key, value in TINY["sft"].items()]
    run = ["--config", str(config_dir("sft")), *tiny, "--max_steps=4", "--save_strategy=steps", "--save_steps=2"]
    assert main(["train", "--trainer", "sft", *run, "--output_dir", str(tmp_path / "straight")]) == 0
    shutil.copytree(tmp_path / "straight" / "checkpoint-2", tmp_path / "stopped" / "checkpoint-2")
    launch("sft", [*run, "--output_dir", str(tmp_path / "stopped"), "--resume_from_checkpoint", "true"])
    console = capsys.readouterr()
    assert "done: 4 steps" in console.out and "done: 2 steps (3-4, resumed after step 2)" in console.out
    assert "Writing model shards" not in console.out + console.err
    straight, resumed = (load_file(tmp_path / name / "model.safetensors") for name in ("straight", "stopped"))
    assert all(torch.equal(straight[key], resumed[key]) for key in straight)
    first = load_file(tmp_path / "straight" / "checkpoint-2" / "model.safetensors")
    assert any(not torch.equal(first[key], resumed[key]) for key in first)  # steps 3 and 4 did train
