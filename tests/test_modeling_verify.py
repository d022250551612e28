"""verify(): passes a correctly patched model, catches a wrong tree kernel, and
patch_model(verify=True) refuses (and unpatches) a model that fails it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model

from harts_hf.modeling import UnsupportedModelError, is_patched, kinds, patch_model, verify


def _conv_ignoring_the_tree(x, weight, bias, batch, *, activation=None, context_x=None):
    """A plausible bug: a plain causal conv over the DFS-ordered tokens, ignoring branches."""
    out = F.conv1d(x.t()[None], weight[:, None], bias, padding=weight.shape[1] - 1, groups=x.shape[1])
    out = out[0, :, : x.shape[0]].t()
    return F.silu(out) if activation == "silu" else out


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_verify_passes_a_patched_model(family, capsys):
    model = patch_model(tiny_model(family))
    model.train()
    report = verify(model)
    assert report.ok and report.max_logprob_diff <= 1e-4 and report.max_grad > 0
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    assert "ok" in capsys.readouterr().out
    assert patch_model(model, verify=True) is model


def test_verify_catches_a_wrong_kernel(monkeypatch):
    model = patch_model(tiny_model("lfm2"))
    monkeypatch.setattr(kinds, "tree_causal_conv1d", _conv_ignoring_the_tree)
    report = verify(model, print_report=False)
    assert not report.ok and report.max_logprob_diff > 1e-2
    fresh = tiny_model("lfm2")
    with pytest.raises(UnsupportedModelError, match="failed harts-hf verification"):
        patch_model(fresh, verify=True)
    assert not is_patched(fresh) and fresh.config._attn_implementation == "sdpa"


def test_verify_accepts_a_bf16_model():
    model = patch_model(tiny_model("llama", dtype=torch.bfloat16))
    assert verify(model, print_report=False).ok
