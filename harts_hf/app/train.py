"""``harts-hf train`` and ``harts-hf train-compare``: a recipe's run (GRPO, RLOO, SFT or DPO on
built-in data) and the GRPO run's step-time comparison.

Register with ``add_parser(subparsers)`` from ``harts_hf.app.cli``. Knobs live in the recipe YAML
(``--config``: a file, a config directory or a Hub repo id); any of its keys can also be given as a
flag the way TRL's CLI takes them (``--learning_rate 1e-5``, ``--bf16``, ``--resume_from_checkpoint
true``), after the config, as the recipe scripts do.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["add_parser", "cmd_train", "cmd_train_compare"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``train`` and ``train-compare`` commands."""
    from .recipe import RECIPES

    p = sub.add_parser(
        "train", help="a HARTS recipe on built-in data (default: GRPO of a tiny Qwen3.5, tool environment)"
    )
    p.add_argument(
        "--trainer",
        choices=sorted(RECIPES),
        default="grpo",
        help="grpo or rloo (built-in tool environment), sft or dpo (built-in agent conversations); default grpo",
    )
    _common(p)
    p.add_argument("--stock", action="store_true", help="run TRL's stock trainer instead (harts_enable=False)")
    p.set_defaults(run=cmd_train)
    c = sub.add_parser("train-compare", help="step time of stock GRPOTrainer vs HARTSGRPOTrainer on the same rollouts")
    _common(c)
    c.add_argument("--json", type=Path, metavar="PATH", help="also write the comparison to this JSON file")
    c.set_defaults(run=cmd_train_compare, trainer="grpo")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="YAML|DIR|REPO", help="recipe (default: the embedded tiny run)")
    p.add_argument("--max-steps", type=int, metavar="N", help="override the recipe's max_steps")
    p.add_argument("--output-dir", metavar="DIR", help="override the recipe's output_dir")
    p.add_argument("--verbose", action="store_true", help="also print TRL's full metrics dict every logged step")
    p.set_defaults(trl_flags=[])  # the recipe's keys as TRL flags (--key value), left to _recipe


def _recipe(args: argparse.Namespace, **forced) -> tuple:
    """(data arguments, trainer config) of ``args.trainer``: its embedded default, then ``--config``,
    then the flags and ``forced``; a value the recipe refuses is the command's one-line error."""
    import yaml

    from .recipe import get_recipe, parse_recipe, resolve_config

    try:
        values = dict(get_recipe(args.trainer).defaults)
        if args.config is not None:
            values.update(yaml.safe_load(resolve_config(args.config).read_text()))
        if args.max_steps is not None:
            values["max_steps"] = args.max_steps
        if args.output_dir is not None:
            values["output_dir"] = args.output_dir
        values["verbose"] = values.get("verbose", False) or args.verbose
        values.update(_trl_flags(args.trl_flags, args.trainer))
        return parse_recipe(values | forced, args.trainer)
    except ValueError as err:
        raise SystemExit(f"harts-hf {args.command}: {err}") from err


def _trl_flags(argv: list[str], trainer: str) -> dict[str, str | list[str]]:
    """``--key value``, ``--key=value``, ``--key v1 v2`` (a list field, as TRL's CLI takes it) and a
    bare switch ``--key`` (true) as recipe values (text, typed by ``parse_recipe``); an argument that
    is no recipe key is refused with the closest one."""
    from .recipe import check_arguments, get_recipe

    keys, values, i = get_recipe(trainer).keys, {}, 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        key = flag.removeprefix("--").replace("-", "_")
        if not flag.startswith("--") or key not in keys:
            check_arguments(argv[i:], trainer)
        end = i + 1
        while not eq and end < len(argv) and not argv[end].startswith("--"):
            end += 1
        given = [value] if eq else argv[i + 1 : end]
        values[key] = "true" if not given else given[0] if len(given) == 1 else given
        i = end
    return values


def cmd_train(args: argparse.Namespace) -> int:
    """Train, printing one line per step; save the model to the recipe's output_dir."""
    from .console import quiet_third_party
    from .recipe import train_recipe

    quiet_third_party()
    script_args, training_args = _recipe(args, disable_tqdm=True, **({"harts_enable": False} if args.stock else {}))
    train_recipe(script_args, training_args)
    if training_args.process_index == 0:
        print(f"model saved to {training_args.output_dir}")
    return 0


def cmd_train_compare(args: argparse.Namespace) -> int:
    """Record the environment's rollouts once, replay them to both trainers, print the step times."""
    from ..trainers.teardown import end_distributed
    from .compare import compare, format_comparison
    from .console import quiet_third_party

    quiet_third_party()
    script_args, training_args = _recipe(args, disable_tqdm=True)
    record = compare(script_args, training_args)
    end_distributed()
    if training_args.process_index != 0:  # every rank ran both trainers; the main process reports
        return 0
    print(format_comparison(record))
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
