"""The engine's step on one chain several times the budget, on 2+ processes (gloo, one CPU thread
each): serial (its pieces in successive slots on rank 0, the other ranks idle: what a plan does
without exchange) vs context-parallel (the same pieces, the ranks taking turns in each slot: spans
of one slot on several ranks, streamed layer by layer, ``harts_hf.engine.stream``). With ``--deep
LEVELS`` the forest is a deep chain of branches (``harts_hf.sources.deep_chain``) and the modes are
``plan()``'s plans without and with ``context_parallel`` (the rank-wise plan recomputing the chain
above each rank's leaves vs, where it predicts lower, the DFS cut: ``harts_hf.planner.wavefront``),
under the model's own memory model. Prints each mode's step (best of ``--repeat``; wall and CPU
seconds of the slowest rank) and the bytes the ranks sent, and checks that both modes give the same
log-probs. On a shared machine the wall times depend on the other processes' load (printed, with
the time a rank waited for a CPU): the CP step needs a core per process.

    torchrun --nproc_per_node 2 scripts/cp_chain.py                       # qwen3_5, 8 layers, 4 x 256 tokens
    torchrun --nproc_per_node 2 scripts/cp_chain.py --budget 128 --pieces 4 --groups 3
    torchrun --nproc_per_node 2 scripts/cp_chain.py --deep 320 --budget 128 --groups 1 --cost-model F.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from cross_rank_worker import piece_plan

from harts_hf import RolloutForest, patch_model, plan
from harts_hf.engine import TreeEngine, memory_model
from harts_hf.lab.models import SIZES, build_model
from harts_hf.planner import CostModel
from harts_hf.sources import deep_chain


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
    parser.add_argument("--deep", type=int, metavar="LEVELS", help="a deep chain of LEVELS branches instead")
    parser.add_argument(
        "--cost-model", type=Path, metavar="JSON", help="with --deep: the plans' cost model (harts-hf calibrate --json)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    size = dataclasses.replace(SIZES["default"], groups=args.groups)
    model = patch_model(build_model(args.family, size).model)
    if args.deep:
        forest = deep_chain(args.deep, vocab=size.vocab).forest()
        planned = lambda cp: plan(
            forest,
            world_size=world,
            max_tokens_per_microbatch=args.budget,
            memory_model=memory_model(model),
            cost_model=None if args.cost_model is None else CostModel(**json.loads(args.cost_model.read_text())),
            context_parallel=cp,
            layers=size.layers,
        )
        plans = {"no_cp": planned(False), "cp": planned(True)}
        what = f"a deep chain of {args.deep} branches, {forest.num_compact_tokens} tokens, its longest path"
        what += f" {forest.max_length} ({forest.max_length / args.budget:.1f}x the {args.budget}-token budget)"
    else:
        n = args.budget * args.pieces
        forest = RolloutForest.from_sequences([np.random.default_rng(0).integers(3, size.vocab, n).tolist()])
        cut = [(i * args.budget, (i + 1) * args.budget) for i in range(args.pieces)]
        plans = {
            mode: piece_plan(forest, pieces, world, budget=args.budget)
            for mode, pieces in (
                ("serial", [(0, i, a, b) for i, (a, b) in enumerate(cut)]),
                ("cp", [(i % world, i // world, a, b) for i, (a, b) in enumerate(cut)]),
            )
        }
        what = f"a {n}-token chain = {args.pieces} pieces of {args.budget} tokens"
    shape = (forest.num_trajectories, forest.max_length - 1)
    weights = torch.as_tensor(np.random.default_rng(1).standard_normal(shape), dtype=torch.float32)
    results = {}
    for mode, the_plan in plans.items():
        engine = TreeEngine(model, forest, the_plan, rank=rank)
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
        results[mode] = (best, sent, owned, the_plan)
    if rank == 0:
        print(
            f"{args.family}, {size.layers} layers, hidden {size.hidden}; {what}; {world} processes (gloo, 1 thread "
            f"each); best of {args.repeat}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
        )
        for mode, (best, sent, _, the_plan) in results.items():
            print(
                f"  {mode:7s} step {best[0]:.2f} s wall, {best[1]:.2f} s CPU, {best[2]:.2f} s waiting for a CPU "
                f"(the most of any rank); sent "
                f"{sent[0] / 1e6:.2f} MB values + {sent[1] / 1e6:.2f} MB gradients per step; {the_plan.num_slots} "
                f"slots, up to {(the_plan.tokens > 0).sum(axis=0).max()} ranks busy in one, redundancy {the_plan.redundancy:.3f}"
            )
        (before, _, lp_before, _), (after, _, lp_after, _) = results.values()
        speedup = float(before[0] / after[0])
        diff = float((lp_before - lp_after).abs().max())
        print(f"  speedup (wall) {speedup:.2f}x; max |log-prob {' - '.join(results)}| {diff:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
