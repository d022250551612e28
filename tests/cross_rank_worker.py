"""Worker of ``test_cross_rank.py`` under ``torchrun`` (gloo, CPU): every rank runs its row of
hand-built plans whose units read context, conv halos, recurrent states and replay inputs from
units of other ranks, in earlier slots or in their own (context-parallel groups, streamed); rank
0 saves, per case, the log-probs and SGD parameter gradients summed over ranks, the
single-process engine's and the unpatched model's (trajectory by trajectory).
Under autocast (bf16) the single-process reference runs the same units on one rank; "hostgroup"
sends streamed headers on a group of their own (as beside NCCL); "fsdp2" shards the model with
``fully_shard`` (``fsdp2_cpu.shard``), its references an unsharded copy.

Also the plans themselves (:func:`piece_plan`, :data:`PLANS`), which the single-process tests read.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from harts_hf import RolloutForest
from harts_hf.planner.cost import DEFAULT_COST_MODEL, CostModel
from harts_hf.planner.geometry import Geometry
from harts_hf.planner.memory import TOKEN_MEMORY, Budget, MemoryModel
from harts_hf.planner.pieces import Pieces
from harts_hf.planner.plan import Plan, build_plan, plan
from harts_hf.planner.relay import TopLayout, _chained_tops, _fanned_tops, relay_cut


def piece_plan(
    forest: RolloutForest | list[RolloutForest],
    pieces: list[tuple[int, int, int, int]],
    world_size: int,
    budget: int | None = None,
) -> Plan:
    """The plan of ``pieces`` (rank, slot, DFS start, DFS end) of ``forest`` (or of forests, their
    DFS orders one after the other), one rank's owner of each token (no replicas), under a budget
    of ``budget`` tokens (default: all of them)."""
    forests = forest if isinstance(forest, list) else [forest]
    pieces = sorted(pieces)
    rank, slot, lo, hi = (np.array([p[k] for p in pieces], dtype=np.int64) for k in range(4))
    zeros = np.zeros(len(pieces), dtype=np.int64)
    cut = Pieces(rank, slot, lo, hi, zeros, zeros.astype(bool), int(slot.max()) + 1)
    geo = Geometry.of(forests, DEFAULT_COST_MODEL)
    budget = Budget(sum(f.num_compact_tokens for f in forests) if budget is None else budget)
    return build_plan(geo, forests, cut, DEFAULT_COST_MODEL, budget, TOKEN_MEMORY, 64, time.perf_counter(), world_size)


def chain_plan(forest: RolloutForest, cuts: list[int], ranks: list[int], world_size: int) -> Plan:
    """The DFS order cut at ``cuts``, piece i in slot i on rank ``ranks[i]``."""
    bounds = [0, *cuts, forest.num_compact_tokens]
    return piece_plan(forest, [(r, i, a, b) for i, (r, a, b) in enumerate(zip(ranks, bounds, bounds[1:]))], world_size)


def prompt_plan(forest: RolloutForest, prompt: int, world_size: int) -> Plan:
    """The first ``prompt`` tokens of the largest tree (a shared chain) on rank 0 in slot 0; the
    subtrees under its last token split between ranks 1.. in slot 1 (a DFS range each, cut at
    subtree starts); the other trees on the last rank in slot 0."""
    roots = np.flatnonzero(forest.prev < 0)
    root = int(roots[np.argmax(forest.subtree_end[roots] - roots)])
    last, end = root + prompt - 1, int(forest.subtree_end[root])
    starts = [*np.flatnonzero(forest.prev == last).tolist(), end]  # the chain's children: subtree starts
    pieces = [(0, 0, root, last + 1)]
    for r, g in enumerate(np.array_split(np.arange(len(starts) - 1), world_size - 1), start=1):
        pieces.append((r, 1, starts[g[0]], starts[g[-1] + 1]))
    others = [(a, b) for a, b in ((0, root), (end, forest.num_compact_tokens)) if b > a]
    pieces += [(world_size - 1, 0, a, b) for a, b in others]
    return piece_plan(forest, pieces, world_size)


def prompt_forest(rng: np.random.Generator) -> list[list[int]]:
    """A 40-token prompt shared by subtrees that branch again mid-chunk (one leaf past 64 tokens),
    and a second tree."""
    seg = lambda n: [int(t) for t in rng.integers(3, 120, n)]
    prompt = seg(40)
    a, b, c = seg(30), seg(12), seg(9)
    return [prompt + a, prompt + a[:5] + seg(4), prompt + b, prompt + b + seg(20), prompt + c, prompt + [a[0]], seg(7)]


def deep_forest(rng: np.random.Generator, levels: int = 12) -> list[list[int]]:
    """A chain of ``levels`` nodes of 10-30 tokens with a 5-15-token leaf under each (387 tokens):
    every DFS range of it branches, and a span's context runs through every span before it."""
    seg = lambda n: [int(t) for t in rng.integers(3, 120, n)]
    chain, rows = [], []
    for _ in range(levels):
        chain = chain + seg(int(rng.integers(10, 31)))
        rows.append(chain + seg(int(rng.integers(5, 16))))
    return [*rows, chain]


