"""A Hugging Face model folder's small files: its config.json, and the side files a derived checkpoint carries
over (tokenizer, generation config, chat template, the pretraining record)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from gqakit.common.errors import GqakitError
from gqakit.hf.checkpoint import INDEX, SINGLE

# Files that a derived checkpoint rewrites or must not carry over; everything else is copied.
_NOT_COPIED = {"config.json", "README.md", INDEX, SINGLE}
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")


def read_config(model_dir: Path) -> dict:
    """The folder's config.json as a dict, or a one-line error that says what is wrong with the folder."""
    if not model_dir.is_dir():
        raise GqakitError(f"model folder {model_dir} does not exist; pass the path of a Hugging Face checkpoint folder")
    path = model_dir / "config.json"
    if not path.is_file():
        raise GqakitError(f"{model_dir} has no config.json; point at a Hugging Face checkpoint folder")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise GqakitError(f"{path} is not valid JSON ({e}); repair or re-save the config") from None
    if not isinstance(config, dict):
        raise GqakitError(f"{path} is not a JSON object; repair or re-save the config")
    return config


def copy_side_files(model_dir: Path, dest: Path) -> list[str]:
    """Copy tokenizer, generation config, chat template and other small files; not weights or card."""
    copied = []
    for path in sorted(model_dir.iterdir()):
        if path.name.startswith(".") or path.name in _NOT_COPIED or path.name.endswith(_NOT_COPIED_SUFFIXES):
            continue
        if path.name.startswith("pytorch_model") or not path.is_file():  # folders, pipes, sockets
            continue
        shutil.copy2(path, dest / path.name)
        copied.append(path.name)
    return copied
