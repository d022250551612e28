"""FSDP2 on CPU (gloo), 2 processes: a HARTS step's gradients == the stock computation's, exactly.

The trainer's HARTS step (``harts_hf.trainers.step.HARTSStep``) all-gathers every rank's rows into
one forest, plans it over the ranks and their slots, records every unit without grad, sums the
log-probs over the ranks, lets TRL's per-microbatch losses read them, and then backpropagates every
unit of its rank through the wrapper being trained, with gradient sync off (accelerate's
``no_sync``) in every backward pass but the last. This test runs that step on a model sharded with
FSDP2 (``torch.distributed.fsdp.fully_shard`` on every decoder layer and on the model) and proves:

* every row's log-probs (``step.logprobs``, summed over the ranks) equal the unpatched model's own
  forward over each row alone;
* the full gradients (``p.grad.full_tensor()`` of the sharded parameters) equal the stock
  data-parallel gradient: the per-token-weighted log-prob losses of every rank's microbatches,
  backpropagated through the unsharded, unpatched model row by row, averaged over the ranks (FSDP2
  reduce-scatters with averaging);
* with several units on a rank, every backward pass but the last ran with FSDP2 gradient sync off
  (``set_requires_gradient_sync(False)``, then back on) and left no sharded parameter a gradient
  (no reduce-scatter before the last pass), and a one-unit plan never turns sync off; the
  recording's last call, which keeps its graph for the first backward pass, runs its forward in
  that pass's ``no_sync``;

once under a budget every rank's share fits in one slot, once under one just above the longest
trajectory (several slots per rank, trees cut into pieces joined by handoffs), once under one that
gives the ranks 3 and 4 units (the rank with fewer pads its model calls: FSDP2 gathers in each). The rows of both
ranks share one long system prompt (one tree that the plan divides between the ranks), have
prompts of different lengths (TRL's left padding) and completions of different lengths (right
padding), and cross the 64-token chunk of the gated-delta layers.

Why FSDP2 is driven directly: accelerate's FSDP plugin does not shard on CPU, so the trainer cannot
be run under FSDP2 here. The worker shards the model itself, as accelerate does on GPU, and makes
``Accelerator.is_fsdp2`` true so that ``accelerator.no_sync(model)`` takes its FSDP2 branch
(``model.set_requires_gradient_sync``); of the accelerator calls the step makes (``unwrap_model``,
``reduce``, ``autocast``, ``no_sync``) only ``no_sync`` reads ``is_fsdp2``, and ``unwrap_model``
returns the FSDP2 module itself (``fully_shard`` shards in place, there is no wrapper to remove).

The test starts ``torchrun --nproc_per_node 2`` on this file; each worker saves its results.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from launch import torchrun

TOL = 1e-5
WORLD = 2
MICROBATCHES = 2  # per rank
ROWS = 4  # per microbatch
SYSTEM = 40  # tokens of the system prompt every row starts with
BUDGETS = {"fits": 4096, "slots": None, "uneven": 100}  # None: the longest trajectory + 2; 100: 3 and 4 units


def _seg(rng: np.random.Generator, n: int) -> list[int]:
    from tiny_models import VOCAB

    return rng.integers(3, VOCAB, size=n).tolist()


def rank_rows(rank: int) -> list[list[tuple[list[int], list[int]]]]:
    """Rank ``rank``'s microbatches: per microbatch, its rows (prompt ids, completion ids). Every
    prompt starts with the one system prompt; each microbatch holds two questions of different
    lengths with two completions each, completions of different lengths (one may extend the
    other's start: a branch inside the completions)."""
    system = _seg(np.random.default_rng(1234), SYSTEM)
    rng = np.random.default_rng(100 + rank)
    out = []
    for _ in range(MICROBATCHES):
        rows = []
        for _ in range(ROWS // 2):
            prompt = system + _seg(rng, int(rng.integers(2, 12)))
            first = _seg(rng, int(rng.integers(1, 28)))
            second = first[: int(rng.integers(0, len(first) + 1))] + _seg(rng, int(rng.integers(1, 20)))
            rows += [(prompt, first), (prompt, second)]
        out.append(rows)
    return out


def trl_batch(rows: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """TRL's microbatch layout: prompts left-padded, completions right-padded, pad id 0."""
    width_p = max(len(p) for p, _ in rows)
    width_c = max(len(c) for _, c in rows)
    widths = {"prompt_ids": width_p, "prompt_mask": width_p, "completion_ids": width_c, "completion_mask": width_c}
    batch = {key: torch.zeros(len(rows), width, dtype=torch.long) for key, width in widths.items()}
    for i, (p, c) in enumerate(rows):
        batch["prompt_ids"][i, width_p - len(p) :] = torch.tensor(p)
        batch["prompt_mask"][i, width_p - len(p) :] = 1
        batch["completion_ids"][i, : len(c)] = torch.tensor(c)
        batch["completion_mask"][i, : len(c)] = 1
    return batch


def loss_weights(rank: int, j: int, shape: tuple[int, int]) -> torch.Tensor:
    """[b, C] fixed random per-token weights of rank ``rank``'s microbatch ``j`` (dL/dlogp)."""
    return torch.rand(*shape, generator=torch.Generator().manual_seed(1000 * rank + j)) - 0.5


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2")
    torchrun(__file__, WORLD, str(out), timeout=600)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_fsdp2_step_matches_stock(budget, fsdp2_run):
    ranks = [torch.load(fsdp2_run / f"rank{r}.pt") for r in range(WORLD)]
    oracle = ranks[0]["oracle"]
    for rank, record in enumerate(ranks):
        got = record["cases"][budget]
        if budget == "slots":
            assert got["num_slots"] >= 2
        # every row's log-probs, on every rank (summed over the ranks)
        lp_diff = (got["logprobs"] - oracle["logprobs"]).abs().max().item()
        assert lp_diff < TOL, f"rank {rank}: log-probs differ by {lp_diff}"
        # the full gradients: the stock gradient averaged over the ranks
        assert got["grads"].keys() == oracle["grads"].keys()
        scale = max(g.abs().max().item() for g in oracle["grads"].values())
        assert scale > 1e-3  # the losses reach the weights
        diff = max((got["grads"][k] - g).abs().max().item() for k, g in oracle["grads"].items())
        assert diff / scale < TOL, f"rank {rank}: gradients differ by {diff / scale} (relative)"
        # gradient sync off in every backward pass but the last one; as many passes on every rank
        units, calls = got["calls"], got["sync_calls"]
        assert calls == [False, True] * (units - 1), (units, calls)
        assert len(got["unsynced"]) == units - 1 and all(got["unsynced"])  # only the last pass reduced
        # the last call of the recording keeps its graph: its forward runs in the no_sync of the first
        # backward pass (its own), unless it is the rank's only call
        assert got["record_sync_calls"] == ([False, True] if units > 1 else []), got["record_sync_calls"]
        if budget == "slots":
            assert units >= 2 and False in calls
    if budget == "uneven":  # a rank with fewer units pads its model calls (FSDP2 gathers in each)
        assert sorted(r["cases"][budget]["units"] for r in ranks) == [3, 4]
        assert [r["cases"][budget]["calls"] for r in ranks] == [4, 4]
    if budget == "fits":
        assert max(r["cases"]["fits"]["units"] for r in ranks) == 1  # one slot per rank: one backward pass
    assert all(r["cases"][budget]["plan_ranks"] == WORLD for r in ranks)  # the plan used both ranks


def _full(grad: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if grad is None:
        return torch.zeros(param.shape)
    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()


def _worker(out: Path) -> None:
    import types

    import accelerate
    from tiny_models import tiny_model, trajectory_logprobs
    from torch.distributed.fsdp import fully_shard

    import harts_hf
    from harts_hf.trainers._compat import add_tree_forward
    from harts_hf.trainers.step import HARTSStep

    torch.set_num_threads(1)
    began = time.perf_counter()
    acc = accelerate.Accelerator(cpu=True)
    assert acc.num_processes == WORLD and not acc.is_fsdp2
    # accelerate's FSDP plugin does not shard on CPU: shard here, and let no_sync take its FSDP2
    # branch (the only one of the step's accelerator calls that reads is_fsdp2)
    type(acc).is_fsdp2 = property(lambda self: True)
    rank = acc.process_index

    oracle = tiny_model("qwen3_5", seed=0)  # unpatched, unsharded
    model = tiny_model("qwen3_5", seed=0)
    harts_hf.patch_model(model)
    add_tree_forward(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert acc.unwrap_model(model) is model  # FSDP2 shards in place: nothing to unwrap

    sync_calls: list[bool] = []  # set_requires_gradient_sync's arguments, in order
    unsynced: list[bool] = []  # per no_sync exit: no sharded parameter holds a gradient yet
    set_sync = model.set_requires_gradient_sync

    def recording_sync(requires_gradient_sync: bool, *args, **kwargs):
        sync_calls.append(bool(requires_gradient_sync))
        if requires_gradient_sync:  # leaving no_sync: no reduce-scatter has filled a sharded grad yet
            unsynced.append(all(p.grad is None for p in model.parameters()))
        return set_sync(requires_gradient_sync, *args, **kwargs)

    model.set_requires_gradient_sync = recording_sync

    everyone = [rank_rows(r) for r in range(WORLD)]  # every rank's rows, regenerated on each rank
    seqs = [p + c for rows in everyone for mb in rows for p, c in mb]  # rank-major, microbatch, row
    longest = max(len(s) for s in seqs)
    batches = [trl_batch(mb) for mb in everyone[rank]]
    trainer = types.SimpleNamespace(accelerator=acc, temperature=1.0)

    cases = {}
    for name, budget in BUDGETS.items():
        model.zero_grad(set_to_none=True)
        sync_calls.clear()
        unsynced.clear()
        options = {"max_tokens_per_microbatch": budget or longest + 2, "cost_model": None, "chunk_size": 64}
        step = HARTSStep(trainer, model, batches, options)  # with grad: a loss pass
        record_sync_calls = list(sync_calls)  # the recording pass runs no backward but the kept call's forward
        sync_calls.clear()
        unsynced.clear()
        for j, batch in enumerate(batches):
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            width = batch["completion_ids"].size(1)
            lp, _ = step.values(j, mask, width)  # [b, C]
            weights = loss_weights(rank, j, tuple(lp.shape))
            loss = (lp * weights * batch["completion_mask"]).sum() / len(batches)
            loss.backward()
        step.backward()
        cases[name] = {
            "logprobs": step.logprobs.detach().clone(),
            "grads": {k: _full(p.grad, p) for k, p in model.named_parameters()},
            "units": len(step.engine.units),
            "calls": step.engine.calls,
            "num_slots": int(step.plan.num_slots),
            "plan_ranks": len({int(r) for r in np.asarray(step.plan.traj_rank[0]).ravel()}),
            "sync_calls": list(sync_calls),
            "record_sync_calls": record_sync_calls,
            "unsynced": list(unsynced),
        }

    # the oracle: every rank's losses on the unpatched model, row by row; FSDP2 averages over ranks
    rows = trajectory_logprobs(oracle, seqs)
    total, i = 0.0, 0
    for r, rank_mbs in enumerate(everyone):
        for j, mb in enumerate(rank_mbs):
            batch = trl_batch(mb)
            weights = loss_weights(r, j, tuple(batch["completion_ids"].shape))
            for b, (p, c) in enumerate(mb):
                lp = rows[i][0][len(p) - 1 :]  # [len(c)]: the completion's tokens
                total = total + (lp * weights[b, : len(c)]).sum() / MICROBATCHES
                i += 1
    params = dict(oracle.named_parameters())
    grads = torch.autograd.grad(total, list(params.values()), allow_unused=True)
    expected = {
        k: (torch.zeros_like(p) if g is None else g.detach()) / WORLD for (k, p), g in zip(params.items(), grads)
    }
    width = longest - 1
    logprobs = torch.stack([torch.nn.functional.pad(lp.detach(), (0, width - lp.numel())) for lp, _ in rows])
    torch.save(
        {"cases": cases, "oracle": {"logprobs": logprobs, "grads": expected}, "seconds": time.perf_counter() - began},
        out / f"rank{rank}.pt",
    )


if __name__ == "__main__":
    from harts_hf.trainers.teardown import end_distributed

    _worker(Path(sys.argv[1]))
    end_distributed()  # gloo's threads abort the exit ("terminate called ...") otherwise
