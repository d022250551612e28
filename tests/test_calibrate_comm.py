"""``harts-hf calibrate --comm`` (``harts_hf/lab/calibrate_comm.py``): the cost model's communication
terms from a 2-process gloo exchange and the model's handoff bytes."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import tiny_model

from harts_hf import patch_model
from harts_hf.lab import calibrate_comm as calibrate_comm_module
from harts_hf.lab.calibrate_comm import (
    MESSAGE_BYTES,
    calibrate_comm,
    fit_duplex,
    fit_exchange,
    measure_exchange,
    model_bytes,
)
from harts_hf.planner import DEFAULT_COST_MODEL


def test_fit_recovers_latency_and_bandwidth():
    nbytes = np.array(MESSAGE_BYTES, dtype=np.float64)
    byte, message = fit_exchange(nbytes, 3e-5 + 1e-10 * nbytes)
    assert byte == pytest.approx(1e-10) and message == pytest.approx(3e-5)
    byte, message = fit_exchange(nbytes, 1e-9 * nbytes)  # no latency at all: never a negative one
    assert message >= 0 and byte > 0


def test_duplex_is_what_the_other_way_adds():
    assert fit_duplex(2.0, 2.0) == 0.0 and fit_duplex(2.0, 3.0) == 0.5 and fit_duplex(2.0, 4.0) == 1.0
    assert fit_duplex(2.0, 1.9) == 0.0 and fit_duplex(2.0, 5.0) == 1.0  # noise either way: clipped


def test_model_bytes_count_kv_and_states():
    """qwen3_5's tiny model: its attention layer keeps K/V per context row; a path start reads conv
    halos, replay rows and GDN states, more than a row; a pure-attention model reads no states."""
    context, path = model_bytes(patch_model(tiny_model("qwen3_5")))
    assert context > 0 and path > context
    assert model_bytes(patch_model(tiny_model("llama")))[1] == 0


@pytest.mark.slow
def test_calibrate_comm_measures_an_exchange(monkeypatch):
    """One real exchange (two spawned processes, each importing harts_hf: the file's cost), watched
    on its way into the fit: every size measured one way and both ways at once, and the cost
    model's terms are its fit."""
    exchanges: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def watched(repeats: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        exchanges.append(measure_exchange(repeats))
        return exchanges[-1]

    monkeypatch.setattr(calibrate_comm_module, "measure_exchange", watched)
    model = patch_model(tiny_model("qwen3_5"))
    fitted = calibrate_comm(DEFAULT_COST_MODEL, model, repeats=1)
    [(nbytes, seconds, both)] = exchanges
    assert nbytes.tolist() == list(MESSAGE_BYTES) and (seconds > 0).all() and (both > 0).all()
    assert (fitted.byte, fitted.message) == fit_exchange(nbytes, seconds)
    assert fitted.duplex == fit_duplex(seconds[-1], both[-1]) and 0 <= fitted.duplex <= 1
    assert fitted.token == DEFAULT_COST_MODEL.token
    assert (fitted.context_bytes, fitted.state_bytes) == model_bytes(model)
    assert fitted.byte > 0 or fitted.message > 0
