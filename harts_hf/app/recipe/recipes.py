"""The four recipes, one short declaration each: trainer, config, data arguments, in-code tokenizer,
whether TRL reloads a reference policy, and the embedded default run (``harts-hf train --trainer
KIND`` without ``--config``; ``recipes/configs/qwen3_5_quick_*`` hold the same values as
Hub-publishable configs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cached_property

from transformers import PreTrainedTokenizerBase, Trainer, TrainingArguments

from ...sources import agent_tokenizer, build_tokenizer
from ...trainers import (
    HARTSDPOConfig,
    HARTSDPOTrainer,
    HARTSGRPOConfig,
    HARTSGRPOTrainer,
    HARTSRLOOConfig,
    HARTSRLOOTrainer,
    HARTSSFTConfig,
    HARTSSFTTrainer,
)
from .arguments import AgenticArguments, ConversationArguments, LedgerTurnArguments, ModelArguments, PreferenceArguments

__all__ = ["DEFAULT_RECIPE", "RECIPES", "Recipe", "get_recipe", "recipe_for"]


def _never(training_args: TrainingArguments) -> bool:
    return False


def _with_kl(training_args: TrainingArguments) -> bool:
    return training_args.beta != 0


def _always(training_args: TrainingArguments) -> bool:
    return True


@dataclass(frozen=True)
class Recipe:
    """One trainer's recipe (module docstring)."""

    name: str
    trainer: type[Trainer]
    config: type[TrainingArguments]
    arguments: type[ModelArguments]
    tokenizer: Callable[[], PreTrainedTokenizerBase]
    """The tokenizer of builtin: models (and of checkpoints that ship none): its template renders the data."""
    reference: Callable[[TrainingArguments], bool]
    """Whether TRL builds a reference policy by reloading the policy from its path."""
    defaults: dict

    @cached_property
    def keys(self) -> tuple[str, ...]:
        """Every key the recipe may set: the fields of its data arguments and its trainer config."""
        return tuple(sorted(f.name for cls in (self.arguments, self.config) for f in fields(cls)))

    @property
    def title(self) -> str:
        return self.name.upper()


_RUN = {  # every recipe's defaults: a short CPU run, one line per step, nothing saved but the model
    "model_name_or_path": "builtin:qwen3_5-quick",
    "max_steps": 12,
    "use_cpu": True,
    "bf16": False,
    "gradient_checkpointing": False,
    "ddp_find_unused_parameters": False,  # the built-in models train every parameter every step (MoE: true)
    "logging_steps": 1,
    "report_to": "none",
    "save_strategy": "no",
    "seed": 0,
}
_IN_ORDER = {"train_sampling_strategy": "sequential"}  # whole conversations per microbatch (ConversationArguments)

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "grpo",
            HARTSGRPOTrainer,
            HARTSGRPOConfig,
            AgenticArguments,
            tokenizer=build_tokenizer,
            reference=_with_kl,
            defaults={
                **_RUN,
                "env_mode": "per_turn",
                "max_turns": 3,
                "episodes_per_task": 4,
                "num_generations": 12,
                "per_device_train_batch_size": 24,
                "learning_rate": 3e-4,
                "loss_type": "dapo",
                "beta": 0.0,
                "temperature": 1.0,
                "max_completion_length": 96,
                "output_dir": "outputs/qwen3_5-quick-agentic",
            },
        ),
        Recipe(
            "rloo",
            HARTSRLOOTrainer,
            HARTSRLOOConfig,
            LedgerTurnArguments,
            tokenizer=build_tokenizer,
            reference=_with_kl,
            defaults={
                **_RUN,
                "num_tasks": 256,
                "num_generations": 8,
                "per_device_train_batch_size": 16,
                "learning_rate": 3e-4,
                "beta": 0.0,
                "temperature": 1.0,
                "max_completion_length": 32,
                "output_dir": "outputs/qwen3_5-quick-rloo",
            },
        ),
        Recipe(
            "sft",
            HARTSSFTTrainer,
            HARTSSFTConfig,
            ConversationArguments,
            tokenizer=agent_tokenizer,
            reference=_never,
            defaults={
                **_RUN,
                **_IN_ORDER,
                "num_conversations": 64,
                "turns": 3,
                "per_device_train_batch_size": 8,
                "learning_rate": 1e-3,
                "output_dir": "outputs/qwen3_5-quick-sft",
            },
        ),
        Recipe(
            "dpo",
            HARTSDPOTrainer,
            HARTSDPOConfig,
            PreferenceArguments,
            tokenizer=agent_tokenizer,
            reference=_always,  # TRL reloads it unless precompute_ref_log_probs (and under FSDP even then)
            defaults={
                **_RUN,
                **_IN_ORDER,
                "num_conversations": 64,
                "turns": 3,
                "per_device_train_batch_size": 8,
                "learning_rate": 1e-3,
                "beta": 0.1,
                "output_dir": "outputs/qwen3_5-quick-dpo",
            },
        ),
    )
}

DEFAULT_RECIPE: dict = RECIPES["grpo"].defaults
"""The embedded default run (``harts-hf train``); recipes/configs/qwen3_5_quick_agentic holds the same values."""


def get_recipe(trainer: str) -> Recipe:
    """The recipe of trainer ``trainer``; an unknown one fails with the sorted valid names."""
    if trainer not in RECIPES:
        raise ValueError(f"unknown trainer {trainer!r}; choose one of {', '.join(sorted(RECIPES))}")
    return RECIPES[trainer]


def recipe_for(args: ModelArguments) -> Recipe:
    """The recipe whose data arguments ``args`` are (each trainer has its own class)."""
    return next(r for r in RECIPES.values() if type(args) is r.arguments)
