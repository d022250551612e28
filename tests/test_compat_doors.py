"""Every private name of transformers and TRL that harts-hf reads resolves in the installed
release (the fla door's names resolve in ``fla_interpreter_cases.py``, where triton is importable):
a name that moves fails here, not in a user's run."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
import transformers
import trl

from harts_hf.modeling import _compat as hf_door
from harts_hf.trainers import _compat as trl_door


@pytest.mark.parametrize("path", hf_door.PRIVATE_NAMES)
def test_every_transformers_name_resolves(path):
    module, _, name = path.rpartition(".")
    try:
        owner = importlib.import_module(module)
    except ModuleNotFoundError:  # a class attribute: transformers.PretrainedConfig._attn_implementation
        owner = getattr(importlib.import_module(module.rpartition(".")[0]), module.rpartition(".")[2])()
    assert hasattr(owner, name), f"{path} is gone from transformers {transformers.__version__}"


@pytest.mark.parametrize(("trainer", "names"), trl_door.TRAINER_ATTRIBUTES.items())
def test_every_trl_attribute_is_still_set(trainer, names):
    cls = getattr(trl, trainer)
    source = "\n".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith(("trl.", "transformers.")))
    missing = [n for n in names if not re.search(rf"self\.{n}\s*(:[^=]*)?=(?!=)", source)]
    assert not missing, f"trl {trl.__version__}'s {trainer} no longer sets {missing}"


def test_the_fused_head_output_and_seams_exist():
    from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head

    assert {"loss", "label_mask", "aux_loss"} <= set(inspect.signature(FusedCausalLMOutput).parameters)
    assert callable(add_fused_lm_head)
    for cls in (trl.GRPOTrainer, trl.RLOOTrainer):
        assert "_buffered_inputs[self._step % " in inspect.getsource(cls._prepare_inputs)
