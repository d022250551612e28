"""The engine's step on one chain several times the budget, on 2+ processes (gloo, one CPU thread
each): serial (its pieces in successive slots on rank 0, the other ranks idle: what a plan does
today) vs context-parallel (the same pieces, the ranks taking turns in each slot: spans of one
slot on several ranks, streamed layer by layer, ``harts_hf.engine.stream``). Prints each mode's
step (best of ``--repeat``; wall and CPU seconds of the slowest rank) and the bytes the ranks sent,
and checks that both modes give the same log-probs. On a shared machine the wall times depend on
the other processes' load (printed, with the time a rank waited for a CPU): the CP step needs a
core per process.

    torchrun --nproc_per_node 2 scripts/cp_chain.py                       # qwen3_5, 8 layers, 4 x 256 tokens
    torchrun --nproc_per_node 2 scripts/cp_chain.py --budget 128 --pieces 4 --groups 3
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from cross_rank_worker import piece_plan

from harts_hf import RolloutForest, patch_model
from harts_hf.engine import TreeEngine
from harts_hf.lab.models import SIZES, build_model


def queued() -> float:
    """Seconds the main thread has waited for a CPU (Linux schedstat; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def step(engine: TreeEngine, weights: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    """([wall s, CPU s, s waiting for a CPU], log-probs) of one engine step (record, loss, replay)
    on this rank."""
    seen = []

    def loss(lps: list[torch.Tensor]) -> torch.Tensor:
        seen.append(lps[0].detach())
        return (lps[0] * weights).sum()

    dist.barrier()
    start = (time.perf_counter(), time.process_time(), queued())
    engine.backward(loss)
    return [end - begin for end, begin in zip((time.perf_counter(), time.process_time(), queued()), start)], seen[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_5")
    parser.add_argument("--groups", type=int, default=2, help="layer groups of 4 (2: 8 layers)")
    parser.add_argument("--budget", type=int, default=256, help="tokens per piece")
    parser.add_argument("--pieces", type=int, default=4, help="the chain's length in budgets")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    size = dataclasses.replace(SIZES["default"], groups=args.groups)
    model = patch_model(build_model(args.family, size).model)
    n = args.budget * args.pieces
    chain = np.random.default_rng(0).integers(3, size.vocab, n).tolist()
    forest = RolloutForest.from_sequences([chain])
    weights = torch.as_tensor(np.random.default_rng(1).standard_normal((1, n - 1)), dtype=torch.float32)
    cut = [(i * args.budget, (i + 1) * args.budget) for i in range(args.pieces)]
    plans = {
        "serial": [(0, i, a, b) for i, (a, b) in enumerate(cut)],
        "cp": [(i % world, i // world, a, b) for i, (a, b) in enumerate(cut)],
    }
    results = {}
    for mode, pieces in plans.items():
        engine = TreeEngine(model, forest, piece_plan(forest, pieces, world, budget=args.budget), rank=rank)
        best = None
        for _ in range(args.repeat):
            model.zero_grad(set_to_none=True)
            times, lp = step(engine, weights)
            times = torch.tensor(times)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            best = times if best is None or times[0] < best[0] else best
        sent = torch.tensor([float(engine.exchanged_bytes[k]) / args.repeat for k in ("values", "grads")])
        dist.all_reduce(sent)
        owned = torch.where(engine.owned[0][:, None], lp, 0.0)
        dist.all_reduce(owned)
        results[mode] = (best, sent, owned)
    if rank == 0:
        print(
            f"{args.family}, {size.layers} layers, hidden {size.hidden}; a {n}-token chain = {args.pieces} pieces of "
            f"{args.budget} tokens; {world} processes (gloo, 1 thread each); best of {args.repeat}; load average "
            f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
        )
        for mode, (best, sent, _) in results.items():
            print(
                f"  {mode:7s} step {best[0]:.2f} s wall, {best[1]:.2f} s CPU, {best[2]:.2f} s waiting for a CPU "
                f"(the most of any rank); sent "
                f"{sent[0] / 1e6:.2f} MB values + {sent[1] / 1e6:.2f} MB gradients per step"
            )
        speedup = float(results["serial"][0][0] / results["cp"][0][0])
        diff = float((results["serial"][2] - results["cp"][2]).abs().max())
        print(f"  speedup (wall) {speedup:.2f}x; max |log-prob serial - cp| {diff:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
