"""Locate ../shared (the real SmolLM2-135M and corpora); tests that need it skip cleanly without it."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SHARED = Path(os.environ.get("GQAKIT_SHARED", Path(__file__).resolve().parents[3] / "shared"))
PREPARE = SHARED / "scripts" / "prepare_smollm2.py"


def require_shared() -> Path:
    if not PREPARE.is_file():
        pytest.skip(f"{SHARED} is absent (set GQAKIT_SHARED to use it)")
    return SHARED


def smollm2_checkpoints(cache: Path) -> tuple[Path, Path]:
    """(MHA, GQA) Hugging Face folders of SmolLM2-135M, made once per session by the shared script.

    Set GQAKIT_SMOLLM2_DIR to a folder already holding both to skip the minute it takes.
    """
    require_shared()
    ready = os.environ.get("GQAKIT_SMOLLM2_DIR")
    root = Path(ready) if ready else cache
    if not (root / "smollm2-135m-mha" / "config.json").is_file():
        if importlib.util.find_spec("gguf") is None:
            pytest.skip("the gguf package is needed to read SmolLM2's GGUF (pip install gguf)")
        subprocess.run([sys.executable, str(PREPARE), str(root)], check=True, capture_output=True)
    return root / "smollm2-135m-mha", root / "smollm2-135m-gqa"
