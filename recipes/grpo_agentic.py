"""HARTS GRPO on the built-in multi-turn tool environment, launched by accelerate.

    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml recipes/grpo_agentic.py \
        --config recipes/configs/qwen3_5_quick_agentic/config.yaml

``--config`` is a TRL YAML (HARTSGRPOConfig + AgenticArguments fields); any field can also be given
as a flag (``--max_steps 5``). A config directory or a Hub repo id holding ``config.yaml`` works too.
A missing config, an unknown key or flag and a value the recipe cannot run fail in one line (exit
code 2) before the model is built.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from trl import TrlParser

from harts_hf.trainers import HARTSGRPOConfig
from harts_hf.trainers.console import quiet_third_party
from harts_hf.trainers.recipe import AgenticArguments, build_trainer, check_arguments, check_config, check_recipe


class _Parser(TrlParser):
    """TrlParser whose errors are one line (exit code 2): the usage argparse prints first lists every
    field of the two configs, hundreds of lines."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str]) -> None:
    quiet_third_party()
    parser = _Parser((AgenticArguments, HARTSGRPOConfig))
    try:
        if "--config" in argv:  # a config directory or Hub repo id as well as a YAML file, its keys checked
            i = argv.index("--config") + 1
            if i == len(argv):
                parser.error("argument --config: expected one argument")
            argv[i] = str(check_config(argv[i]))
        script_args, training_args, unused = parser.parse_args_and_config(argv, return_remaining_strings=True)
        check_arguments(unused)
        check_recipe(script_args, training_args)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    trainer = build_trainer(script_args, training_args)
    trainer.train()
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()  # destroys the process group: gloo's threads abort the exit otherwise


if __name__ == "__main__":
    main(sys.argv[1:])
