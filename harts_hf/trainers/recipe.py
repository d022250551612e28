"""The agentic GRPO recipe shared by ``harts-hf train`` and ``recipes/grpo_agentic.py``.

A recipe is one YAML file in TRL's conventions: :class:`HARTSGRPOConfig` fields plus the
:class:`AgenticArguments` below, read with ``TrlParser`` (``--config``). A config may be a file, a
directory holding ``config.yaml`` (the Hub-publishable layout: ``config.yaml`` + a model-card
``README.md``), or a Hub repo id with that layout.

A recipe is checked before any work (:func:`check_config`, :func:`check_arguments`,
:func:`check_recipe`): every mistake is a one-line error that names the fix, never a traceback
from deep in TRL or the Hub client.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from difflib import get_close_matches
from pathlib import Path

import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..checks import require_positive_ints
from ..envs import LedgerRunner, build_tokenizer, ledger_dataset, ledger_rollout, sample_reward
from .config import HARTSGRPOConfig
from .console import quiet_console
from .grpo import HARTSGRPOTrainer
from .progress import StepLine

__all__ = [
    "BUILTIN_PREFIX",
    "DEFAULT_RECIPE",
    "RECIPE_KEYS",
    "AgenticArguments",
    "build_trainer",
    "check_arguments",
    "check_config",
    "check_recipe",
    "load_model",
    "parse_recipe",
    "resolve_config",
]

BUILTIN_PREFIX = "builtin:"

DEFAULT_RECIPE: dict = {
    "model_name_or_path": "builtin:qwen3_5-quick",
    "env_mode": "per_turn",
    "max_turns": 3,
    "episodes_per_task": 4,
    "num_generations": 12,
    "per_device_train_batch_size": 24,
    "max_steps": 12,
    "learning_rate": 3e-4,
    "loss_type": "dapo",
    "beta": 0.0,
    "temperature": 1.0,
    "max_completion_length": 96,
    "use_cpu": True,
    "bf16": False,
    "gradient_checkpointing": False,
    "logging_steps": 1,
    "report_to": "none",
    "save_strategy": "no",
    "seed": 0,
    "output_dir": "outputs/qwen3_5-quick-agentic",
}
"""The embedded default run (``harts-hf train`` without ``--config``); recipes/configs/qwen3_5_quick_agentic
holds the same values as a Hub-publishable config."""


@dataclass
class AgenticArguments:
    """What the recipe trains on: the model and the built-in tool environment's episodes."""

    model_name_or_path: str = field(
        default="builtin:qwen3_5-quick",
        metadata={
            "help": "Hub id or local path of a causal LM, or builtin:FAMILY-SIZE for a freshly initialised "
            "model of harts_hf.bench.models (e.g. builtin:qwen3_5-quick, a tiny Qwen3.5-style hybrid)."
        },
    )
    seed_model: int = field(default=0, metadata={"help": "Initialisation seed of builtin: models."})
    env_mode: str = field(default="per_turn", metadata={"help": "per_turn (one sample per turn) or episode."})
    max_turns: int = field(default=3, metadata={"help": "Tool calls per episode."})
    episodes_per_task: int = field(default=4, metadata={"help": "Episodes per task (the GRPO group)."})
    num_tasks: int = field(default=256, metadata={"help": "Ledger tasks in the training set."})
    reasoning_tokens: int = field(default=16, metadata={"help": "Reasoning tokens generated per turn."})
    action_tokens: int = field(default=10, metadata={"help": "Tool-call tokens generated per turn."})
    verbose: bool = field(
        default=False,
        metadata={"help": "Also print TRL's full metrics dict every logged step (it always goes to report_to)."},
    )

    def __post_init__(self) -> None:
        require_positive_ints(
            "AgenticArguments",
            max_turns=self.max_turns,
            episodes_per_task=self.episodes_per_task,
            num_tasks=self.num_tasks,
            reasoning_tokens=self.reasoning_tokens,
            action_tokens=self.action_tokens,
        )

    def runner(self) -> LedgerRunner:
        return LedgerRunner(self.max_turns, self.reasoning_tokens, self.action_tokens, self.env_mode)


RECIPE_KEYS: tuple[str, ...] = tuple(sorted(f.name for cls in (AgenticArguments, HARTSGRPOConfig) for f in fields(cls)))
"""Every key a recipe may set: the fields of AgenticArguments and HARTSGRPOConfig."""


def _is_repo_id(ref: str) -> bool:
    """``owner/name`` as the Hub spells it, and no file name: only such a missing path is looked up
    on the Hub, so a mistyped ``nope.yaml`` is reported missing rather than as a bad repo id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if ref.count("/") != 1 or ref.endswith((".yaml", ".yml", ".json")):
        return False
    try:
        validate_repo_id(ref)
    except HFValidationError:
        return False
    return True


def _download_config(repo_id: str) -> Path:
    """``config.yaml`` of Hub repo ``repo_id``. The Hub client's retry warnings are silenced and its
    errors (offline, no such repo or file, gated; several lines each) become one line."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import logging as hub_logging

    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()
    try:
        return Path(hf_hub_download(repo_id=repo_id, filename="config.yaml"))
    except OSError as err:
        raise FileNotFoundError(
            f"--config {repo_id}: no such file or directory, and config.yaml of Hub repo {repo_id} cannot be "
            f"downloaded ({type(err).__name__}); check the path, the repo id and the network"
        ) from err
    finally:
        hub_logging.set_verbosity(verbosity)


