"""Hugging Face hub ids for checkpoints and datasets: ``model.path=Qwen/Qwen3-0.6B`` or
``task.dataset=org/name`` read from the local Hugging Face cache, downloaded only when it is not
there and the hub may be reached.

* ``is_hub_id(path)``: ``org/name`` that is not an existing local path;
* ``local_path(path, key)``: the folder to load from: ``path`` itself when it is local, else the
  cached snapshot of the id (``HF_HUB_CACHE/models--org--name/snapshots/<commit>/``, the revision
  ``refs/main`` names; ``datasets--org--name`` for a dataset), else a download (``huggingface_hub.snapshot_download``) unless
  ``HF_HUB_OFFLINE`` is set; an id neither cached nor downloadable is a UserError naming it;
* ``cached_revision(path)``: the commit hash of the cached snapshot, recorded in provenance.

Of a model only the files a causal LM needs are downloaded (config, safetensors weights, tokenizer,
chat template): a pickled ``.bin`` is never fetched, as it is never loaded. This module resolves
where a checkpoint or dataset is; loading it is ``gspo.models.presets``' and ``gspo.tasks.dataset``'s.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gspo.errors import UserError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[\w]$")
FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")
"""What a download fetches: config and generation config, weights, tokenizer files, template."""
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                   "merges.txt", "*.model", "*.jinja", "*.tiktoken")
"""What a download fetches for ``model.tokenizer``: the tokenizer and its chat template, no weights."""
TRUE = ("1", "on", "true", "yes")


def is_hub_id(path) -> bool:
    """``org/name`` (a hub repository id) that does not exist as a local path."""
    return path is not None and bool(HUB_ID.match(str(path))) and not Path(path).exists()


def offline() -> bool:
    """``HF_HUB_OFFLINE`` is set (read now, not when huggingface_hub was imported)."""
    from huggingface_hub import constants
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE or constants.HF_HUB_OFFLINE


def _cache_dir() -> str:
    """``HF_HUB_CACHE`` (or ``HF_HOME/hub``) as set now, else huggingface_hub's default."""
    from huggingface_hub import constants
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return constants.HF_HUB_CACHE


def cached_snapshot(repo_id: str, repo_type: str = "model") -> Path | None:
    """The cached snapshot folder of ``repo_id`` at ``refs/main``, or None when not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, cache_dir=_cache_dir(),
                                      local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        return None


def local_path(path, key: str = "model.path", repo_type: str = "model", files=FILES) -> str:
    """Where to load ``path`` from: itself when local, else the id's cached (or downloaded: of a
    model, ``files``) snapshot."""
    if not is_hub_id(path):
        return str(path)
    found = cached_snapshot(str(path), repo_type)
    if found is not None:
        return str(found)
    if offline():
        raise UserError(f"{key}: {path!r} is neither a local folder nor in the Hugging Face cache "
                        f"({_cache_dir()}), and HF_HUB_OFFLINE is set: nothing is downloaded")
    return _download(str(path), key, repo_type, files)


def _download(repo_id: str, key: str, repo_type: str, files=FILES) -> str:
    from huggingface_hub import snapshot_download
    files = list(files) if repo_type == "model" else None   # a dataset: all its data files
    try:
        return snapshot_download(repo_id, repo_type=repo_type, cache_dir=_cache_dir(),
                                 allow_patterns=files)
    except Exception as err:  # noqa: BLE001 — any hub failure is the user's to fix: one line
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"{key}: {repo_id!r} is not a local folder, not in the Hugging Face cache, "
                        f"and could not be downloaded ({reason})") from None


def cached_revision(path, repo_type: str = "model") -> str | None:
    """The commit hash of the cached snapshot of hub id ``path``; None for a local path or an id
    not cached."""
    if not is_hub_id(path):
        return None
    found = cached_snapshot(str(path), repo_type)
    return found.name if found is not None else None
