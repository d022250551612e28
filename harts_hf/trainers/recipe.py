"""The agentic GRPO recipe shared by ``harts-hf train`` and ``recipes/grpo_agentic.py``.

A recipe is one YAML file in TRL's conventions: :class:`HARTSGRPOConfig` fields plus the
:class:`AgenticArguments` below, read with ``TrlParser`` (``--config``). A config may be a file, a
directory holding ``config.yaml`` (the Hub-publishable layout: ``config.yaml`` + a model-card
``README.md``), or a Hub repo id with that layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..envs import LedgerRunner, build_tokenizer, ledger_dataset, ledger_rollout, sample_reward
from .config import HARTSGRPOConfig
from .grpo import HARTSGRPOTrainer

__all__ = [
    "BUILTIN_PREFIX",
    "DEFAULT_RECIPE",
    "AgenticArguments",
    "build_trainer",
    "load_model",
    "parse_recipe",
    "resolve_config",
]

BUILTIN_PREFIX = "builtin:"

DEFAULT_RECIPE: dict = {
    "model_name_or_path": "builtin:qwen3_5-quick",
    "env_mode": "per_turn",
    "max_turns": 3,
    "episodes_per_task": 4,
    "num_generations": 12,
    "per_device_train_batch_size": 24,
    "max_steps": 12,
    "learning_rate": 3e-4,
    "loss_type": "dapo",
    "beta": 0.0,
    "temperature": 1.0,
    "max_completion_length": 96,
    "use_cpu": True,
    "bf16": False,
    "gradient_checkpointing": False,
    "logging_steps": 1,
    "report_to": "none",
    "save_strategy": "no",
    "seed": 0,
    "output_dir": "outputs/qwen3_5-tiny-agentic",
}
"""The embedded default run (``harts-hf train`` without ``--config``); recipes/configs/qwen3_5_tiny_agentic
holds the same values as a Hub-publishable config."""


@dataclass
class AgenticArguments:
    """What the recipe trains on: the model and the built-in tool environment's episodes."""

    model_name_or_path: str = field(
        default="builtin:qwen3_5-quick",
        metadata={
            "help": "Hub id or local path of a causal LM, or builtin:FAMILY-SIZE for a freshly initialised "
            "model of harts_hf.bench.models (e.g. builtin:qwen3_5-quick, a tiny Qwen3.5-style hybrid)."
        },
    )
    seed_model: int = field(default=0, metadata={"help": "Initialisation seed of builtin: models."})
    env_mode: str = field(default="per_turn", metadata={"help": "per_turn (one sample per turn) or episode."})
    max_turns: int = field(default=3, metadata={"help": "Tool calls per episode."})
    episodes_per_task: int = field(default=4, metadata={"help": "Episodes per task (the GRPO group)."})
    num_tasks: int = field(default=256, metadata={"help": "Ledger tasks in the training set."})
    reasoning_tokens: int = field(default=16, metadata={"help": "Reasoning tokens generated per turn."})
    action_tokens: int = field(default=10, metadata={"help": "Tool-call tokens generated per turn."})

    def runner(self) -> LedgerRunner:
        return LedgerRunner(self.max_turns, self.reasoning_tokens, self.action_tokens, self.env_mode)


def resolve_config(ref: str | Path) -> Path:
    """A YAML file: ``ref`` itself, ``ref/config.yaml``, or ``config.yaml`` of Hub repo ``ref``."""
    path = Path(ref)
    if path.is_file():
        return path
    if path.is_dir():
        return path / "config.yaml"
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id=str(ref), filename="config.yaml"))


def parse_recipe(values: dict) -> tuple[AgenticArguments, HARTSGRPOConfig]:
    """(environment/model arguments, trainer config) from one flat dict of recipe values."""
    from transformers import HfArgumentParser

    return HfArgumentParser((AgenticArguments, HARTSGRPOConfig)).parse_dict(values)


def load_model(args: AgenticArguments) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (training mode) and its tokenizer (the in-code one for builtin: models and
    checkpoints that ship none)."""
    name = args.model_name_or_path
    if name.startswith(BUILTIN_PREFIX):
        from ..bench.models import build_model

        family, _, size = name[len(BUILTIN_PREFIX) :].rpartition("-")
        return build_model(family, size, seed=args.seed_model).model.train(), build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(name, dtype="auto")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, padding_side="left")
    except (OSError, ValueError):
        tokenizer = build_tokenizer()
    return model.train(), tokenizer


def build_trainer(args: AgenticArguments, training_args: HARTSGRPOConfig, callbacks=None) -> HARTSGRPOTrainer:
    """A HARTSGRPOTrainer on the built-in environment (``harts_enable=False``: stock GRPO)."""
    runner = args.runner()
    group = args.episodes_per_task * runner.samples_per_episode
    if training_args.num_generations != group:
        raise ValueError(
            f"num_generations must be episodes_per_task x samples per episode = {group} "
            f"({args.episodes_per_task} x {runner.samples_per_episode}), got {training_args.num_generations}"
        )
    model, tokenizer = load_model(args)
    if args.model_name_or_path.startswith(BUILTIN_PREFIX) and training_args.beta != 0:
        # TRL builds the KL reference by reloading the policy from its path: give the in-code model one.
        reference = Path(training_args.output_dir) / "reference-model"
        model.save_pretrained(reference)
        model.config._name_or_path = str(reference)
    return HARTSGRPOTrainer(
        model=model,
        reward_funcs=sample_reward,
        args=training_args,
        train_dataset=ledger_dataset(args.num_tasks),
        processing_class=tokenizer,
        rollout_func=ledger_rollout(runner),
        callbacks=callbacks,
    )
