"""Where a recipe's YAML comes from: a file, a directory holding ``config.yaml`` (what a Hub repo
publishes: ``config.yaml`` + a model-card ``README.md``), or a Hub repo id with those files."""

from __future__ import annotations

from pathlib import Path

__all__ = ["resolve_config"]


def _is_repo_id(ref: str) -> bool:
    """``owner/name`` as the Hub spells it, and no file name: only such a missing path is looked up
    on the Hub, so a mistyped ``nope.yaml`` is reported missing rather than as a bad repo id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if ref.count("/") != 1 or ref.endswith((".yaml", ".yml", ".json")):
        return False
    try:
        validate_repo_id(ref)
    except HFValidationError:
        return False
    return True


def _download_config(repo_id: str) -> Path:
    """``config.yaml`` of Hub repo ``repo_id``. The Hub client's retry warnings are silenced and its
    errors (offline, no such repo or file, gated; several lines each) become one line."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import logging as hub_logging

    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()
    try:
        return Path(hf_hub_download(repo_id=repo_id, filename="config.yaml"))
    except OSError as err:
        raise FileNotFoundError(
            f"--config {repo_id}: no such file or directory, and config.yaml of Hub repo {repo_id} cannot be "
            f"downloaded ({type(err).__name__}); check the path, the repo id and the network"
        ) from err
    finally:
        hub_logging.set_verbosity(verbosity)


def resolve_config(ref: str | Path) -> Path:
    """A YAML file: ``ref`` itself, ``ref/config.yaml``, or ``config.yaml`` of Hub repo ``ref`` (a
    missing path in the ``owner/name`` shape); anything else is a one-line FileNotFoundError."""
    path = Path(ref)
    if path.is_file():
        return path
    if path.is_dir():
        if not (path / "config.yaml").is_file():
            raise FileNotFoundError(f"--config {ref}: a directory without config.yaml")
        return path / "config.yaml"
    if not _is_repo_id(str(ref)):
        raise FileNotFoundError(f"--config {ref}: no such file or directory")
    return _download_config(str(ref))
