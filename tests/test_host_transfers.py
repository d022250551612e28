"""The layer path of a patched model makes no host transfer. On a GPU every ``.cpu()``,
``.numpy()``, ``.item()``, ``.tolist()`` and every Python ``bool``/``int``/``float``/index
conversion of a tensor waits for the device (a sync that drains the kernel queue), so host-side
bookkeeping belongs to setup (``TreeEngine(...)``, schedule compiles), never to the model run.

The trap patches those ``torch.Tensor`` methods, and the functions that make a tensor from host
data (``torch.as_tensor``, ``torch.tensor``, ``torch.from_numpy``: an upload inside the run means a
table was built there), while only the run (forward and backward) executes and records each call at its site, the first stack frame outside torch and numpy. A site inside
``harts_hf`` fails the test; the others (transformers' code: the stock model's own behaviour) are
listed alongside. The pure-PyTorch backend is forced, so every machine runs the same code.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType

import numpy as np
import pytest
import torch
from tiny_models import FAMILIES, family_forest, loss_weights, tiny_model

import harts_hf
from harts_hf import RolloutForest, patch_model, plan, tree_logprobs
from harts_hf.engine import TreeEngine
from harts_hf.modeling import logprobs
from harts_hf.modeling.logprobs import stochastic_parts

TRAPPED = ("cpu", "numpy", "item", "tolist", "__bool__", "__int__", "__float__", "__index__")
UPLOADS = ("as_tensor", "tensor", "from_numpy")
ENGINE_FAMILIES = ["qwen3_next", "nemotron_h", "kimi_linear", "lfm2"]  # GDN, Mamba2, KDA, conv-only
CHECKPOINT_FAMILIES = ["qwen3_5", "falcon_h1"]  # GDN, Mamba2
ENGINE_BUDGET = 71  # the longest trajectory (context at full price): 3 units per forest, cut at tokens 63-67

# Libraries that convert on their caller's behalf (np.asarray(t) -> Tensor.__array__ -> .numpy()):
# a call is attributed to the first frame outside them.
_LIBRARY_DIRS = tuple(os.path.dirname(module.__file__) + os.sep for module in (torch, np))
_PACKAGE_DIR = os.path.dirname(harts_hf.__file__) + os.sep


@dataclass(frozen=True)
class Site:
    """Where a trapped method was called from: the first frame outside torch and numpy."""

    file: str
    line: int
    function: str

    @property
    def ours(self) -> bool:
        return self.file.startswith(_PACKAGE_DIR)

    def __str__(self) -> str:
        file = self.file
        for root in sorted({os.path.dirname(_PACKAGE_DIR.rstrip(os.sep)), *sys.path}, key=len, reverse=True):
            if root and file.startswith(root + os.sep):  # the longest root: site-packages before the repo
                file = os.path.relpath(file, root)
                break
        return f"{file}:{self.line} ({self.function})"


def _site(frame: FrameType | None) -> Site:
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame = frame.f_back
    if frame is None:  # no Python caller outside them (e.g. torch code on an autograd worker thread)
        return Site("<torch>", 0, "?")
    return Site(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


@dataclass
class Trap:
    """The calls recorded while the trap was set: (method name, call site) each."""

    calls: list[tuple[str, Site]] = field(default_factory=list)
    active: bool = True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Setup work inside the trapped call (a schedule compile) is not recorded."""
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def sites(self, *, ours: bool) -> dict[Site, Counter[str]]:
        """Call site -> method -> calls, for the sites inside ``harts_hf`` (``ours``) or outside."""
        out: dict[Site, Counter[str]] = {}
        for method, site in self.calls:
            if site.ours == ours:
                out.setdefault(site, Counter())[method] += 1
        return out

    def report(self) -> str:
        lines = []
        for title, ours in (("harts_hf", True), ("elsewhere (the stock model: transformers, torch)", False)):
            sites = sorted(self.sites(ours=ours).items(), key=lambda item: -item[1].total())
            lines.append(f"{sum(methods.total() for _, methods in sites)} calls from {title}:")
            lines += [
                f"  {methods.total():4d} x {site}: " + ", ".join(f".{m}() {n}" for m, n in methods.most_common())
                for site, methods in sites
            ]
        return "\n".join(lines)


