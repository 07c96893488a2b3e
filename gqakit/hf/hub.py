"""Names that are not local folders: decide at once whether the Hugging Face hub can serve them.

A missing local path that looks like a hub id (`runs/nosuch`) would otherwise make transformers retry the hub for
half a minute before its own multi-line error. Here a name is refused in one line when it is meant to be local
(its first component is a folder here), or when it is in no local Hugging Face cache and the hub is offline or
unreachable (one connection attempt with a short timeout). No network traffic beyond that attempt.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from gqakit.common.errors import GqakitError

CONNECT_TIMEOUT = 3.0  # seconds for the one connection attempt to the hub


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _cached(name: str, filename: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, filename), str)
    except Exception:  # not a valid repo id, no cache: not cached
        return False


def _reachable() -> str | None:
    """None when a TCP connection to the hub's endpoint opens, else why not."""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (443 if endpoint.scheme != "http" else 80)
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT).close()
    except OSError as e:
        return f"cannot connect to {host}: {e.strerror or type(e).__name__}"
    return None


def check_hub_name(name: str, what: str = "model folder", filename: str = "config.json") -> bool:
    """For a `name` that is not a local folder: True when only the local cache may serve it (load it with
    `local_files_only=True`), False when the hub is reachable; a one-line GqakitError when neither can."""
    first = Path(name).parts[0] if Path(name).parts else name
    if Path(first).is_dir():  # `runs/nosuch` with a ./runs here: a local path that does not exist
        raise GqakitError(f"{what} {name} does not exist; pass the path of a Hugging Face checkpoint folder")
    cached = _cached(name, filename)
    why = "the hub is offline (HF_HUB_OFFLINE)" if _offline() else _reachable()
    if why is None:
        return False
    if cached:
        return True
    raise GqakitError(f"{name} is neither a local folder nor in the Hugging Face cache, and {why}; pass the path "
                      f"of a local {what}")


def tokenizer_files_only(name: str) -> bool:
    """`local_files_only` for AutoTokenizer.from_pretrained(name): False for a local folder, else as
    `check_hub_name` decides for a tokenizer (one line where neither the folder nor the hub can serve it)."""
    if Path(name).is_dir():
        return False
    return check_hub_name(name, "tokenizer folder", "tokenizer_config.json")
