"""HARTS GRPO on the built-in multi-turn tool environment, launched by accelerate.

    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml recipes/grpo_agentic.py \
        --config recipes/configs/qwen3_5_tiny_agentic/config.yaml

``--config`` is a TRL YAML (HARTSGRPOConfig + AgenticArguments fields); any field can also be given
as a flag (``--max_steps 5``). A config directory or a Hub repo id holding ``config.yaml`` works too.
"""

from __future__ import annotations

import sys

from trl import TrlParser

from harts_hf.trainers import HARTSGRPOConfig
from harts_hf.trainers.progress import StepLine
from harts_hf.trainers.recipe import AgenticArguments, build_trainer, resolve_config


def main(argv: list[str]) -> None:
    if "--config" in argv:  # accept a config directory or Hub repo id as well as a YAML file
        i = argv.index("--config") + 1
        argv[i] = str(resolve_config(argv[i]))
    script_args, training_args = TrlParser((AgenticArguments, HARTSGRPOConfig)).parse_args_and_config(argv)
    trainer = build_trainer(script_args, training_args, callbacks=[StepLine()])
    trainer.train()
    trainer.save_model(training_args.output_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
