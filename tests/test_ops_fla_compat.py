"""The fla door (``harts_hf.ops.fla._compat``) without triton: another fla release is refused
before any fla name is read, in one warning, and the linear-attention ops stay on the torch
backend. (Every name resolving against the checked release: ``fla_interpreter_cases.py``.)"""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

from harts_hf.ops.fla import _compat, backend


@pytest.fixture
def fla_release(monkeypatch):
    """Pretend ``fla-core`` is installed at the given version."""

    def install(version: str) -> None:
        monkeypatch.setattr(importlib.metadata, "version", lambda dist: version if dist == "fla-core" else "0")
        _compat.fla_checked.cache_clear()
        backend._importable.cache_clear()

    yield install
    _compat.fla_checked.cache_clear()
    backend._importable.cache_clear()


def test_another_fla_release_is_refused_in_one_warning(fla_release, caplog):
    fla_release("0.7.0")
    with caplog.at_level(logging.WARNING):
        assert not _compat.fla_checked() and not _compat.fla_checked()
        assert not backend._importable()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "fla 0.7.0 found, the fla backend is checked against fla 0.6.0" in line and "torch backend" in line
    with pytest.raises(ImportError, match=r"fla backend needs fla 0\.6\.0 \(fla\.ops\.common\.chunk_o\.chunk_fwd_o\)"):
        _compat.chunk_fwd_o(None)


def test_the_door_names_every_entry_once():
    entries = [v for v in vars(_compat).values() if isinstance(v, _compat.FlaName)]
    assert len(entries) == len(_compat.NAMES) == len(set(entries))
    assert all(name.module.startswith("fla.") for name in entries)
