"""HARTSGRPOTrainer with ``harts_handoffs=True`` under DDP (2 processes, gloo, CPU): plans that hand
the step's shared prompts between ranks (``harts_hf.planner.handoffs``) train exactly like stock
GRPO under the same launch (``trainer_handoff_worker.py`` over ``test_trainer_ddp``'s worker)."""

from __future__ import annotations

import pytest
import torch
from launch import torchrun
from test_trainer_ddp import TOL
from trainer_handoff_worker import CASE


@pytest.mark.slow
def test_handoff_plans_train_like_stock(tmp_path):
    from tiny_models import tiny_model

    from harts_hf.sources.tokenizer import build_tokenizer

    tiny_model("qwen3_5").save_pretrained(tmp_path / "qwen3_5")
    build_tokenizer().save_pretrained(tmp_path / "qwen3_5")
    torchrun("trainer_handoff_worker.py", 2, str(tmp_path))
    handoffs = [torch.load(tmp_path / f"handoffs-{r}.pt") for r in range(2)]
    assert handoffs[0] == handoffs[1] and max(handoffs[0]) > 0  # every rank the same plans, handing over
    stock, harts = (torch.load(tmp_path / f"{name}-{CASE}.pt") for name in ("stock", "harts"))
    assert (stock["params"][-1] - stock["params"][0]).abs().max() > 1e-3  # the steps moved the weights
    for step, (a, b) in enumerate(zip(stock["params"], harts["params"])):
        assert (a - b).abs().max().item() < TOL, f"step {step} differs by {(a - b).abs().max().item()}"
    assert harts["ranks_agree"] and harts["rows"] == stock["rows"]
