"""One prepared GPU check of the fla backend: equivalence with the torch backend on real fla
kernels (fp32 and bf16, forward and gradients; every kind in both the zero-extra-round layout,
GDN and KDA on our state-gradient kernel with fla's q/k l2norm, and the cut layout) and timings
of tree waves vs trajectory-wise calls per layer kind and layout at realistic sizes, and the
same for the tree conv (fla's kernel vs the torch gather); then every bench family verified on the
GPU, and a step whose graphs wait in host memory against its reruns. Exits cleanly without CUDA.

    python scripts/gpu_check.py              # on a CUDA machine with fla + triton (>= 3.7.1 on Hopper)
    python scripts/gpu_check.py --part kernels --kinds gated_delta   # a part (fla compiles and
                                             # autotunes for minutes on a fresh machine)
    python scripts/gpu_check.py --interpret  # CPU, Triton interpreter, tiny sizes: our kernel only
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def tree(rng, prompt: int, turns: int, turn_len: int, leaf_len: int) -> list[list[int]]:
    """A caterpillar (agentic trunk, a side leaf per turn) after a shared prompt."""
    seg = lambda n: rng.integers(0, 1 << 30, size=n).tolist()
    trunk, seqs = seg(prompt), []
    for _ in range(turns):
        trunk = trunk + seg(turn_len)
        seqs.append(trunk + seg(leaf_len))
    return seqs + [trunk]


def inputs(kind: str, n: int, H: int, K: int, dtype, device, seed: int):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)
    x = {"q": r(n, H, K), "k": F.normalize(r(n, H, K), dim=-1), "v": r(n, H, K)}
    x["g"] = -F.softplus(r(n, H, *([K] if kind in ("kda", "gla") else []))) * 0.05
    if kind in ("gated_delta", "kda"):
        x["beta"] = torch.rand(n, H, generator=gen, device=device)
    return {name: t.to(dtype if name in ("q", "k", "v") else torch.float32).requires_grad_() for name, t in x.items()}


def timed(forward, *args) -> float:
    """ms of ``forward(*args)`` and the backward of its squared sum, the last of 3 runs (the first
    ones warm up)."""
    import torch

    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        forward(*args).float().square().sum().backward()
        torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1e3
    return elapsed


def rel_errors(ref, got, leaves) -> list[float]:
    """max |got - ref| / max |ref| of the output and of every leaf's gradient (random cotangent)."""
    import torch

    w = torch.randn_like(ref)
    gr = torch.autograd.grad((w * ref).sum(), leaves, retain_graph=True)  # ref serves every layout
    gg = torch.autograd.grad((w * got.float()).sum(), leaves)
    rel = lambda a, b: ((b.float() - a.float()).abs().max() / a.float().abs().max()).item()
    return [rel(ref, got)] + [rel(a, b) for a, b in zip(gr, gg)]


def conv_check(small, big, traj, dev) -> None:
    """Tree conv (width 4, silu): fla's kernel vs the torch backend (fp32, bf16), then fla's
    kernel vs the torch gather vs trajectory-wise at D = 8192 (a Qwen3.5-sized q/k/v conv)."""
    import torch

    from harts_hf.ops import tree_causal_conv1d
    from harts_hf.ops.backends import ENV
    from harts_hf.ops.fla import conv as fla_conv
    from harts_hf.ops.tree_batch import TreeBatch

    def inputs(n: int, D: int, dtype, seed: int):
        gen = torch.Generator(device=dev).manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=gen, device=dev).to(dtype).requires_grad_()
        return r(n, D), r(D, 4), r(D)

    def run(x, w, b, batch, backend: str, gather_below: float):
        os.environ[ENV] = backend
        fla_conv.GATHER_BELOW_MEAN_RUN = gather_below
        return tree_causal_conv1d(x, w, b, batch, activation="silu")

    print("\n== conv: fla kernel vs torch backend (max |diff| / max |ref|)")
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        x, w, b = inputs(small.num_compact_tokens, 256, dtype, 3)
        ref = run(*(t.float() for t in (x, w, b)), TreeBatch.from_forest(small, device=dev), "torch", 0.0)
        got = run(x, w, b, TreeBatch.from_forest(small, device=dev), "fla", 0.0)
        errs = rel_errors(ref, got, [x, w, b])
        status = "ok" if max(errs) <= tol else "FAIL"
        print(f"conv {dtype!s:15s} o {errs[0]:.1e}  grads max {max(errs[1:]):.1e}  {status}")

    batch = TreeBatch.from_forest(big, device=dev)
    print(f"\n== conv timing, D=8192 W=4 bf16, fwd+bwd ms (tree mean run {fla_conv.mean_run(batch):.0f} tokens)")
    for name, forest, gather_below in (
        ("fla kernel", big, 0.0),
        ("torch gather", big, float("inf")),
        ("traj kernel", traj, 0.0),
    ):
        x, w, b = inputs(forest.num_compact_tokens, 8192, torch.bfloat16, 4)
        fb = TreeBatch.from_forest(forest, device=dev)
        print(f"{name:13s} {timed(run, x, w, b, fb, 'fla', gather_below):9.1f}")
    fla_conv.GATHER_BELOW_MEAN_RUN = 16.0


