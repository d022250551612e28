"""The body of the accelerate-launched recipe scripts (``recipes/<trainer>_agentic.py``): TRL's parser
on the trainer's two dataclasses, the checks, training (resumed from ``--resume_from_checkpoint PATH``,
or ``true`` for the output directory's last checkpoint, as TRL's scripts do), saving.

``--config`` is a TRL YAML (the trainer config's fields and the data arguments'); any field can also
be given as a flag (``--max_steps 5``). A config directory or a Hub repo id holding ``config.yaml``
works too. A missing config, an unknown key or flag and a value the recipe cannot run fail in one
line (exit code 2) before the model is built.
"""

from __future__ import annotations

from typing import NoReturn

from trl import TrlParser

from ...trainers.teardown import end_distributed
from ..console import no_progress_bars, quiet_third_party
from .build import build_trainer
from .recipes import get_recipe
from .parse import check_arguments, check_config, check_recipe, resume_from

__all__ = ["launch", "train_recipe"]


class _Parser(TrlParser):
    """TrlParser whose errors are one line (exit code 2): the usage argparse prints first lists every
    field of the two dataclasses, hundreds of lines."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def launch(trainer: str, argv: list[str]) -> None:
    """Train recipe ``trainer`` as ``argv`` (a script's command line) says, and save the model."""
    quiet_third_party()
    recipe = get_recipe(trainer)
    parser = _Parser((recipe.arguments, recipe.config))
    try:
        if "--config" in argv:  # a config directory or Hub repo id as well as a YAML file, its keys checked
            i = argv.index("--config") + 1
            if i == len(argv):
                parser.error("argument --config: expected one argument")
            argv[i] = str(check_config(argv[i], trainer))
        script_args, training_args, unused = parser.parse_args_and_config(argv, return_remaining_strings=True)
        check_arguments(unused, trainer)
        check_recipe(script_args, training_args)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    train_recipe(script_args, training_args)


def train_recipe(script_args, training_args) -> None:
    """Build the recipe's trainer, train it (resuming where ``resume_from_checkpoint`` says), save
    the model, and end the distributed run cleanly."""
    trainer = build_trainer(script_args, training_args)
    with no_progress_bars():  # saving small checkpoints (during training too) needs no bar
        trainer.train(resume_from_checkpoint=resume_from(training_args.resume_from_checkpoint))
        trainer.save_model(training_args.output_dir)
    del trainer  # its DDP wrapper holds the process group, which end_distributed frees
    end_distributed()
