"""The embedded reference model: a small multi-head Llama trained on public-domain text.

It ships inside the package so that the demo, the tests and the uptraining experiments have a real
(if small) language model to work on without any download.
"""
from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
REFERENCE_MODEL = ASSETS / "austen-mha-8h"
HELDOUT_TEXT = ASSETS / "heldout_emma.txt"


def reference_model_path() -> Path:
    """Folder of the embedded MHA model; a clear error when the package was installed without it."""
    if not (REFERENCE_MODEL / "config.json").is_file():
        raise FileNotFoundError(
            f"the embedded reference model is missing at {REFERENCE_MODEL}; reinstall gqakit, "
            "or rebuild it with `python -m gqakit.reference.train recipes/reference_model.yaml`"
        )
    return REFERENCE_MODEL
