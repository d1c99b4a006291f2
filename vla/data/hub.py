"""Hugging Face hub ids (`org/name`) for datasets, weights and tokenizers: the cache first, the hub if reachable.

A repository already in the cache (HF_HOME / HF_HUB_CACHE, the hub's own layout) is used without a
network call. Otherwise it is downloaded, unless HF_HUB_OFFLINE=1 or the endpoint cannot be reached
(checked once, in a few seconds, instead of huggingface_hub's minute of retries); then HubUnavailableError
says how to get the files. Everything goes through huggingface_hub, so its cache is LeRobot's and openpi's.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from vla.data.errors import DatasetError

CONNECT_TIMEOUT_S = 3.0


class HubUnavailableError(DatasetError, FileNotFoundError):
    """A hub id is neither in the cache nor downloadable from here."""


def looks_like_hub_id(text: str) -> bool:
    """`org/name` (one slash, no leading . / ~, no spaces) that is not an existing local path."""
    parts = text.split("/")
    return (
        len(parts) == 2
        and not text.startswith((".", "~"))
        and all(p and p.strip() == p and " " not in p for p in parts)
        and not Path(text).exists()
    )


def offline_reason() -> str | None:
    """Why the hub cannot be used from here (HF_HUB_OFFLINE, or the endpoint unreachable), or None."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    return _endpoint_unreachable()


@functools.lru_cache(maxsize=1)
def _endpoint_unreachable() -> str | None:
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"{host}:{port} cannot be reached ({exc.strerror or type(exc).__name__})"


def snapshot(
    repo_id: str,
    *,
    repo_type: str,
    revision: str | None = None,
    allow_patterns: list[str] | None = None,
    config_key: str,
) -> Path:
    """The local directory of `repo_id` at `revision` (a cached snapshot, or one downloaded now).

    repo_type: "dataset" or "model"; config_key: the setting named in errors (e.g. data.repo_id).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(
                repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns, local_files_only=True
            )
        )
    except LocalEntryNotFoundError:
        pass
    reason = offline_reason()
    if reason is not None:
        at = f" at revision {revision}" if revision else ""
        raise HubUnavailableError(
            f"{config_key}={repo_id}{at}: not in the Hugging Face cache ({cache_dir()}) and {reason}. On a "
            f"machine with access run `hf download {repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''}"
            f"{f' --revision {revision}' if revision else ''}` and copy its cache over (or set HF_HUB_CACHE), "
            "or point the setting at a local directory."
        )
    return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns))


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


__all__ = ["HubUnavailableError", "cache_dir", "looks_like_hub_id", "offline_reason", "snapshot"]
