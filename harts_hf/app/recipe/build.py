"""A recipe's model and trainer: the policy (a checkpoint, or a freshly initialised ``builtin:``
model), its tokenizer, and the kind's HARTS trainer on the built-in data, with the recipe console."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
)

from ...sources import build_tokenizer
from ..console import no_progress_bars, quiet_console
from ..progress import StepLine
from .arguments import BUILTIN_PREFIX, ModelArguments, builtin_model
from .recipes import recipe_for
from .parse import check_recipe

__all__ = ["build_trainer", "load_model"]


def load_model(
    args: ModelArguments, tokenizer: Callable[[], PreTrainedTokenizerBase] = build_tokenizer
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (training mode) and its tokenizer (``tokenizer()`` for builtin: models and
    checkpoints that ship none)."""
    name = args.model_name_or_path
    if name.startswith(BUILTIN_PREFIX):
        from ...lab.models import build_model

        return build_model(*builtin_model(name), seed=args.seed_model).model.train(), tokenizer()
    model = AutoModelForCausalLM.from_pretrained(name, dtype="auto")
    try:
        loaded = AutoTokenizer.from_pretrained(name, padding_side="left")
    except (OSError, ValueError):
        loaded = tokenizer()
    return model.train(), loaded


def build_trainer(args: ModelArguments, training_args: TrainingArguments) -> Trainer:
    """The recipe's HARTS trainer on its built-in data (``harts_enable=False``: the stock trainer)
    whose console is :class:`~harts_hf.app.progress.StepLine` (TRL's metrics dict too with ``verbose``)."""
    recipe = recipe_for(args)
    check_recipe(args, training_args)
    model, tokenizer = load_model(args, recipe.tokenizer)
    with no_progress_bars():
        if args.model_name_or_path.startswith(BUILTIN_PREFIX) and recipe.reference(training_args):
            # TRL builds the reference by reloading the policy from its path: give the in-code model one.
            reference = Path(training_args.output_dir) / "reference-model"
            model.save_pretrained(reference)
            model.config.name_or_path = str(reference)
        trainer = recipe.trainer(
            model=model,
            args=training_args,
            processing_class=tokenizer,
            callbacks=[StepLine(args.describe(), recipe.title)],
            **args.train_inputs(),
        )
    return quiet_console(trainer, args.verbose)
