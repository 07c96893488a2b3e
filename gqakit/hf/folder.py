"""A Hugging Face model folder, read once: its config.json, its safetensors headers, its side files (tokenizer,
generation config, chat template, the pretraining record that a derived checkpoint carries over).

`model_folder(path)` returns the same `ModelFolder` for a folder whose config.json and weight index (or single
weights file) have not changed, so a command that looks at a model from several places (recipe checks, the
memory plan, the loaders) reads and validates it once.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import shutil
from pathlib import Path

from gqakit.common.errors import GqakitError
from gqakit.hf.headers import INDEX, SINGLE, TensorInfo, scan_checkpoint

PRETRAINING_RECORD = "pretraining.json"  # what the model was trained on: the GQA paper's uptraining budget
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# An uptraining run's records of itself (uptrain/run/final.py RUN_FILES): they describe that run, not a model derived
# from its output
RUN_RECORDS = ("uptraining.json", "uptrain-recipe.json", "metrics.csv", "loss.png")
# Files that a derived checkpoint rewrites or must not carry over; everything else is copied.
_NOT_COPIED = {"config.json", "README.md", INDEX, SINGLE, *RUN_RECORDS}
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack",
                        ".py")  # custom code (auto_map) would run on the derived weights: the output is the stock class


def read_config(model_dir: Path) -> dict:
    """The folder's config.json as a dict, or a one-line error that says what is wrong with the folder."""
    if model_dir.exists() and not model_dir.is_dir():
        raise GqakitError(f"{model_dir} is a file, not a model folder; pass the folder that holds config.json and "
                          "the safetensors weights")
    if not model_dir.is_dir():
        raise GqakitError(f"model folder {model_dir} does not exist; pass the path of a Hugging Face checkpoint folder")
    path = model_dir / "config.json"
    if not path.is_file():
        if any(model_dir.glob("*.gguf")):
            raise GqakitError(f"{model_dir} holds a GGUF file but no config.json; gqakit reads Hugging Face "
                              "safetensors checkpoints: convert the GGUF to one first (e.g. with transformers' "
                              "from_pretrained(..., gguf_file=...) and save_pretrained)")
        raise GqakitError(f"{model_dir} has no config.json; point at a Hugging Face checkpoint folder")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise GqakitError(f"{path} is not valid JSON ({e}); repair or re-save the config") from None
    if not isinstance(config, dict):
        raise GqakitError(f"{path} is not a JSON object; repair or re-save the config")
    return config


LICENCE_KEYS = ("license", "license_name", "license_link")  # a model card's licence, which derived models keep


def card_licence(model_dir: Path) -> dict:
    """The licence keys of a folder's model card (README.md's YAML front matter), {} without them."""
    try:
        text = (Path(model_dir) / "README.md").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    end = text.find("\n---", 3)
    if not text.startswith("---") or end < 0:
        return {}
    import yaml

    try:
        meta = yaml.safe_load(text[3:end])
    except yaml.YAMLError:
        return {}
    return {k: meta[k] for k in LICENCE_KEYS if k in meta} if isinstance(meta, dict) else {}


def custom_code(config: dict) -> str | None:
    """The Auto class that config.json maps to custom code (`auto_map`), which gqakit never runs (transformers,
    without trust_remote_code, builds the stock class of its model_type instead); None for a stock model."""
    return next((k for k in sorted(config.get("auto_map") or {}) if k.startswith("AutoModel")), None)


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


class ModelFolder:
    """A checkpoint folder's config (read and checked at once) and, on first use, its tensors (headers only)."""

    def __init__(self, path: Path):
        self.path = path
        self._config = read_config(path)

    @property
    def config(self) -> dict:
        """config.json as a dict (a copy: the folder's own stays as read)."""
        return copy.deepcopy(self._config)

    @functools.cached_property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor's dtype, shape and place in the safetensors files, all checked present and in bounds."""
        return scan_checkpoint(self.path)

    @property
    def has_tokenizer(self) -> bool:
        return any((self.path / name).is_file() for name in TOKENIZER_FILES)

    @functools.cached_property
    def pretraining_tokens(self) -> int | None:
        """The pretraining token count the folder records (`pretraining.json`), if any."""
        record = self.path / PRETRAINING_RECORD
        if not record.is_file():
            return None
        tokens = json.loads(record.read_text()).get("pretraining_tokens")
        return int(tokens) if tokens else None


def model_folder(path: str | Path) -> ModelFolder:
    """The folder at `path`, read once per process while its config.json and weight index stay the same."""
    path = Path(path)
    stamp = []
    for name in ("config.json", INDEX, SINGLE):
        try:
            stat = os.stat(path / name)
        except OSError:
            stat = None
        stamp.append(None if stat is None else (stat.st_mtime_ns, stat.st_size, stat.st_ino))
    if stamp[0] is None:
        return ModelFolder(path)  # missing or unreadable: read_config raises the one-line error
    return _cached(path, path.resolve(), tuple(stamp))


@functools.lru_cache(maxsize=16)
def _cached(path: Path, resolved: Path, stamp: tuple) -> ModelFolder:
    return ModelFolder(path)  # keyed by the resolved path too: the same name elsewhere is another folder
