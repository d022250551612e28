"""The tree tables a model's layer kinds declare (``modeling.tables.model_tables``, no forward) are
exactly the ones its layers read: building the declared tables ahead on a batch builds the same
set as running the model over a fresh copy of that batch and recording every table its layers
build (the probe, kept here as the oracle), for every family, in fp32 and bf16, under the torch
backends (the fla ones: ``fla_interpreter_cases.py``); the declaration follows the backend choice;
and a layer that reads an undeclared table fails, naming itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import FAMILIES, tiny_model
from trees import NASTY_TREES

from harts_hf import RolloutForest, patch_model
from harts_hf.modeling.registry import patched_adapter
from harts_hf.modeling.tables import layer_calls, model_tables, run_base
from harts_hf.ops.attention import AttentionBlocksTable
from harts_hf.ops.backends import ENV, tables_of
from harts_hf.ops.conv import ConvGatherTable, ConvHaloTable
from harts_hf.ops.fla import backend as fla_backend
from harts_hf.ops.fla.conv import RunsTable
from harts_hf.ops.fla.waves import WavesTable
from harts_hf.ops.ragged_layout import RaggedLayoutTable
from harts_hf.ops.rounds import ReplayTable, RoundsTable
from harts_hf.ops.tree_batch import MissingTable, TreeBatch
from harts_hf.schedule import build_tables, chunk_sizes

FORESTS = {
    "probe": [[0, 1, 2], [0, 1, 3]],  # the old probe's tree
    "grpo_group": NASTY_TREES["grpo_group"](np.random.default_rng(0)),  # long runs, several chunks
}


def read_tables(hf, adapter, batch: TreeBatch) -> frozenset:
    """The probe: the tables ``hf``'s layers build running over ``batch`` (which holds none yet)."""
    with torch.no_grad():
        run_base(hf, adapter, torch.as_tensor(batch.global_index.numpy() % 128), batch)
    return batch.tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_declared_tables_are_the_ones_the_layers_read(family: str, dtype: torch.dtype) -> None:
    hf, adapter = patched_adapter(patch_model(tiny_model(family, dtype=dtype)))
    declared = model_tables(hf, adapter)
    for name, seqs in FORESTS.items():
        forest = RolloutForest.from_sequences(seqs)
        ahead = build_tables(TreeBatch.from_forest(forest), declared, "cpu")
        assert ahead.tables == read_tables(hf, adapter, TreeBatch.from_forest(forest)), name
        read_tables(hf, adapter, ahead)  # reads nothing it lacks (MissingTable otherwise)


def test_the_declaration_follows_the_backend_the_ops_would_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The declared tables come from the registry's choice for each layer's call (nothing runs, so
    fla's availability can be faked here): fla's waves and conv runs where fla serves; on a GPU
    the tiny GDN's 8-wide heads stay on torch (fla's tiles need 16) while its conv takes fla;
    HARTS_BACKEND=torch gives the torch tables. The fla tables' builds are checked against what
    the fla ops read under Triton's interpreter (``fla_interpreter_cases.py``)."""
    monkeypatch.setattr(fla_backend, "_importable", lambda: True)
    monkeypatch.setattr(fla_backend, "interpreting", lambda: True)
    monkeypatch.setattr(fla_backend, "fla_refuses_gated_backward", lambda: False)
    hf, adapter = patched_adapter(patch_model(tiny_model("qwen3_5")))

    def declared(device: str) -> set:
        return {table for call in layer_calls(hf, adapter, torch.device(device)) for table in tables_of(call)}

    rounds = {RoundsTable(64), ReplayTable(64), ConvHaloTable(4), AttentionBlocksTable(128)}
    assert declared("cpu") == rounds | {WavesTable(64, cut=False), RunsTable(4)}
    assert declared("cuda") == rounds | {RaggedLayoutTable(64), RunsTable(4)}
    monkeypatch.setenv(ENV, "torch")
    assert declared("cuda") == rounds | {RaggedLayoutTable(64), ConvGatherTable(4)}


def test_the_schedule_reads_the_grids_off_the_declaration() -> None:
    """Mamba2's tiny models use a 16-token SSD chunk, GDN the kernel's 64: the chunk grids states are
    handed over on come from the layers' declaration, not a probe."""
    grids = {
        family: chunk_sizes(model_tables(*patched_adapter(patch_model(tiny_model(family)))))
        for family in ("qwen3_5", "bamba", "lfm2", "llama")
    }
    assert grids == {"qwen3_5": [64], "bamba": [16], "lfm2": [], "llama": []}


@pytest.mark.parametrize(
    ("family", "missing", "layer"),
    [
        ("qwen3_5", AttentionBlocksTable(128), r"tree attention of Qwen3_5Attention \(layer \d+\)"),
        ("lfm2", ConvGatherTable(3), r"causal_conv1d_\w+ \(layer kind 'conv\w*'\) of Lfm2ShortConv \(layer 0\)"),
        ("bamba", RoundsTable(16), r"mamba2_\w+ \(layer kind 'mamba2_scan\w*'\) of BambaMixer \(layer 0\)"),
        ("jamba", RoundsTable(64), r"\w+ \(layer kind '\w*mamba\w*'\) of JambaMambaMixer \(layer 0\)"),
    ],
)
def test_a_layer_reading_an_undeclared_table_fails_naming_itself(family: str, missing, layer: str) -> None:
    hf, adapter = patched_adapter(patch_model(tiny_model(family)))
    declared = model_tables(hf, adapter)
    assert missing in declared
    forest = RolloutForest.from_sequences(FORESTS["probe"])
    batch = build_tables(TreeBatch.from_forest(forest), declared - {missing}, "cpu")
    batch._cache.pop(missing, None)  # built as another table's input: drop it too
    with pytest.raises(MissingTable, match=layer + r" read the tree table " + type(missing).__name__):
        read_tables(hf, adapter, batch)
