"""pytest plugin (``-p plugin``, with scripts/trl_suites on PYTHONPATH) that runs TRL's own trainer
test files offline, optionally against the HARTS trainers.

Loaded before the test modules are collected, it:

* builds / installs the offline stand-ins (``standins.py``): ``TRL_SUITES_STANDINS`` is their root
  (``HF_HUB_CACHE`` must point at ``<root>/hub``; ``run.py`` sets both), ``TRL_SUITES_REPO`` the TRL
  checkout whose generator scripts make the datasets;
* with ``HARTS_SWAP=1`` binds ``trl.GRPOTrainer`` / ``trl.GRPOConfig`` / ``RLOO*`` / ``SFT*`` / ``DPO*``
  (on ``trl`` and ``trl.trainer``) to the HARTS classes, so the tests' ``from trl import GRPOTrainer``
  gets ``HARTSGRPOTrainer``;
* reports a test that fails for want of an unprovided Hub id (a vision-language or remote-code
  checkpoint: the request is recorded, the failure is an offline cache miss) as skipped;
* with ``TRL_SUITES_TIMEOUT`` (seconds) and no pytest-timeout, fails a test that runs longer (SIGALRM);
* writes every test's outcome and one-line reason to ``TRL_SUITES_RESULTS`` (JSON, after each test).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import standins  # noqa: E402

SWAP = os.environ.get("HARTS_SWAP") == "1"
NAMES = ["GRPOTrainer", "GRPOConfig", "RLOOTrainer", "RLOOConfig", "SFTTrainer", "SFTConfig", "DPOTrainer", "DPOConfig"]
_results: dict[str, dict] = {}
_missing: set[str] = set()  # unprovided Hub ids requested during the current test
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _swap_trainers() -> None:
    """Bind TRL's public trainer / config names to the HARTS classes (the stock ones stay the bases)."""
    import trl
    import trl.trainer

    import harts_hf.trainers as harts

    for name in NAMES:
        cls = getattr(harts, f"HARTS{name}")
        for module in (trl, trl.trainer):
            setattr(module, name, cls)


def _record_missing() -> None:
    """Wrap the Hub download entry points so a request for an id without a stand-in is remembered."""
    import huggingface_hub
    import transformers.utils.hub as tf_hub

    provided = standins.provided()

    def wrap(fn):
        def inner(repo_id, *args, **kwargs):
            if isinstance(repo_id, str) and _HUB_ID.match(repo_id) and repo_id not in provided:
                if not os.path.isdir(repo_id):
                    _missing.add(repo_id)
            return fn(repo_id, *args, **kwargs)

        inner.__wrapped__ = fn
        return inner

    for module in (tf_hub, huggingface_hub):
        for name in ("hf_hub_download", "snapshot_download"):
            setattr(module, name, wrap(getattr(module, name)))
    import datasets

    datasets.load_dataset = wrap(datasets.load_dataset)


def _fill_missing_trl_names(tests: Path) -> list[str]:
    """The TRL checkout's tests may import names the installed trl lacks (the snapshot and the
    installed release differ): give each one a stand-in so the files collect. ``is_X_available``
    checks whether package X imports; anything else raises when used, failing the tests that use
    it in both modes alike. Returns the names filled."""
    import ast
    import importlib
    import importlib.util

    filled = []
    for path in sorted(tests.glob("test*_trainer.py")) + [tests / "testing_utils.py", tests / "conftest.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trl"):
                continue
            try:
                module = importlib.import_module(node.module)
            except ImportError:  # a whole module the installed trl lacks: its importer fails in both modes
                continue
            for alias in node.names:
                if hasattr(module, alias.name):
                    continue
                name = alias.name
                if m := re.fullmatch(r"is_(\w+)_available", name):
                    value = lambda pkg=m.group(1): importlib.util.find_spec(pkg) is not None  # noqa: E731
                else:

                    def value(*args, _name=f"{node.module}.{name}", **kwargs):
                        raise NotImplementedError(f"{_name} is not in the installed trl (TRL test/version mismatch)")

                setattr(module, name, value)
                filled.append(f"{node.module}.{name}")
    return filled


def pytest_configure(config: pytest.Config) -> None:
    import trl

    filled = _fill_missing_trl_names(Path(os.environ["TRL_SUITES_REPO"]) / "tests")
    root = Path(os.environ["TRL_SUITES_STANDINS"])
    standins.build(root, Path(os.environ["TRL_SUITES_REPO"]))
    standins.install_datasets(root)
    _record_missing()
    if SWAP:
        _swap_trainers()
    where = Path(trl.__file__).parent
    if "site-packages" not in str(where):
        raise pytest.UsageError(f"trl imported from {where}, not the installed package: drop trl/ from the checkout")
    config._trl_suites_header = (
        f"trl {trl.__version__} at {where}; HARTS_SWAP={int(SWAP)}; stand-ins at {root}; "
        f"names the installed trl lacks, stubbed: {filled or 'none'}"
    )


def pytest_report_header(config: pytest.Config) -> str:
    return config._trl_suites_header


# ---------------------------------------------------------------- timeout (when pytest-timeout is absent)
def _alarm(signum, frame):
    pytest.fail(f"Timeout: the test ran over {os.environ['TRL_SUITES_TIMEOUT']}s", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _missing.clear()
    seconds = int(os.environ.get("TRL_SUITES_TIMEOUT") or 0)
    if seconds and not item.config.pluginmanager.hasplugin("timeout"):
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


# ---------------------------------------------------------------- outcomes
def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _reason(exc: BaseException) -> str:
    """The exception as the traceback's last line shows it (``Type: first line of the message``)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = (yield).get_result()
    excinfo = call.excinfo
    if excinfo is None:
        return
    exc = excinfo.value
    reason = _reason(exc) if not report.skipped else str(getattr(exc, "msg", exc)).splitlines()[0][:300]
    offline_miss = any(
        type(e).__name__ in ("LocalEntryNotFoundError", "DatasetNotFoundError", "ConnectionError")
        or (isinstance(e, OSError) and "couldn't connect" in str(e))
        for e in _chain(exc)
    )
    if report.failed and _missing and offline_miss:
        reason = f"no offline stand-in for {', '.join(sorted(_missing))}"
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {reason}")
    report._trl_suites_reason = reason


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "reason": "", "when": ""})
    reason = getattr(report, "_trl_suites_reason", "")
    if report.failed and entry["outcome"] != "failed":
        entry.update(outcome="failed", reason=reason, when=report.when)
    elif report.skipped and entry["outcome"] == "passed":
        if hasattr(report, "wasxfail"):
            reason = f"xfail: {report.wasxfail}"
        entry.update(outcome="skipped", reason=reason, when=report.when)
    if report.when == "teardown":
        _write()


def _write() -> None:
    path = os.environ.get("TRL_SUITES_RESULTS")
    if path:
        tmp = f"{path}.tmp"
        Path(tmp).write_text(json.dumps(_results, indent=1))
        os.replace(tmp, path)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write()
