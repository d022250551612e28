"""HARTS GRPO on the built-in multi-turn tool environment, launched by accelerate.

    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml recipes/grpo_agentic.py \
        --config recipes/configs/qwen3_5_quick_agentic/config.yaml

``--config`` is a TRL YAML (HARTSGRPOConfig + AgenticArguments fields); any field can also be given
as a flag (``--max_steps 5``). A config directory or a Hub repo id holding ``config.yaml`` works too.
A missing config, an unknown key or flag and a value the recipe cannot run fail in one line (exit
code 2) before the model is built. The body is shared by every recipe script
(``harts_hf.app.recipe.launch``).
"""

from __future__ import annotations

import sys

from harts_hf.app.recipe import launch


def main(argv: list[str]) -> None:
    launch("grpo", argv)


if __name__ == "__main__":
    main(sys.argv[1:])
