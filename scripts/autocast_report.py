"""Per family, how far the tree lies from the unpatched model under autocast, beside how far that
model lies from itself: max |dlogp| and the relative gradient norm, tree vs the per-trajectory run,
and the per-trajectory run vs the same model right-padded, left-padded and in fp32. The figures of
``tests/test_modeling_autocast.py``, printed.

    python scripts/autocast_report.py                       # fp32 weights, bf16 autocast (TRL's default)
    python scripts/autocast_report.py --autocast fp16 --families qwen3_5 llama
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_modeling_autocast import DTYPES, _autocast, _case
from tiny_models import FAMILIES, Run, oracle_run, padded_run, tree_run


def _diffs(ref: Run, other: Run, real: torch.Tensor) -> tuple[float, float]:
    """(max |log-prob diff| over real tokens, ||grad diff|| / ||ref grad||)."""
    diff = torch.cat([(a.float() - b.float()).flatten() for a, b in zip(other.grads, ref.grads)])
    norm = torch.cat([b.float().flatten() for b in ref.grads]).norm()
    return float((other.logprobs - ref.logprobs)[real].abs().max()), float(diff.norm() / norm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--autocast", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    args = parser.parse_args()
    print(f"{args.weights} weights under {args.autocast} autocast; max |dlogp| / relative grad norm")
    print(f"{'family':17s} {'tree':>17s} {'right-padded':>17s} {'left-padded':>17s} {'fp32':>17s}")
    for family in args.families:
        seqs, forest, real, loss, model = _case(family, args.weights, args.autocast)
        with _autocast(args.autocast):
            ref = oracle_run(model, seqs, loss)
            runs = [
                tree_run(model, forest, loss),
                *(padded_run(model, seqs, loss, left=left) for left in (False, True)),
            ]
        dtype = next(model.parameters()).dtype
        wide = oracle_run(model.float(), seqs, loss)
        model.to(dtype)
        runs.append(Run(wide.logprobs, [g.to(dtype) for g in wide.grads], wide.entropy))
        cells = [f"{lp:8.1e} /{grad:7.1e}" for lp, grad in (_diffs(ref, run, real) for run in runs)]
        print(f"{family:17s} " + " ".join(f"{c:>17s}" for c in cells))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
