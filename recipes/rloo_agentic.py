"""HARTS RLOO on one-turn episodes of the built-in tool environment, launched by accelerate.

    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml recipes/rloo_agentic.py \
        --config recipes/configs/qwen3_5_quick_rloo/config.yaml

``--config`` is a TRL YAML (HARTSRLOOConfig + LedgerTurnArguments fields); any field can also be given as a flag
(``--max_steps 5``), a config directory or a Hub repo id holding ``config.yaml`` too; mistakes fail in
one line (exit code 2) before the model is built, as in ``grpo_agentic.py`` (the body is shared:
``harts_hf.app.recipe.launch``).
"""

from __future__ import annotations

import sys

from harts_hf.app.recipe import launch


def main(argv: list[str]) -> None:
    launch("rloo", argv)


if __name__ == "__main__":
    main(sys.argv[1:])
