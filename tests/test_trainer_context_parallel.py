"""The trainers with ``harts_context_parallel=True`` under DDP (gloo, CPU): a step whose longest trajectory
is three times the budget, every rank with rows of its own, trains with the long one spread over the other
ranks' free time in context-parallel groups, exactly like the stock trainer under the same launch: GRPO on
2 and 3 processes (over ``test_trainer_ddp``'s worker) and under FSDP2 on 2, RLOO generating on 2 and 3
processes and under FSDP2 on 2 (its old log-probs a no-grad pass over the same kind of plan). Worker:
``trainer_cp_worker.py``."""

from __future__ import annotations

import pytest
import torch
from launch import torchrun
from test_trainer_ddp import TOL
from trainer_cp_worker import CASE


@pytest.mark.slow
@pytest.mark.parametrize(
    "trainer, world", [("grpo", 2), ("grpo", 3), ("grpo-fsdp2", 2), ("rloo", 2), ("rloo", 3), ("rloo-fsdp2", 2)]
)
def test_context_parallel_groups_train_like_stock(tmp_path, trainer, world):
    from tiny_models import tiny_model

    from harts_hf.sources.tokenizer import build_tokenizer

    tiny_model("qwen3_5").save_pretrained(tmp_path / "qwen3_5")
    build_tokenizer().save_pretrained(tmp_path / "qwen3_5")
    torchrun("trainer_cp_worker.py", world, str(tmp_path), trainer)
    plans = [torch.load(tmp_path / f"groups-{r}.pt") for r in range(world)]
    assert all(p == plans[0] for p in plans)  # every rank the same plans
    assert plans[0] and all(groups > 0 and ranks >= 2 and all(busy) for groups, ranks, busy, _ in plans[0])
    name = CASE if trainer.startswith("grpo") else "rloo"
    stock, harts = (torch.load(tmp_path / f"{run}-{name}.pt") for run in ("stock", "harts"))
    assert len(stock["params"]) == len(harts["params"]) == 3  # the start, then after each of the 2 steps
    assert (stock["params"][-1] - stock["params"][0]).abs().max() > 1e-3  # the steps moved the weights
    for step, (a, b) in enumerate(zip(stock["params"], harts["params"])):
        assert (a - b).abs().max().item() < TOL, f"step {step} differs by {(a - b).abs().max().item()}"
    assert harts["ranks_agree"] and stock["ranks_agree"]
    assert trainer.startswith("rloo") or harts["rows"] == stock["rows"]  # TRL's loss saw stock's microbatches
