"""Run TRL's own trainer test files twice, stock and with the HARTS trainers swapped in, offline, and
compare the outcomes.

Why: ``HARTS*Trainer`` / ``HARTS*Config`` claim to be drop-ins for TRL's; TRL's own test suites are
the widest check of that claim. Each file runs in a ``pytest`` subprocess per mode (``plugin.py``
does the stand-ins, the swap and the recording; ``standins.py`` builds tiny hybrid models and TRL's
datasets offline); the table lists, per file, passed / failed / skipped in each mode, every test
that passes stock and fails with HARTS, and each HARTS failure's reason next to stock's outcome.

Command (from the repository root; the TRL checkout holds TRL's ``tests/`` and ``scripts/``, not its
``trl/`` package, so that the installed trl is the one tested)::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/trl_suites/run.py --trl-repo /tmp/trl_src \
        [--files grpo rloo sft dpo] [--out DIR] [-k EXPR] [--timeout 240] [--jobs 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("stock", "harts")
DEPS = ["parameterized"]  # test dependencies some TRL versions import; installed to a private dir if missing


def _private_deps(trl_repo: Path, files: list[str]) -> list[str]:
    """Install the test files' missing third-party imports (from DEPS) into ``/tmp`` and return the dir
    to put on PYTHONPATH (the project's own dependency files stay as they are)."""
    text = "".join((trl_repo / "tests" / f"test_{f}_trainer.py").read_text() for f in files)
    need = [d for d in DEPS if (f"import {d}" in text or f"from {d}" in text) and importlib.util.find_spec(d) is None]
    if not need:
        return []
    target = Path("/tmp/trl_suites_deps")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target), *need], check=True)
    return [str(target)]


def _env(out: Path, trl_repo: Path, mode: str, results: Path, timeout: int, extra_path: list[str]) -> dict:
    standins = out / "standins"
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        HF_HOME=str(out / "hf_home"),
        HF_HUB_CACHE=str(standins / "hub"),
        HF_DATASETS_CACHE=str(out / f"datasets_cache_{mode}"),
        TRL_SUITES_STANDINS=str(standins),
        TRL_SUITES_REPO=str(trl_repo),
        TRL_SUITES_RESULTS=str(results),
        TRL_SUITES_TIMEOUT=str(timeout),
        HARTS_SWAP="1" if mode == "harts" else "0",
        WANDB_DISABLED="true",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(HERE), *extra_path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    return env


def run_file(name: str, mode: str, args: argparse.Namespace, extra_path: list[str]) -> dict:
    """One test file in one mode: a pytest subprocess; returns its recorded per-test outcomes."""
    results = args.out / f"{name}_{mode}.json"
    log = args.out / f"{name}_{mode}.log"
    results.unlink(missing_ok=True)
    cmd = [sys.executable, "-P", "-m", "pytest", f"tests/test_{name}_trainer.py", "-p", "plugin", "-q", "-rfEs",
           "-p", "no:cacheprovider", "-o", "addopts="]  # fmt: skip
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", str(args.timeout)]
    if args.k:
        cmd += ["-k", args.k]
    env = _env(args.out, args.trl_repo, mode, results, args.timeout, extra_path)
    start = time.time()
    with log.open("w") as fh:
        try:  # a backstop for a hang SIGALRM cannot interrupt: the file's whole budget
            proc = subprocess.run(cmd, cwd=args.trl_repo, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                  timeout=args.file_timeout)  # fmt: skip
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    print(f"  {name:5s} {mode:6s} rc={rc} in {time.time() - start:.0f}s (log: {log})", flush=True)
    return json.loads(results.read_text()) if results.exists() else {}


def _counts(outcomes: dict) -> str:
    c = {k: sum(v["outcome"] == k for v in outcomes.values()) for k in ("passed", "failed", "skipped")}
    return f"{c['passed']} / {c['failed']} / {c['skipped']}"


def _same(a: str, b: str) -> bool:
    """Equal reasons once the class names are unified (``HARTSGRPOTrainer`` reads ``GRPOTrainer``)."""
    norm = lambda r: re.sub(r"\bHARTS(\w+(?:Trainer|Config))\b", r"\1", r)  # noqa: E731
    return norm(a) == norm(b)