def model_check(dev) -> None:
    """Every benchmark family at the default size on the GPU, fla's kernels serving both ways:
    ``harts_hf.verify`` (tree log-probs and parameter gradients vs the unpatched model run
    trajectory by trajectory), fp32 and bf16."""
    import torch

    import harts_hf
    from harts_hf.lab.models import BENCH_FAMILIES, build_model
    from harts_hf.ops.backends import ENV

    os.environ[ENV] = "auto"
    print("\n== models: harts_hf.verify on CUDA, default bench size")
    for family in BENCH_FAMILIES:
        for dtype in (torch.float32, torch.bfloat16):
            try:
                model = build_model(family, "default", dtype=dtype).model.to(dev)
                harts_hf.patch_model(model)
                harts_hf.verify(model)
            except Exception as err:  # one family's failure must not hide the others'
                print(f"{family} ({dtype}): FAILED with {type(err).__name__}: {err}")


def host_graphs_check(dev, scale: int = 10) -> None:
    """Graphs in host memory on the GPU (``harts_hf.engine.offload``: pinned copies on a copy
    stream): a 4-slot step of the default bench model whose budget keeps one graph, its 3 others in
    host memory or rerun; the gradients of the two agree, and the step's time, peak device memory
    and the bytes moved to the host, for both (``scale``: the trajectories' length in hundreds of
    tokens; on a CPU device, a smoke test of the script)."""
    import dataclasses

    import torch

    from harts_hf.engine import TreeEngine, memory_model
    from harts_hf.lab.models import build_model
    from harts_hf.modeling import patch_model
    from harts_hf.planner import plan
    from harts_hf.sources import grpo_group

    print("\n== graphs in host memory vs reruns (qwen3_5 default size, bf16, one rank)")
    model = patch_model(build_model("qwen3_5", "default", dtype=torch.bfloat16).model.to(dev))
    forest = grpo_group(prompt_len=400 * scale, G=8, max_completion=300 * scale, seed=0, vocab=8192).forest()
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    host = plan(
        forest,
        world_size=1,
        max_tokens_per_microbatch=forest.num_compact_tokens // 4 + 64,
        memory_model=memory_model(model),
        max_host_bytes=64e9,
    )
    rerun = dataclasses.replace(host, budget=dataclasses.replace(host.budget, host_bytes=0.0))
    print(f"{host.num_slots} slots, host graphs {int(host.host_graphs.sum())}, reruns without {int(rerun.rerun.sum())}")
    grads = {}
    for name, the_plan in (("rerun", rerun), ("host", host)):
        engine = TreeEngine(model, forest, the_plan)
        for _ in range(3):  # the last of 3 steps counts
            model.zero_grad(set_to_none=True)
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            began = time.perf_counter()
            engine.backward(lambda lps: sum(lp.float().sum() for lp in lps))
            sync()
        ms = 1e3 * (time.perf_counter() - began)
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else float("nan")
        grads[name] = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        print(f"{name:6s} {ms:9.1f} ms  peak {peak:6.2f} GiB  moved to host {engine.host.moved / 2**30:6.2f} GiB")
    diff = (grads["host"] - grads["rerun"]).abs().max() / grads["rerun"].abs().max()
    print(f"gradients: max |host - rerun| / max |rerun| = {diff:.1e} ({'ok' if diff < 5e-2 else 'FAIL'})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret", action="store_true", help="Triton interpreter on CPU, tiny sizes")
    parser.add_argument("--tokens", type=int, default=32768, help="compact tokens of the timing tree")
    parser.add_argument(
        "--part", choices=("all", "kernels", "models", "host"), default="all", help="which checks to run"
    )
    parser.add_argument("--kinds", nargs="+", metavar="KIND", help="linear kinds to check (default: all four)")
    args = parser.parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    # fp32 rows check the glue at full precision: Triton's fp32 tl.dot is TF32 on Ampere+ by default
    # (~1e-3 relative, as measured on an H200); the bf16 rows check the kernels as trained.
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    import numpy as np
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (the CPU tests cover the glue).")
        return 0
    if args.interpret:
        from harts_hf.ops.fla.delta_state_grad import delta_state_grad

        T, H, K, V = 40, 2, 16, 8
        cu = torch.tensor([0, 24, 40], dtype=torch.int32)
        t = lambda *s: torch.randn(*s)
        dh, dv2, dh0 = delta_state_grad(
            t(T, H, K),
            t(T, H, K),
            t(T, H, K),
            -torch.rand(T, H) * 0.1,
            t(T, H, V),
            t(T, H, V),
            t(2, H, K, V),
            t(2, H, K, V),
            cu,
            scale=0.25,
            chunk_size=16,
        )
        ok = all(torch.isfinite(x).all() for x in (dh, dv2, dh0))
        print(f"gpu_check --interpret: delta_state_grad ran in the interpreter, finite={ok}")
        return 0 if ok else 1

    dev = torch.device("cuda")
    if args.part in ("models", "host"):
        (model_check if args.part == "models" else host_graphs_check)(dev)
        return 0
    from harts_hf.forest import RolloutForest
    from harts_hf.ops import tree_gated_delta_rule, tree_gla, tree_kda, tree_simple_gla
    from harts_hf.ops.backends import ENV
    from harts_hf.ops.fla.backend import ROUNDS_OPS, WAVES_LAYOUT
    from harts_hf.ops.fla.waves import waves_of
    from harts_hf.ops.rounds import rounds_of
    from harts_hf.ops.tree_batch import TreeBatch

    ops = {"gated_delta": tree_gated_delta_rule, "kda": tree_kda, "gla": tree_gla, "simple_gla": tree_simple_gla}
    ops = {kind: op for kind, op in ops.items() if kind in (args.kinds or ops)}
    rng = np.random.default_rng(0)

    default = dict(WAVES_LAYOUT)
    layouts = {kind: [default[kind]] + (["cut"] if kind in ROUNDS_OPS else []) for kind in ops}

    def run(kind, x, batch, backend, layout=None):
        os.environ[ENV] = backend
        WAVES_LAYOUT[kind] = layout or default[kind]
        args = [x[n] for n in ("q", "k", "v", "g", "beta") if n in x]
        return ops[kind](*args, batch, **({"use_qk_l2norm": True} if "beta" in x else {}))[0]

    print("== equivalence: fla backend vs torch backend (max |diff| / max |ref|)")
    small = RolloutForest.from_sequences(tree(rng, 100, 12, 30, 9))
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 5e-2)):
        for kind in ops:
            x = inputs(kind, small.num_compact_tokens, 4, 64, dtype, dev, 1)
            ref = run(
                kind,
                {n: t.float() if n in "qkv" else t for n, t in x.items()},
                TreeBatch.from_forest(small, device=dev),
                "torch",
            )
            for layout in layouts[kind]:
                try:
                    got = run(kind, x, TreeBatch.from_forest(small, device=dev), "fla", layout)
                    errs = rel_errors(ref, got, list(x.values()))
                except RuntimeError as err:  # e.g. fla refusing this Triton on this GPU: go on
                    print(f"{kind:12s} {layout:7s} {dtype!s:15s} FAILED: {err}")
                    continue
                status = "ok" if max(errs) <= tol else "FAIL"
                print(f"{kind:12s} {layout:7s} {dtype!s:15s} o {errs[0]:.1e}  grads max {max(errs[1:]):.1e}  {status}")

    print(f"\n== timing, H=16 K=V=128 bf16, ~{args.tokens} compact tokens, fwd+bwd ms")
    turns = max(1, args.tokens // 1200)
    big = RolloutForest.from_sequences(tree(rng, 4000, turns, 700, 300))
    traj = RolloutForest.from_sequences(tree(np.random.default_rng(0), 4000, turns, 700, 300), share_prefixes=False)
    print(f"compact {big.num_compact_tokens}, trajectory tokens {big.num_trajectory_tokens}")
    print(f"{'kind':12s} {'layout':7s} {'rounds':>6s} {'waves':>6s} {'tree ms':>9s} {'traj ms':>9s}")
    for kind in ops:
        x = inputs(kind, traj.num_compact_tokens, 16, 128, torch.bfloat16, dev, 2)
        try:
            traj_ms = timed(run, kind, x, TreeBatch.from_forest(traj, device=dev), "fla")
        except RuntimeError as err:
            print(f"{kind:12s} FAILED: {err}")
            continue
        batch = TreeBatch.from_forest(big, device=dev)
        x = inputs(kind, big.num_compact_tokens, 16, 128, torch.bfloat16, dev, 2)
        for layout in layouts[kind]:
            tree_ms = timed(run, kind, x, batch, "fla", layout)
            print(
                f"{kind:12s} {layout:7s} {rounds_of(batch, 64).num_rounds:6d} "
                f"{waves_of(batch, 64, layout == 'cut').num_waves:6d} {tree_ms:9.1f} {traj_ms:9.1f}"
            )
    conv_check(small, big, traj, dev)
    if args.part == "all":
        model_check(dev)
        host_graphs_check(dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
