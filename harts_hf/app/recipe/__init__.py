"""The recipes shared by ``harts-hf train --trainer NAME`` and ``recipes/<name>_agentic.py``: GRPO and
RLOO on the built-in tool environment, SFT and DPO on the built-in agent conversations.

A recipe is one YAML file in TRL's conventions: the fields of its trainer's HARTS config plus its
data arguments (``arguments.py``), read with ``TrlParser`` (``--config``). A config may be a file, a
directory holding ``config.yaml`` (what a Hub repo publishes: ``config.yaml`` + a model-card
``README.md``), or a Hub repo id with those files (``source.py``). The recipes differ only in their
declaration (``recipes.py``); reading and checking (``parse.py``), building (``build.py``) and the
script body (``launch.py``) are one path for all four.
"""

from .arguments import (
    BUILTIN_PREFIX,
    AgenticArguments,
    ConversationArguments,
    LedgerTurnArguments,
    ModelArguments,
    PreferenceArguments,
    builtin_model,
)
from .build import build_trainer, load_model
from .recipes import DEFAULT_RECIPE, RECIPES, Recipe, get_recipe, recipe_for
from .launch import launch, train_recipe
from .parse import check_arguments, check_config, check_recipe, parse_recipe, resume_from
from .source import resolve_config

__all__ = [
    "BUILTIN_PREFIX",
    "DEFAULT_RECIPE",
    "RECIPES",
    "AgenticArguments",
    "ConversationArguments",
    "LedgerTurnArguments",
    "ModelArguments",
    "PreferenceArguments",
    "Recipe",
    "build_trainer",
    "builtin_model",
    "check_arguments",
    "check_config",
    "check_recipe",
    "get_recipe",
    "launch",
    "load_model",
    "parse_recipe",
    "recipe_for",
    "resolve_config",
    "resume_from",
    "train_recipe",
]
