"""``harts_hf.engine.memory.memory_breakdown``: attention's K/V bytes per context row against a count
from the config alone (K and V x kv heads x head dim x element size x attention layers).

The tests' tiny qwen3_5 (``tiny_model``: head dim 16, 1 attention layer) keeps 256 bytes a row; the
bench's "tiny" size (``build_model("qwen3_5", "tiny")``: head dim 8, 1 attention layer) 128: two
models, not one model measured two ways."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from harts_hf import patch_model
from harts_hf.engine.memory import memory_breakdown
from harts_hf.lab.models import build_model


def _counted(model: torch.nn.Module) -> int:
    config = getattr(model.config, "text_config", model.config)
    attention = sum(kind == "full_attention" for kind in config.layer_types)
    return 2 * config.num_key_value_heads * config.head_dim * model.dtype.itemsize * attention


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: tiny_model("qwen3_5"), 256),
        (lambda: build_model("qwen3_5", "tiny").model, 128),
        (lambda: tiny_model("qwen3_5", dtype=torch.bfloat16), 128),  # the model's current dtype
    ],
    ids=["tests-tiny", "bench-tiny", "tests-tiny-bf16"],
)
def test_kv_per_context_row_is_counted_from_the_config(build, expected):
    model = build()
    assert _counted(model) == expected
    kinds = {k.kind: k for k in memory_breakdown(patch_model(model))}
    assert kinds["full_attention"].kv == expected and kinds["linear_attention"].kv == 0
