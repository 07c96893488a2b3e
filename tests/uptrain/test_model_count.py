"""The memory plan's parameter counts from the safetensors headers (torch-free) equal those of the model built on
the meta device, for every family of the architecture tables, tied and untied heads; where the headers cannot say
(a config.json alone, a tied head config.json does not declare), the count falls back to the meta device."""
import json
import shutil

import pytest

from families import FAMILIES, make_model
from gqakit.uptrain.model_count import count_model, count_on_meta, count_stored
from gqakit.hf.folder import model_folder


def _per_tensor(m):
    """The count's per-tensor rows with whether each mode trains them, as a multiset (orders differ)."""
    modes = sorted(m.trains)
    return sorted((row, *(None if m.trains[k] is None else m.trains[k][i] for k in modes))
                  for i, row in enumerate(m.rows))


def _both(path):
    folder = model_folder(path)
    config = folder.config
    stored = count_stored(str(path), config, {n: i.shape for n, i in folder.tensors.items()})
    return stored, count_on_meta(str(path), json.dumps(config, sort_keys=True))


def _same(stored, meta):
    fields = ("architecture", "total", "trainable", "root", "layer", "layer_trainable", "linear", "linear_trainable",
              "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")
    assert {f: getattr(stored, f) for f in fields} == {f: getattr(meta, f) for f in fields}
    assert _per_tensor(stored) == _per_tensor(meta)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tied", [False, True])
def test_header_count_equals_the_meta_device_count(family, tied, tmp_path):
    path = make_model(family, tmp_path / family, tie_word_embeddings=tied)
    stored, meta = _both(path)
    if stored is None:  # the header count declines where config.json leaves something to the class's default
        pytest.skip(f"{family}: counted on the meta device")
    _same(stored, meta)


def test_the_embedded_model_is_counted_from_its_headers():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "gqakit" / "assets" / "austen-mha-8h"
    stored, meta = _both(path)
    assert stored is not None and stored.total == 7_868_672
    _same(stored, meta)


def test_an_undeclared_tie_or_no_weights_falls_back_to_the_meta_device(tmp_path):
    path = make_model("llama", tmp_path / "m", tie_word_embeddings=False)
    config = json.loads((path / "config.json").read_text())
    config.pop("tie_word_embeddings")
    (path / "config.json").write_text(json.dumps(config))
    folder = model_folder(path)
    assert count_stored(str(path), folder.config, {n: i.shape for n, i in folder.tensors.items()}) is None
    only = tmp_path / "config-only"
    only.mkdir()
    shutil.copy(path / "config.json", only / "config.json")
    assert count_model(only).total == count_model(path).total