@contextlib.contextmanager
def trapped() -> Iterator[Trap]:
    """Record every call of the ``TRAPPED`` tensor methods made inside the block (any thread);
    the methods are restored on exit, error or not."""
    trap = Trap()
    originals = {name: torch.Tensor.__dict__.get(name) for name in TRAPPED}
    uploads = {name: getattr(torch, name) for name in UPLOADS}

    def wrap(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def recorded(*args: object, **kwargs: object) -> object:
            if trap.active:
                trap.calls.append((name, _site(sys._getframe(1))))
            return fn(*args, **kwargs)

        return recorded

    try:
        for name in TRAPPED:
            setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
        for name, fn in uploads.items():
            setattr(torch, name, wrap(name, fn))
        yield trap
    finally:
        for name, fn in uploads.items():
            setattr(torch, name, fn)
        for name, original in originals.items():
            if original is not None:
                setattr(torch.Tensor, name, original)
            elif name in torch.Tensor.__dict__:  # inherited from torch._C.TensorBase: unshadow it
                delattr(torch.Tensor, name)


def assert_no_host_transfer(run: Callable[[], object], monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    """``run()`` under the trap; fails listing every site if any call lies in ``harts_hf``. With
    ``monkeypatch``, the compile step ``tree_forward`` makes before the model runs (the forest's
    unit and trajectory rows) is setup and passes untrapped."""
    with trapped() as trap:
        if monkeypatch is not None:
            step = logprobs.compile_forest
            monkeypatch.setattr(logprobs, "compile_forest", lambda *a, **k: _untrapped(trap, step, *a, **k))
        run()
    if trap.sites(ours=True):
        pytest.fail("host transfers in the model run\n" + trap.report())


def _untrapped(trap: Trap, step: Callable[..., object], *args: object, **kwargs: object) -> object:
    with trap.paused():
        return step(*args, **kwargs)


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs the pure-PyTorch tree ops."""
    monkeypatch.setenv("HARTS_BACKEND", "torch")


def patched(family: str, *, checkpointing: bool = False) -> torch.nn.Module:
    model = patch_model(tiny_model(family))
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        assert not stochastic_parts(model), "dropout must be off: the engine reruns units"
    return model


def small_forest(seed: int = 0) -> RolloutForest:
    return RolloutForest.from_sequences(family_forest(np.random.default_rng(seed), small=True))


def check_tree_logprobs(family: str, monkeypatch: pytest.MonkeyPatch, *, checkpointing: bool) -> None:
    model = patched(family, checkpointing=checkpointing)
    forest = small_forest()
    weights = loss_weights(forest)
    assert_no_host_transfer(lambda: (tree_logprobs(model, forest) * weights).sum().backward(), monkeypatch)


def check_engine(family: str, *, checkpointing: bool) -> None:
    model = patched(family, checkpointing=checkpointing)
    forests = [small_forest(0), small_forest(1)]
    weights = [loss_weights(forest, seed) for seed, forest in enumerate(forests)]
    engine = TreeEngine(model, forests, plan(forests, world_size=1, max_tokens_per_microbatch=ENGINE_BUDGET))
    assert len(engine.units) > len(forests) and any(unit.exports.size for unit in engine.units)

    def loss_fn(lps: list[torch.Tensor]) -> torch.Tensor:
        return sum((lp * w).sum() for lp, w in zip(lps, weights))

    assert_no_host_transfer(lambda: engine.backward(loss_fn))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tree_logprobs(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check_tree_logprobs(family, monkeypatch, checkpointing=False)


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_engine(family: str) -> None:
    check_engine(family, checkpointing=False)


@pytest.mark.parametrize("family", CHECKPOINT_FAMILIES)
def test_tree_logprobs_checkpointed(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check_tree_logprobs(family, monkeypatch, checkpointing=True)


@pytest.mark.parametrize("family", CHECKPOINT_FAMILIES)
def test_engine_checkpointed(family: str) -> None:
    check_engine(family, checkpointing=True)


def test_trap_records_and_restores() -> None:
    """The trap sees methods, conversions and uploads called from this file, attributes them here,
    skips paused setup, and unpatches on error."""
    uploads_before = torch.as_tensor
    with pytest.raises(RuntimeError), trapped() as trap:
        torch.ones(()).item()
        bool(torch.ones(()))
        torch.as_tensor(np.zeros(2))
        with trap.paused():
            torch.ones(()).item()
        raise RuntimeError
    assert [method for method, _ in trap.calls] == ["item", "__bool__", "as_tensor"]
    assert all(site.file == __file__ and not site.ours for _, site in trap.calls)
    assert all(name not in torch.Tensor.__dict__ for name in TRAPPED)
    bool(torch.ones(()))
    assert len(trap.calls) == 3 and torch.as_tensor is uploads_before