def branched_forest(rng: np.random.Generator) -> list[list[int]]:
    """A 296-token chain and a 56-token branch off its 32nd token (352 tokens)."""
    chain = [int(t) for t in rng.integers(3, 120, 296)]
    return [chain, chain[:32] + [int(t) for t in rng.integers(3, 120, 56)]]


def relay_forest(rng: np.random.Generator) -> list[list[int]]:
    """A 40-token prompt above six agent segments of 30-90 tokens, each a trunk and a branch off its
    middle (432 tokens): the relay's tops and branches."""
    seg = lambda n: [int(t) for t in rng.integers(3, 120, n)]
    prompt, rows = seg(40), []
    for n in (70, 45, 90, 30, 60, 55):
        trunk = prompt + seg(n)
        rows += [trunk, trunk[: len(prompt) + n // 2] + seg(7)]
    return rows


def relay_plan(forest: RolloutForest, world_size: int, max_tokens: int = 200) -> Plan:
    """The relay of the relay forest under a 200-token budget, context at a tenth of an own token and
    a free link (``planner/relay.py``): the prompt on rank 0 in slot 0, every segment on one rank or
    cut between two, its head in slot 1 and its tail, on the next rank, in slot 2. Under a budget of
    ``max_tokens`` below a rank's share, only its last slot keeps its graph (filled to the budget)
    and every earlier one reruns."""
    cost, memory, budget, geo, build = _relay_setup(forest, world_size, max_tokens)
    return relay_cut(geo, budget, memory, world_size, 64, build, 4, cost)


def _relay_setup(
    forest: RolloutForest, world_size: int, max_tokens: int = 200
) -> tuple[CostModel, MemoryModel, Budget, Geometry, Callable[[Pieces], Plan]]:
    """A budget of ``max_tokens``, context at a tenth of an own token, a free link: (cost, memory,
    budget, geometry, the plan builder) of the relay's tests."""
    cost = dataclasses.replace(DEFAULT_COST_MODEL, byte=0.0, message=0.0)
    memory = MemoryModel(token=1.0, context=0.1)
    budget = memory.budget(max_tokens=max_tokens)
    geo = Geometry.of([forest], cost)
    build = lambda pieces: build_plan(geo, [forest], pieces, cost, budget, memory, 64, time.perf_counter(), world_size)
    return cost, memory, budget, geo, build


def fanned_forest(rng: np.random.Generator) -> list[list[int]]:
    """A 60-token system prompt above two 20-token task prompts, each above three agent segments of
    40-70 tokens (a trunk and a branch off its middle; 480 tokens): the relay's tops in two levels."""
    seg = lambda n: [int(t) for t in rng.integers(3, 120, n)]
    system, rows = seg(60), []
    for lengths in ((70, 45, 60), (40, 65, 50)):
        task = system + seg(20)
        for n in lengths:
            trunk = task + seg(n)
            rows += [trunk, trunk[: len(task) + n // 2] + seg(7)]
    return rows


def fanned_plan(forest: RolloutForest, world_size: int, layout: TopLayout = _fanned_tops) -> Plan:
    """The relay of the fanned forest as ``relay_plan``'s, its tops laid out by ``layout`` over every
    rank. Against their fan-out (the default): the system prompt split over the ranks in slot 0 (a
    context-parallel group), each task prompt over two ranks in slot 1 (reading it handed over), the
    segments in slots 2 and 3. As chains side by side (``_chained_tops``): the system prompt in slot
    0, in slot 1 each task prompt on ranks of its own, the heavier split over two (a group beside a
    rank of its own)."""
    cost, memory, budget, geo, build = _relay_setup(forest, world_size)
    return relay_cut(geo, budget, memory, world_size, 64, build, 4, cost, layouts=(layout,), top_ranks=(world_size,))


def wavefront_plan(forest: RolloutForest, world_size: int) -> Plan:
    """``plan()``'s choice for the deep forest under a 100-token budget, context at a tenth of an own
    token and a free link (a tiny model's microseconds of compute are no match for a message's
    latency): its DFS order cut into one span per (slot, rank) (``planner/wavefront.py``)."""
    return plan(
        forest,
        world_size=world_size,
        max_tokens_per_microbatch=100,
        memory_model=MemoryModel(token=1.0, context=0.1),
        cost_model=dataclasses.replace(DEFAULT_COST_MODEL, byte=0.0, message=0.0),
        context_parallel=True,
    )


def without_cuts(make: Callable[..., Plan]) -> Callable[..., Plan]:
    """``make`` planning with ``plan()``'s every-token-once cuts left out (the DFS cut,
    ``planner/wavefront.py``; the relay, ``planner/relay.py``): they beat the pass a test plans for
    on some small forests (shared root, idle ranks, free time)."""
    planning = importlib.import_module("harts_hf.planner.plan")  # the module (the package exports the function)

    @functools.wraps(make)
    def made(*args, **kwargs) -> Plan:
        saved = planning.wavefront_cut, planning.relay_cut
        planning.wavefront_cut = planning.relay_cut = lambda *_, **__: None
        try:
            return make(*args, **kwargs)
        finally:
            planning.wavefront_cut, planning.relay_cut = saved

    return made


def group_plan(forest: RolloutForest, cuts: list[int], ranks: list[int], slots: list[int], world_size: int) -> Plan:
    """The DFS order cut at ``cuts``, piece i on rank ``ranks[i]`` in slot ``slots[i]``: pieces of one
    slot on several ranks form a context-parallel group."""
    bounds = [0, *cuts, forest.num_compact_tokens]
    pieces = [(r, s, a, b) for r, s, a, b in zip(ranks, slots, bounds, bounds[1:])]
    return piece_plan(forest, pieces, world_size)


ONE_RANK = {
    "chain3": lambda f: chain_plan(f, [50, 85], [0, 0, 0], 1),
    "cpchain2": lambda f: chain_plan(f, [50], [0, 0], 1),
}
"""The same units on one rank, where every slot holds one piece (the autocast case's reference)."""

PLANS = {
    # name -> (world size, forest kind, plan of the forest)
    "chain3": (3, "family", lambda f: chain_plan(f, [50, 85], [0, 1, 2], 3)),
    "prompt3": (3, "prompt", lambda f: prompt_plan(f, 40, 3)),
    "zigzag2": (2, "family", lambda f: chain_plan(f, [20, 66, 90], [0, 1, 0, 1], 2)),
    "prompt2": (2, "prompt", lambda f: prompt_plan(f, 40, 2)),
    # context-parallel groups: spans of one slot on several ranks (the family tree's 70-token trunk
    # starts at DFS 20 and branches at depths 63-65; the chain is one 120-token trajectory)
    "cp2": (2, "family", lambda f: group_plan(f, [50], [0, 1], [0, 0], 2)),
    "cp3": (3, "family", lambda f: group_plan(f, [45, 80], [0, 1, 2], [0, 0, 0], 3)),
    "cpchain2": (2, "chain", lambda f: group_plan(f, [50], [0, 1], [0, 0], 2)),
    "cpchain3": (3, "chain", lambda f: group_plan(f, [40, 80], [0, 1, 2], [0, 0, 0], 3)),
    "cp2slots": (2, "family", lambda f: group_plan(f, [50, 90, 100], [0, 1, 0, 1], [0, 0, 1, 1], 2)),
    # three slots of three spans (the DFS cut's layout): rank 0's span of slot 0 streams rank 2 the
    # rows its slot-2 branch replays, which rank 2's slot-0 span, reading only rank 1's state, does not
    "cpbranch3": (
        3,
        "branched",
        lambda f: group_plan(f, [32, 64, 112, 144, 192, 224, 272, 312], [0, 1, 2] * 3, [0, 0, 0, 1, 1, 1, 2, 2, 2], 3),
    ),
    "cpwave2": (2, "deep", lambda f: wavefront_plan(f, 2)),  # 3 slots of 2 branching spans each
    "cpwave3": (3, "deep", lambda f: wavefront_plan(f, 3)),  # 2 slots of 3
    "relay2": (2, "relay", lambda f: relay_plan(f, 2)),  # one segment's head on rank 0, its tail on rank 1
    "relay3": (3, "relay", lambda f: relay_plan(f, 3)),  # two segments handed on, rank 0 -> 1 -> 2
    "kept2": (2, "relay", lambda f: relay_plan(f, 2, 100)),  # three branch slots, the last filled, two rerun
    "fanned3": (3, "fanned", lambda f: fanned_plan(f, 3)),  # the system prompt a group in slot 0, tasks in slot 1
    "chained3": (3, "fanned", lambda f: fanned_plan(f, 3, _chained_tops)),  # slot 1: a task on two ranks, one on one
}


EXTRA_FORESTS: dict[str, list[list[int]]] = {}  # forests a worker over this one adds (``main``)


def forest_of(kind: str) -> tuple[list[list[int]], RolloutForest]:
    from tiny_models import family_forest

    if kind in EXTRA_FORESTS:
        return EXTRA_FORESTS[kind], RolloutForest.from_sequences(EXTRA_FORESTS[kind])
    rng = np.random.default_rng(0)
    seqs = {
        "family": family_forest,
        "prompt": prompt_forest,
        "chain": lambda g: [[int(t) for t in g.integers(3, 120, 120)]],
        "deep": deep_forest,
        "relay": relay_forest,
        "branched": branched_forest,
        "fanned": fanned_forest,
    }[kind](rng)
    return seqs, RolloutForest.from_sequences(seqs)


@contextlib.contextmanager
def host_headers(separate: bool) -> Iterator[None]:
    """With ``separate``, streamed headers travel on a gloo group of their own, as beside NCCL (a
    second ordered channel per pair: ``harts_hf.engine.stream.host_group``)."""
    from harts_hf.engine import stream

    if not separate:
        yield
        return
    group, made = dist.new_group(backend="gloo"), stream.host_group
    stream.host_group = lambda default: group
    try:
        yield
    finally:
        stream.host_group = made


def run_case(family: str, plan_name: str, wrapper: str, out: Path) -> None:
    """One case on every rank; rank 0 saves what the test compares."""
    from fsdp2_cpu import hook_gathers
    from tiny_models import as_layout, tiny_model, trainable, trajectory_logprobs

    from harts_hf import patch_model, tree_logprobs
    from harts_hf.engine import TreeEngine
    from harts_hf.trainers._compat import add_tree_forward

    rank, world = dist.get_rank(), dist.get_world_size()
    size, kind, make = PLANS[plan_name]
    assert size == world
    seqs, forest = forest_of(kind)
    the_plan = make(forest)
    model = patch_model(tiny_model(family))
    if wrapper == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    width = forest.max_length - 1
    weights = torch.as_tensor(
        np.random.default_rng(1).standard_normal((forest.num_trajectories, width)), dtype=torch.float32
    )
    loss_fn = lambda lps: (lps[0] * weights).sum()
    with torch.no_grad():
        others = tree_logprobs(model, forest)
    forward = no_sync = None
    reference = model  # what the references on rank 0 run: an unsharded copy under FSDP2
    if wrapper == "ddp":
        add_tree_forward(model)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        forward, no_sync = (lambda run: ddp(harts_call=run)), ddp.no_sync
    if wrapper == "fsdp2":
        from fsdp2_cpu import shard, without_gradient_sync

        reference = copy.deepcopy(model)
        add_tree_forward(model)
        shard(model)
        forward, no_sync = (lambda run: model(harts_call=run)), (lambda: without_gradient_sync(model))
    params = trainable(model)
    engine = TreeEngine(model, forest, the_plan, rank=rank, forward=forward, no_sync=no_sync)
    own = engine.owned[0]
    seen = []

    def loss(lps):  # a gathered objective: this rank's rows live, the others' constant
        seen.append(lps[0].detach())
        return loss_fn([torch.where(own[:, None], lps[0], others)])

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=wrapper == "autocast")
    with autocast, host_headers(wrapper == "hostgroup"), hook_gathers() as gathers:
        engine.backward(loss)
    lp = torch.where(own[:, None], seen[0], 0.0)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    if wrapper == "fsdp2":  # sharded: the whole averaged gradient on every rank
        grads = [g.full_tensor() for g in grads]
    dist.all_reduce(lp)
    for g in grads:
        if wrapper in ("ddp", "fsdp2"):
            g.mul_(world)  # the wrapper averaged them
        else:
            dist.all_reduce(g)
    sent = torch.tensor([float(engine.exchanged_bytes[k]) for k in ("values", "grads")])
    dist.all_reduce(sent)
    exchange = engine.schedule.exchange
    streams = torch.tensor(sum(len(e) for e in exchange.stream_send.values()))
    dist.all_reduce(streams)  # blocks streamed inside a call (context-parallel groups)
    if rank != 0:
        return
    # References on rank 0: the unpatched model trajectory by trajectory, and the single-process engine.
    params = trainable(reference)
    for p in params:
        p.grad = None
    oracle = as_layout([lp for lp, _ in trajectory_logprobs(reference, seqs)], width)
    ref = torch.autograd.grad(loss_fn([oracle]), params, allow_unused=True)
    single = TreeEngine(reference, forest, ONE_RANK[plan_name](forest) if wrapper == "autocast" else None)
    with autocast:
        single_lp = single.logprobs()[0]
        single.backward(loss_fn)
    torch.save(
        {
            "logprobs": lp,
            "grads": grads,
            "oracle": (oracle.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, ref)]),
            "single": (single_lp, [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]),
            "transfers": len(engine.schedule.transfers),
            "streams": int(streams),
            "hook_gathers": gathers[0],
            "bytes": sent.tolist(),
        },
        out / f"{family}-{plan_name}-{wrapper}.pt",
    )


def main(forests: dict[str, list[list[int]]] | None = None, plans: dict | None = None) -> None:
    """Run the cases of argv (``family:plan:wrapper``), each rank its row, with more ``forests`` (by
    kind) and ``plans`` (as :data:`PLANS`): the workers of the planner's own plans
    (``cp_plan_worker``, ``handoff_plan_worker``)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    EXTRA_FORESTS.update(forests or {})
    PLANS.update(plans or {})
    out = Path(sys.argv[1])
    for case in sys.argv[2:]:
        family, plan_name, wrapper = case.split(":")
        run_case(family, plan_name, wrapper, out)
        dist.barrier()
    from harts_hf.trainers.teardown import end_distributed

    end_distributed()  # gloo's threads abort the exit ("terminate called ...") otherwise


if __name__ == "__main__":
    main()