def resolve_config(ref: str | Path) -> Path:
    """A YAML file: ``ref`` itself, ``ref/config.yaml``, or ``config.yaml`` of Hub repo ``ref`` (a
    missing path in the ``owner/name`` shape); anything else is a one-line FileNotFoundError."""
    path = Path(ref)
    if path.is_file():
        return path
    if path.is_dir():
        if not (path / "config.yaml").is_file():
            raise FileNotFoundError(f"--config {ref}: a directory without config.yaml")
        return path / "config.yaml"
    if not _is_repo_id(str(ref)):
        raise FileNotFoundError(f"--config {ref}: no such file or directory")
    return _download_config(str(ref))


def _hint(key: str, prefix: str = "") -> str:
    """The fix for an unknown key: the closest recipe key, else where the valid ones are."""
    close = get_close_matches(key, RECIPE_KEYS, n=1)
    return f"did you mean {prefix + close[0]!r}?" if close else "not a field of HARTSGRPOConfig or AgenticArguments"


def _check_keys(keys: Iterable[object], where: str) -> None:
    """Refuse the first key that is no recipe field (TRL names it without a hint)."""
    for key in keys:
        if key not in RECIPE_KEYS:
            raise ValueError(f"unknown key {key!r} in {where} ({_hint(str(key))})")


def check_config(ref: str | Path) -> Path:
    """The YAML file of recipe ``ref`` (:func:`resolve_config`), read before any work: a one-line
    ValueError when it is not YAML, not a mapping, or sets a key that is no recipe field."""
    path = resolve_config(ref)
    try:
        with path.open() as file:
            values = yaml.safe_load(file)
    except yaml.YAMLError as err:
        raise ValueError(f"--config {ref}: not valid YAML ({' '.join(str(err).split())})") from err
    if not isinstance(values, dict):
        message = f"--config {ref}: must be a mapping of recipe keys, got {type(values).__name__}"
        raise ValueError(message)  # noqa: TRY004  a file's content, not an argument of the wrong type
    _check_keys((key for key in values if key != "env"), str(ref))  # env: TrlParser's environment variables
    return path


def check_arguments(unused: Sequence[str]) -> None:
    """Refuse the command-line strings ``TrlParser`` left unused (``return_remaining_strings=True``),
    the first one named with the closest recipe flag."""
    if unused:
        key = unused[0].lstrip("-").partition("=")[0].replace("-", "_")
        raise ValueError(f"unknown argument {unused[0]!r} ({_hint(key, '--')})")


def check_recipe(args: AgenticArguments, training_args: HARTSGRPOConfig) -> None:
    """Refuse values TRL accepts but this recipe cannot run, before the model is built: no steps
    (TRL would run one at learning rate 0) and a group the environment does not make."""
    if training_args.max_steps == 0 or training_args.max_steps < -1:
        raise ValueError(
            f"max_steps must be a positive number of steps (or -1: train num_train_epochs), got {training_args.max_steps}"
        )
    runner = args.runner()
    group = args.episodes_per_task * runner.samples_per_episode
    if training_args.num_generations != group:
        raise ValueError(
            f"num_generations must be episodes_per_task x samples per episode = {group} "
            f"({args.episodes_per_task} x {runner.samples_per_episode}), got {training_args.num_generations}"
        )


def parse_recipe(values: dict) -> tuple[AgenticArguments, HARTSGRPOConfig]:
    """(environment/model arguments, trainer config) from one flat dict of recipe values, checked
    by :func:`check_recipe`."""
    from transformers import HfArgumentParser

    args, training_args = HfArgumentParser((AgenticArguments, HARTSGRPOConfig)).parse_dict(values)
    check_recipe(args, training_args)
    return args, training_args


def load_model(args: AgenticArguments) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (training mode) and its tokenizer (the in-code one for builtin: models and
    checkpoints that ship none)."""
    name = args.model_name_or_path
    if name.startswith(BUILTIN_PREFIX):
        from ..bench.models import build_model

        family, _, size = name[len(BUILTIN_PREFIX) :].rpartition("-")
        return build_model(family, size, seed=args.seed_model).model.train(), build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(name, dtype="auto")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, padding_side="left")
    except (OSError, ValueError):
        tokenizer = build_tokenizer()
    return model.train(), tokenizer


def build_trainer(args: AgenticArguments, training_args: HARTSGRPOConfig) -> HARTSGRPOTrainer:
    """A HARTSGRPOTrainer on the built-in environment (``harts_enable=False``: stock GRPO) whose
    console is :class:`~harts_hf.trainers.progress.StepLine` (TRL's metrics dict too with ``verbose``)."""
    check_recipe(args, training_args)
    model, tokenizer = load_model(args)
    if args.model_name_or_path.startswith(BUILTIN_PREFIX) and training_args.beta != 0:
        # TRL builds the KL reference by reloading the policy from its path: give the in-code model one.
        reference = Path(training_args.output_dir) / "reference-model"
        model.save_pretrained(reference)
        model.config._name_or_path = str(reference)
    trainer = HARTSGRPOTrainer(
        model=model,
        reward_funcs=sample_reward,
        args=training_args,
        train_dataset=ledger_dataset(args.num_tasks),
        processing_class=tokenizer,
        rollout_func=ledger_rollout(args.runner()),
        callbacks=[StepLine(describe(args))],
    )
    return quiet_console(trainer, args.verbose)


def describe(args: AgenticArguments) -> str:
    """The model and data of a run, for its opening line."""
    return (
        f"{args.model_name_or_path} on the built-in ledger tool environment ({args.num_tasks} tasks, "
        f"{args.episodes_per_task} episodes per task, up to {args.max_turns} tool calls, {args.env_mode} samples)"
    )