def compare(all_results: dict[str, dict[str, dict]]) -> tuple[str, dict]:
    """The markdown report and its JSON summary: counts per file and mode, the regressions (pass stock,
    fail HARTS), and every HARTS failure with its reason and whether stock fails the same way."""
    lines = ["| file | stock passed / failed / skipped | HARTS passed / failed / skipped | pass stock, fail HARTS |",
             "|---|---|---|---|"]  # fmt: skip
    summary: dict = {}
    detail: list[str] = []
    for name, res in all_results.items():
        stock, harts = res["stock"], res["harts"]
        regressions = sorted(
            t for t, v in harts.items() if v["outcome"] == "failed" and stock.get(t, {}).get("outcome") == "passed"
        )
        only_one = sorted(set(stock) ^ set(harts))
        lines.append(f"| {name} | {_counts(stock)} | {_counts(harts)} | {len(regressions)} |")
        failures = []
        for t, v in sorted(harts.items()):
            if v["outcome"] != "failed":
                continue
            s = stock.get(t, {"outcome": "not run", "reason": ""})
            same = s["outcome"] == "failed" and _same(s["reason"], v["reason"])
            failures.append({"test": t, "harts_reason": v["reason"], "stock_outcome": s["outcome"],
                             "stock_reason": s["reason"], "same_failure": same})  # fmt: skip
        summary[name] = {"stock": _counts(stock), "harts": _counts(harts), "regressions": regressions,
                         "harts_failures": failures, "in_one_mode_only": only_one}  # fmt: skip
        detail.append(f"\n### {name}: pass stock, fail HARTS ({len(regressions)})\n")
        detail += [f"- `{t}`: {harts[t]['reason']}" for t in regressions] or ["- none"]
        detail.append(f"\n### {name}: HARTS failures ({len(failures)})\n")
        for f in failures:
            how = "same failure in stock" if f["same_failure"] else f"stock: {f['stock_outcome']} {f['stock_reason']}"
            detail.append(f"- `{f['test']}`: {f['harts_reason']} — {how}")
        if only_one:
            detail.append(f"\n{name}: recorded in one mode only: " + ", ".join(f"`{t}`" for t in only_one))
    return "\n".join(lines + detail) + "\n", summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-repo", type=Path, required=True, help="TRL checkout with tests/ and scripts/")
    parser.add_argument(
        "--files", nargs="+", default=["grpo", "rloo", "sft", "dpo"], choices=["grpo", "rloo", "sft", "dpo"]
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/trl_suites_out"))
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per test")
    parser.add_argument("--file-timeout", type=int, default=4 * 3600, help="seconds per file and mode (a backstop)")
    parser.add_argument("--jobs", type=int, default=2, help="pytest processes at once (stock and HARTS side by side)")
    args = parser.parse_args()
    args.trl_repo, args.out = args.trl_repo.resolve(), args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if (args.trl_repo / "trl").is_dir():
        sys.exit(f"{args.trl_repo}/trl exists: pytest would import that trl instead of the installed one; remove it")
    extra_path = _private_deps(args.trl_repo, args.files)
    # build the stand-ins once, before the pytest processes race for them
    env = _env(args.out, args.trl_repo, "stock", args.out / "unused.json", args.timeout, extra_path)
    built = subprocess.run([sys.executable, str(HERE / "standins.py"), env["TRL_SUITES_STANDINS"], "--trl-repo",
                            str(args.trl_repo)], env=env, capture_output=True, text=True)  # fmt: skip
    if built.returncode:
        sys.exit(f"building the stand-ins failed:\n{built.stderr[-4000:]}")
    commit = (args.trl_repo / "TRL_COMMIT").read_text().strip() if (args.trl_repo / "TRL_COMMIT").exists() else "?"
    print(f"TRL tests from {args.trl_repo} (commit {commit}); output in {args.out}", flush=True)
    jobs = [(name, mode) for name in args.files for mode in MODES]
    with ThreadPoolExecutor(args.jobs) as pool:
        done = dict(zip(jobs, pool.map(lambda j: run_file(*j, args, extra_path), jobs)))
    all_results = {name: {mode: done[name, mode] for mode in MODES} for name in args.files}
    report, summary = compare(all_results)
    header = (
        f"TRL tests at commit {commit}, installed trl; `-k {args.k}`\n\n"
        if args.k
        else f"TRL tests at commit {commit}\n\n"
    )
    (args.out / "report.md").write_text(header + report)
    (args.out / "summary.json").write_text(json.dumps({"trl_commit": commit, "files": summary}, indent=1))
    print(header + report)


if __name__ == "__main__":
    main()
