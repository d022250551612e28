"""``harts-hf bench-ops``: the JSON record and the ideals it reports (not the timings)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from harts_hf.app.cli import main
from harts_hf.forest import RolloutForest
from harts_hf.lab.ops import KINDS, LINEAR_KINDS, _intra_case, _ragged_slots, bench_ops, format_table
from harts_hf.ops.tree_batch import TreeBatch

TOP_FIELDS = {
    "trajectories",
    "trajectory_tokens",
    "compact_tokens",
    "compression",
    "attended_pair_ratio",
    "chunk_size",
    "repeats",
    "threads",
    "kept_memory",
    "kinds",
}
KIND_FIELDS = {"tree_ms", "traj_ms", "speedup", "ideal", "of_ideal", "rounds", "traj_rounds", "note"}
LINEAR_FIELDS = {"grid_ideal", "slot_ideal", "replayed", "padding"}
LINEAR_FIELDS |= {"tree_intra_ms", "traj_intra_ms", "intra_speedup", "rest_speedup"}


def grpo_group(prompt: int, completions: list[int]) -> list[list[int]]:
    """A shared prompt of ``prompt`` tokens and one completion per length (distinct first tokens)."""
    return [list(range(prompt)) + [1000 * (i + 1) + t for t in range(n)] for i, n in enumerate(completions)]


def test_cli_writes_the_json_record(tmp_path) -> None:
    """End to end in a subprocess: the command changes process-wide malloc settings."""
    path = tmp_path / "ops.json"
    argv = ["bench-ops", "--scale", "0.0005", "--kinds", "attention", "conv", "--repeats", "1", "--json", str(path)]
    done = subprocess.run(
        [sys.executable, "-m", "harts_hf", *argv], check=False, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(path.read_text())
    assert set(record) == TOP_FIELDS | {"workload", "scale", "tasks"}
    assert (record["workload"], record["scale"], record["tasks"], record["repeats"]) == ("swe-like", 0.0005, 1, 1)
    assert record["threads"] == 1 and record["kept_memory"] == sys.platform.startswith("linux")
    assert list(record["kinds"]) == ["attention", "conv"]
    for row in record["kinds"].values():
        assert set(row) == KIND_FIELDS
        assert row["tree_ms"] > 0 and row["traj_ms"] > 0
        assert row["speedup"] == pytest.approx(row["traj_ms"] / row["tree_ms"])
        assert row["of_ideal"] == pytest.approx(row["speedup"] / row["ideal"])
    assert record["kinds"]["conv"]["ideal"] == pytest.approx(record["trajectory_tokens"] / record["compact_tokens"])
    assert record["kinds"]["attention"]["ideal"] == record["attended_pair_ratio"] > 1
    assert "of ideal" in done.stdout and f"{record['trajectories']:,} trajectories" in done.stdout


def test_ideals_and_rounds_of_a_grpo_group() -> None:
    """Prompt of one chunk + two 10-token completions: every number but the timings is known."""
    report = bench_ops(grpo_group(64, [10, 10]), repeats=1, progress=False)
    assert set(report) == TOP_FIELDS and list(report["kinds"]) == list(KINDS) and not report["kept_memory"]
    assert (report["trajectories"], report["trajectory_tokens"], report["compact_tokens"]) == (2, 148, 84)
    pairs_tree = sum(range(1, 65)) + 2 * sum(range(65, 75))  # sum of position + 1 over compact tokens
    pairs_traj = 2 * sum(range(1, 75))
    assert report["attended_pair_ratio"] == pytest.approx(pairs_traj / pairs_tree)
    for kind, row in report["kinds"].items():
        linear = kind in LINEAR_KINDS
        assert set(row) == KIND_FIELDS | (LINEAR_FIELDS if linear else set())
        assert row["ideal"] == pytest.approx(pairs_traj / pairs_tree if kind == "attention" else 148 / 84)
        # Linear kinds: 2 rounds (the prompt path, then the second completion); 4 chunks of 64
        # trajectory-wise vs 3 on the tree (the second completion starts on a chunk boundary).
        assert (row["rounds"], row["traj_rounds"]) == ((2, 1) if linear else (1, 1))
        if linear:
            assert row["grid_ideal"] == pytest.approx(4 / 3)
            # Ragged layout: the completions' chunks run at 16 slots (10 tokens, rounded up to 8).
            assert row["slot_ideal"] == pytest.approx(2 * (64 + 16) / (64 + 2 * 16))
            assert (row["replayed"], row["padding"]) == (0, 2 * 6)
            assert row["intra_speedup"] == pytest.approx(row["traj_intra_ms"] / row["tree_intra_ms"])
            assert row["rest_speedup"] is None or row["rest_speedup"] == pytest.approx(
                (row["traj_ms"] - row["traj_intra_ms"]) / (row["tree_ms"] - row["tree_intra_ms"])
            )


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_intra_half_runs_on_the_chunks_of_the_ragged_layout(kind: str) -> None:
    """The timed chunk-local half covers the torch driver's chunks: one [T, L, H, K] block per chunk length,
    as many slots as the ragged layout, and gradients reach every input."""
    batch = TreeBatch.from_forest(RolloutForest.from_sequences(grpo_group(70, [10, 3, 30])))
    case = _intra_case(kind, batch, torch.Generator().manual_seed(0))
    q_blocks = case.inputs[:: 5 if kind in ("gated_delta", "kda") else 4]
    lengths = sorted({q.shape[1] for q in q_blocks}, reverse=True)
    # The prompt goes on with the 30-token completion: chunks of 64 and 36 (-> 40); the others 10 (-> 16), 3 (-> 8).
    assert lengths == [64, 40, 16, 8] and sum(q.shape[0] * q.shape[1] for q in q_blocks) == _ragged_slots(batch)[0]
    torch.autograd.backward(case.op(*case.inputs), case.grad)
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in case.inputs)


def test_unknown_kind_and_bad_repeats_are_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench-ops", "--scale", "0.0005", "--kinds", "mamba"])
    assert exit_info.value.code == 2 and "unknown kinds mamba; choose from attention" in capsys.readouterr().err
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        bench_ops(grpo_group(3, [1, 2]), repeats=0, progress=False)


def test_fallback_notes_are_printed():
    report = {
        "trajectories": 2,
        "trajectory_tokens": 10,
        "compact_tokens": 6,
        "compression": 1.67,
        "attended_pair_ratio": 1.5,
        "repeats": 3,
        "threads": 1,
        "kinds": {
            "gated_delta": {
                "tree_ms": 1.0,
                "traj_ms": 2.0,
                "speedup": 2.0,
                "ideal": 1.67,
                "of_ideal": 1.2,
                "rounds": 4,
                "traj_rounds": 1,
                "note": "gated_delta: fla exact cut-path fallback",
            }
        },
    }
    assert format_table(report).endswith("\nnote: gated_delta: fla exact cut-path fallback")
