"""harts-hf bench: the --quick run's JSON and numerics, the analytic FLOP count against torch's
FLOP counter, the policy loss, the modes' agreement, peak memory and configuration errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from harts_hf import RolloutForest
from harts_hf.app.cli import main
from harts_hf.lab import (
    BENCH_FAMILIES,
    FlopModel,
    build_model,
    compact_work,
    default_config,
    ideal_speedup,
    trajectory_work,
)
from harts_hf.lab.loss import grpo_advantages, policy_loss
from harts_hf.lab.memory import PeakMemory
from harts_hf.lab.modes import (
    Batch,
    StockMode,
    TreeMode,
    stock_rows,
    trajectory_logprobs,
)
from harts_hf.modeling import ADAPTERS
from harts_hf.sources import get_workload

ISSUE_FIELDS = {
    "workload": {"name", "trajectories", "trajectory_tokens", "compact_tokens", "compression", "height", "rounds"},
    "model": {"family", "layers", "hidden", "params"},
    "ideal_speedup": None,
    "speedup": {"forward", "backward", "step"},
    "speedup_vs_stock": {"forward", "backward", "step"},
    "efficiency": None,
    "peak_memory_mb": {"stock", "unshared", "harts"},
    "numerics": {"max_abs_logprob_diff", "stock_self_diff", "grad_cosine"},
}


@pytest.mark.slow
def test_quick_bench_writes_the_issue_fields_and_exact_numerics(tmp_path, capsys):
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--quick", "--json", str(json_path), "--plot", str(png_path)]) == 0
    assert "speedup vs unshared" in capsys.readouterr().out
    record = json.loads(json_path.read_text())
    for key, sub in ISSUE_FIELDS.items():
        assert key in record
        if sub is not None:
            assert sub <= set(record[key]), f"{key} lacks {sub - set(record[key])}"
    w = record["workload"]
    assert w["compression"] == pytest.approx(w["trajectory_tokens"] / w["compact_tokens"])
    assert w["rounds"] >= 2 and w["height"] >= 2  # a real tree: branches hand states across rounds
    assert record["efficiency"] == pytest.approx(record["speedup_vs_stock"]["step"] / record["ideal_speedup"])
    assert 1 < record["ideal_speedup"] <= w["compression"] * 1.001
    num = record["numerics"]
    assert num["max_abs_logprob_diff"] <= max(num["stock_self_diff"], 1e-5)
    assert num["grad_cosine"] >= 0.99999
    assert num["unshared_grad_cosine"] >= 0.99999
    assert all(v is None or v > 0 for v in record["peak_memory_mb"].values())
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- FLOP count
def test_dense_flops_equal_torch_flop_counter_on_one_token():
    """One token attends one key: the count is token-wise work + one pair (eager attention,
    whose matmuls the counter sees)."""
    bench = build_model("llama", "tiny", attn="eager")
    flops = FlopModel.of(bench.model, bench.arch)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        bench.model(input_ids=torch.tensor([[5]]), use_cache=False)
    assert flops.token + flops.pair == counter.get_total_flops()


@pytest.mark.parametrize("family", ["qwen3_5_moe", "kimi_linear", "nemotron_h"])
def test_moe_block_flops_count_top_k_experts(family):
    bench = build_model(family, "tiny")
    bench.model.set_experts_implementation("eager")  # plain matmuls the counter sees
    block = next(m for m in bench.model.modules() if type(m).__name__.endswith(("SparseMoeBlock", "MoE")))
    flops = FlopModel.of(block, bench.arch)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        block(torch.randn(1, 1, bench.model.config.hidden_size))
    assert flops.token == counter.get_total_flops()


@pytest.mark.parametrize("family", sorted(BENCH_FAMILIES))
def test_arch_layer_counts_match_the_modules(family):
    """The FLOP count's layer counts agree with the mixers and attention modules the family's
    adapter declares (conv-only mixers are token-wise work, not linear attention; a re-stated
    mixer forward, such as Mamba v1's, is one whose kind is a ``*_mixer``)."""
    bench = build_model(family, "tiny")
    adapter = ADAPTERS[family]
    mixers = {*adapter.mixers, *(name for name, kind in adapter.mixer_forwards.items() if kind.endswith("_mixer"))}
    names = [type(m).__name__ for m in bench.model.modules()]
    assert bench.arch.attention_layers == sum(n in adapter.attention for n in names)
    if bench.arch.linear_kind is not None:
        assert bench.arch.linear_layers == sum(n in mixers for n in names) > 0


def test_work_counts_by_hand():
    forest = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4, 5]])
    assert vars(trajectory_work(forest)) == {"tokens": 7, "pairs": 3 * 4 // 2 + 4 * 5 // 2}
    assert vars(compact_work(forest)) == {"tokens": 5, "pairs": 1 + 2 + 3 + 3 + 4}  # depths 0, 1, 2, 2, 3


def test_ideal_speedup_of_identical_trajectories_is_their_number():
    bench = build_model("qwen3_5", "tiny")
    forest = RolloutForest.from_sequences([[7, 8, 9, 10, 11]] * 6)
    assert ideal_speedup(FlopModel.of(bench.model, bench.arch), forest) == pytest.approx(6.0)


# ---------------------------------------------------------------- loss and modes
def test_grpo_advantages_by_hand_and_fallback():
    adv = grpo_advantages(np.array([1.0, 0.0, 1.0, 1.0]), np.array([0, 0, 1, 1]), eps=1e-4)
    np.testing.assert_allclose(adv, [0.5 / 0.5001, -0.5 / 0.5001, 0.0, 0.0])  # group 0: mean 0.5, std 0.5
    flat = grpo_advantages(np.ones(4), np.zeros(4, dtype=np.int64))
    assert np.all(flat != 0) and flat.sum() == pytest.approx(0.0)


def test_policy_loss_splits_over_microbatches(rng):
    lp = torch.tensor(rng.normal(size=(6, 9)), requires_grad=True)
    adv = torch.tensor(rng.normal(size=6))
    mask = torch.tensor(rng.random((6, 9)) < 0.6)
    count = int(mask.sum())
    whole = policy_loss(lp, adv, mask, count)
    parts = sum(policy_loss(lp[s], adv[s], mask[s], count) for s in (slice(0, 2), slice(2, 6)))
    torch.testing.assert_close(parts, whole)
    (grad,) = torch.autograd.grad(whole, lp)
    torch.testing.assert_close(grad, torch.where(mask, -adv[:, None] / count, 0.0))


def test_stock_rows_is_a_power_of_two_that_fits():
    assert stock_rows(232, 175, 4096) == 16
    assert stock_rows(10, 175, 1 << 20) == 10
    assert stock_rows(232, 5000, 4096) == 1


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_modes_agree_with_the_stock_model(family):
    """Stock microbatches, unshared and harts (in one call, and in pieces under a budget below the
    forest) give the trajectory-wise log-probs and the same parameter gradients on a caterpillar
    (the agentic shape)."""
    bench = build_model(family, "tiny")
    model = bench.model
    work = get_workload("caterpillar", turns=5, trunk_len=[40, 30, 1, 70, 9], leaf_len=[3, 64, 1, 5, 20], vocab=128)
    forest = work.forest()
    batch = Batch(forest, grpo_advantages(np.arange(5.0), np.zeros(5, dtype=np.int64)))
    unshared = RolloutForest.from_sequences(work.sequences, work.loss_masks, share_prefixes=False)
    cpu = torch.device("cpu")
    results, grads = {}, {}
    for mode in (
        StockMode(batch, cpu, rows=2),
        TreeMode("unshared", batch, unshared, cpu),
        TreeMode("harts", batch, forest, cpu),
        pieces := TreeMode("harts in pieces", batch, forest, cpu, max_tokens=forest.num_compact_tokens // 3),
    ):
        model.zero_grad(set_to_none=True)
        results[mode.name] = mode.step(model).logprobs
        grads[mode.name] = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    assert pieces.plan.num_slots >= 3
    single = trajectory_logprobs(model, forest, cpu)
    for name, logprobs in results.items():
        torch.testing.assert_close(logprobs, single, atol=2e-5, rtol=0)
        torch.testing.assert_close(grads[name], grads["stock"], atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- memory and configuration
def test_peak_memory_is_the_allocators_peak_above_entry():
    """Live tensor bytes at the highest point, not counting what was held before: 256 MiB freed before
    64 MiB are allocated peaks at 256 MiB (the 64 kept from before entry do not count; whatever else
    torch allocates meanwhile, a few MiB at most)."""
    held = torch.ones(16 << 20)
    with PeakMemory(torch.device("cpu")) as meter:
        big = torch.ones(64 << 20)
        del big
        small = torch.ones(16 << 20)
    assert 256 << 20 <= meter.peak_bytes < 272 << 20 and meter.slows
    del held, small


@pytest.mark.parametrize(
    "overrides, message",
    [
        pytest.param({"model": "gpt2"}, "choose one of bailing_hybrid", id="unknown-model"),
        pytest.param({"reps": 2}, "median of at least 3", id="too-few-reps"),
        pytest.param({"workload": "caterpillar", "scale": 0.1}, "takes no scale", id="scale-of-a-shape"),
        pytest.param({"dtype": "fp16"}, "dtype must be one of", id="unknown-dtype"),
    ],
)
def test_config_refuses(overrides, message):
    with pytest.raises(ValueError, match=message):
        default_config(**overrides)


def test_cli_refuses_an_unknown_model(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", "gpt2"])
    assert exit_info.value.code == 2 and "harts-hf bench: error: unknown model 'gpt2'" in capsys.readouterr().err


def test_presets():
    default, quick = default_config(), default_config(quick=True)
    assert default.size == "default" and quick.size == "quick"
    assert default.workload_arguments()["scale"] > quick.workload_arguments()["scale"]
    assert default_config(workload="caterpillar").workload_arguments() == {"seed": 0, "vocab": 8192}
