"""A recipe read and checked before any work: every mistake is a one-line error that names the fix,
never a traceback from deep in TRL or the Hub client."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from difflib import get_close_matches
from pathlib import Path

import yaml
from transformers import HfArgumentParser, TrainingArguments

from .arguments import ModelArguments
from .kinds import RECIPES, Recipe, get_recipe
from .source import resolve_config

__all__ = ["check_arguments", "check_config", "check_recipe", "parse_recipe"]


def _hint(key: str, recipe: Recipe, prefix: str = "") -> str:
    """The fix for a key ``recipe`` does not have: the recipes that have it, else the closest key,
    else where the valid ones are."""
    if others := [r.name for r in RECIPES.values() if key in r.keys]:
        return f"a key of the {' and '.join(others)} recipe{'s' * (len(others) > 1)}, not of {recipe.name}"
    if close := get_close_matches(key, recipe.keys, n=1):
        return f"did you mean {prefix + close[0]!r}?"
    return f"not a field of {recipe.config.__name__} or {recipe.arguments.__name__}"


def _check_keys(keys: Iterable[object], where: str, recipe: Recipe) -> None:
    """Refuse the first key that is no field of the recipe (TRL names it without a hint)."""
    for key in keys:
        if key not in recipe.keys:
            raise ValueError(f"unknown key {key!r} in {where} ({_hint(str(key), recipe)})")


def check_config(ref: str | Path, kind: str = "grpo") -> Path:
    """The YAML file of recipe ``ref`` (:func:`resolve_config`) for trainer ``kind``, read before any
    work: a one-line ValueError when it is not YAML, not a mapping, or sets a key that is no field."""
    recipe = get_recipe(kind)
    path = resolve_config(ref)
    try:
        with path.open() as file:
            values = yaml.safe_load(file)
    except yaml.YAMLError as err:
        raise ValueError(f"--config {ref}: not valid YAML ({' '.join(str(err).split())})") from err
    if not isinstance(values, dict):
        message = f"--config {ref}: must be a mapping of recipe keys, got {type(values).__name__}"
        raise ValueError(message)  # noqa: TRY004  a file's content, not an argument of the wrong type
    _check_keys((key for key in values if key != "env"), str(ref), recipe)  # env: TrlParser's environment variables
    return path


def check_arguments(unused: Sequence[str], kind: str = "grpo") -> None:
    """Refuse the command-line strings ``TrlParser`` left unused (``return_remaining_strings=True``),
    the first one named with the closest recipe flag."""
    if unused:
        key = unused[0].lstrip("-").partition("=")[0].replace("-", "_")
        raise ValueError(f"unknown argument {unused[0]!r} ({_hint(key, get_recipe(kind), '--')})")


def check_recipe(args: ModelArguments, training_args: TrainingArguments) -> None:
    """Refuse values TRL accepts but a recipe cannot run, before the model is built: no steps (TRL
    would run one at learning rate 0), and what the data arguments refuse (``args.check``)."""
    if training_args.max_steps == 0 or training_args.max_steps < -1:
        steps = training_args.max_steps
        raise ValueError(f"max_steps must be a positive number of steps (or -1: train num_train_epochs), got {steps}")
    args.check(training_args)


def parse_recipe(values: dict, kind: str = "grpo") -> tuple[ModelArguments, TrainingArguments]:
    """(data arguments, trainer config) of trainer ``kind`` from one flat dict of recipe values,
    checked by :func:`check_recipe`."""
    recipe = get_recipe(kind)
    args, training_args = HfArgumentParser((recipe.arguments, recipe.config)).parse_dict(values)
    check_recipe(args, training_args)
    return args, training_args
