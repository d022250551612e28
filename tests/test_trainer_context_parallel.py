"""HARTSGRPOTrainer with ``harts_context_parallel=True`` under DDP (2 and 3 processes, gloo, CPU): a step
whose longest trajectory is three times the budget, every rank with rows of its own, trains with the
long one spread over the other ranks' free time in context-parallel groups, exactly like stock GRPO under
the same launch (``trainer_cp_worker.py`` over ``test_trainer_ddp``'s worker)."""

from __future__ import annotations

import pytest
import torch
from launch import torchrun
from test_trainer_ddp import TOL
from trainer_cp_worker import CASE


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_groups_train_like_stock(tmp_path, world):
    from tiny_models import tiny_model

    from harts_hf.sources.tokenizer import build_tokenizer

    tiny_model("qwen3_5").save_pretrained(tmp_path / "qwen3_5")
    build_tokenizer().save_pretrained(tmp_path / "qwen3_5")
    torchrun("trainer_cp_worker.py", world, str(tmp_path))
    groups = [torch.load(tmp_path / f"groups-{r}.pt") for r in range(world)]
    assert all(g == groups[0] for g in groups)  # every rank the same plans
    assert groups[0] and all(count > 0 and ranks >= 2 and all(busy) for count, ranks, busy in groups[0])
    stock, harts = (torch.load(tmp_path / f"{name}-{CASE}.pt") for name in ("stock", "harts"))
    assert (stock["params"][-1] - stock["params"][0]).abs().max() > 1e-3  # the steps moved the weights
    for step, (a, b) in enumerate(zip(stock["params"], harts["params"])):
        assert (a - b).abs().max().item() < TOL, f"step {step} differs by {(a - b).abs().max().item()}"
    assert harts["ranks_agree"] and harts["rows"] == stock["rows"]
