"""A recipe read and checked before any work: every mistake is a one-line error that names the fix,
never a traceback from deep in TRL or the Hub client."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable, Sequence
from difflib import get_close_matches
from pathlib import Path

import yaml
from transformers import HfArgumentParser, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from .arguments import BUILTIN_PREFIX, ModelArguments, builtin_model
from .recipes import RECIPES, Recipe, get_recipe
from .source import resolve_config

__all__ = ["check_arguments", "check_config", "check_recipe", "parse_recipe", "resume_from"]


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


def check_config(ref: str | Path, trainer: str = "grpo") -> Path:
    """The YAML file of recipe ``ref`` (:func:`resolve_config`) for trainer ``trainer``, read before any
    work: a one-line ValueError when it is not YAML, not a mapping, or sets a key that is no field."""
    recipe = get_recipe(trainer)
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


def check_arguments(unused: Sequence[str], trainer: str = "grpo") -> None:
    """Refuse the command-line strings ``TrlParser`` left unused (``return_remaining_strings=True``),
    the first one named with the closest recipe flag."""
    if unused:
        key = unused[0].lstrip("-").partition("=")[0].replace("-", "_")
        raise ValueError(f"unknown argument {unused[0]!r} ({_hint(key, get_recipe(trainer), '--')})")


def resume_from(value: str | None) -> str | bool | None:
    """``Trainer.train``'s ``resume_from_checkpoint`` for the config's text: ``true`` is the output
    directory's last checkpoint (as in TRL's scripts), ``false`` or nothing a fresh run, else a path."""
    if value is None or value.lower() in ("", "false"):
        return None
    return True if value.lower() == "true" else value


def check_recipe(args: ModelArguments, training_args: TrainingArguments) -> None:
    """Refuse values TRL accepts but a recipe cannot run, before the model is built: no steps (TRL
    would run one at learning rate 0), a built-in model that does not exist, a checkpoint to resume
    from that is not there, and what the data arguments refuse (``args.check``)."""
    if training_args.max_steps == 0 or training_args.max_steps < -1:
        steps = training_args.max_steps
        raise ValueError(f"max_steps must be a positive number of steps (or -1: train num_train_epochs), got {steps}")
    if args.model_name_or_path.startswith(BUILTIN_PREFIX):
        builtin_model(args.model_name_or_path)
    resume, out = resume_from(training_args.resume_from_checkpoint), training_args.output_dir
    if resume is True and not (Path(out).is_dir() and get_last_checkpoint(out)):
        raise ValueError(f"resume_from_checkpoint=true: no checkpoint-N directory in output_dir {out!r}")
    if isinstance(resume, str) and not Path(resume).is_dir():
        raise ValueError(f"resume_from_checkpoint: no checkpoint directory {resume!r}")
    args.check(training_args)


def _scalar_type(hint: object) -> type | None:
    """bool, int or float where a field's type is that scalar (or it or None), else None."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    scalars = [t for t in options if t in (bool, int, float)]
    return scalars[0] if len(scalars) == 1 and set(options) <= {bool, int, float, type(None)} else None


def _list_item(hint: object) -> object | None:
    """The item type where a field's type is a list (or a list or None), else None."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    lists = [t for t in options if typing.get_origin(t) is list]
    return typing.get_args(lists[0])[0] if len(lists) == 1 else None


def _as_scalar(key: str, value: object, expected: type) -> object:
    """``value`` (a YAML value, or a flag's text) as the field's ``expected``, or a one-line ValueError."""
    if expected is bool and isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    if expected is not bool and isinstance(value, str):
        try:
            return expected(value)
        except ValueError:
            pass
    if isinstance(value, expected) and not (expected is not bool and isinstance(value, bool)):
        return value
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    names = {bool: "true or false", int: "an integer", float: "a number"}
    raise ValueError(f"{key} must be {names[expected]}, got {value!r}")


def _typed(values: dict, recipe: Recipe) -> dict:
    """``values`` with every bool / int / float field (or list of them) converted from text
    (command-line flags) and checked: a wrong type is one line here, not a traceback from inside
    TRL or transformers. A list field given one value is a list of one."""
    hints = {**typing.get_type_hints(recipe.config), **typing.get_type_hints(recipe.arguments)}
    out = dict(values)
    for key, value in values.items():
        hint = hints.get(key)
        if value is None:
            continue
        if _list_item(hint) is not None:
            items = value if isinstance(value, list) else [value]
            expected = _scalar_type(_list_item(hint))
            out[key] = items if expected is None else [_as_scalar(key, v, expected) for v in items]
        elif (expected := _scalar_type(hint)) is not None:
            out[key] = _as_scalar(key, value, expected)
    return out


def parse_recipe(values: dict, trainer: str = "grpo") -> tuple[ModelArguments, TrainingArguments]:
    """(data arguments, trainer config) of trainer ``trainer`` from one flat dict of recipe values
    (numbers and switches may be text, as flags give them), checked by :func:`check_recipe`."""
    recipe = get_recipe(trainer)
    _check_keys(values, "the recipe", recipe)
    values = _typed(values, recipe)
    args, training_args = HfArgumentParser((recipe.arguments, recipe.config)).parse_dict(values)
    check_recipe(args, training_args)
    return args, training_args
