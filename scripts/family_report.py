"""Per family, the worst a nasty tree does: max |dlogp| and the largest relative gradient difference
(tree vs the unpatched model run trajectory by trajectory) over every tree of ``tests/trees.py``
(1- and 2-token segments, deep chains, wide fan-outs, duplicates, strict prefixes), in fp32 and fp64.
The figures of the families table (README), printed; ``tests/test_modeling_nasty_trees.py`` asserts
them for one family per layer kind.

    python scripts/family_report.py                          # every family, both precisions
    python scripts/family_report.py --families mamba lfm3 --dtypes fp64
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import FAMILIES, in_vocab, keep_float64, loss_weights, max_diffs, oracle_run, tiny_model, tree_run
from trees import NASTY_TREES

from harts_hf.forest import RolloutForest
from harts_hf.modeling import patch_model

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def worst(family: str, dtype: torch.dtype) -> tuple[float, float, str]:
    """(max |dlogp|, max relative grad diff, the tree that gave the latter) over every nasty tree;
    float64 as ``tests/test_modeling_fp64.py`` runs it (no upcast to float32 anywhere)."""
    with keep_float64() if dtype == torch.float64 else contextlib.nullcontext():
        return _worst(family, dtype)


def _worst(family: str, dtype: torch.dtype) -> tuple[float, float, str]:
    model = patch_model(tiny_model(family, dtype=dtype))
    lp_max, grad_max, at = 0.0, 0.0, ""
    for name, build in NASTY_TREES.items():
        seqs = in_vocab(build(np.random.default_rng(5)))
        forest = RolloutForest.from_sequences(seqs)
        weights = loss_weights(forest, seed=5).to(dtype)
        lp, ent, grad = max_diffs(oracle_run(model, seqs, weights), tree_run(model, forest, weights))
        lp_max = max(lp_max, lp, ent)
        if grad >= grad_max:
            grad_max, at = grad, name
    return lp_max, grad_max, at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--dtypes", nargs="*", choices=list(DTYPES), default=list(DTYPES))
    args = parser.parse_args()
    print(f"max over {len(NASTY_TREES)} nasty trees: |dlogp| (entropy too) / relative |dgrad| (worst tree)")
    print(f"{'family':17s} " + " ".join(f"{d:>36s}" for d in args.dtypes))
    for family in args.families:
        cells = [worst(family, DTYPES[d]) for d in args.dtypes]
        print(f"{family:17s} " + " ".join(f"{lp:8.1e} / {g:8.1e} ({at:>14s})" for lp, g, at in cells))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
