"""The memory plan's parameter counts from the safetensors headers, or from config.json alone (torch-free), equal
those of the model built on the meta device, for every family of the architecture tables, tied and untied heads,
and with fields left to the class's defaults; a family the layouts do not describe falls back to the meta device."""
import json
import shutil

import pytest

from families import FAMILIES, make_model
from gqakit.hf.architectures.shapes import config_shapes
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
    if stored is None:  # no one embedding (GPTBigCode here: wte and wpe are both vocab x hidden)
        pytest.skip(f"{family}: counted on the meta device")
    _same(stored, meta)
    config = model_folder(path).config
    if (shapes := config_shapes(config)) is not None:  # from config.json alone
        _same(count_stored(str(path), config, shapes), meta)


def test_the_embedded_model_is_counted_from_its_headers():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "gqakit" / "assets" / "austen-mha-8h"
    stored, meta = _both(path)
    assert stored is not None and stored.total == 7_868_672
    _same(stored, meta)


def test_fields_left_to_the_class_and_a_config_json_alone_are_counted_without_the_meta_device(tmp_path):
    """config.json without head_dim, num_key_value_heads and tie_word_embeddings: the class's defaults fill them
    (hf/config_defaults.py); a config.json alone: the tensors it implies (hf/architectures/shapes.py)."""
    path = make_model("llama", tmp_path / "m", tie_word_embeddings=False)
    config = json.loads((path / "config.json").read_text())
    for key in ("tie_word_embeddings", "head_dim", "num_key_value_heads"):
        config.pop(key)
    (path / "config.json").write_text(json.dumps(config))
    stored, meta = _both(path)
    assert stored is not None
    _same(stored, meta)
    only = tmp_path / "config-only"
    only.mkdir()
    shutil.copy(path / "config.json", only / "config.json")
    alone = count_stored(str(only), config, config_shapes(config))
    assert alone is not None and alone.total == stored.total
    _same(alone, count_on_meta(str(only), json.dumps(config, sort_keys=True)))
    assert count_model(only).total == count_model(path).total


def test_a_family_without_a_layout_falls_back_to_the_meta_device(tmp_path):
    path = make_model("falcon", tmp_path / "m")
    only = tmp_path / "config-only"
    only.mkdir()
    shutil.copy(path / "config.json", only / "config.json")
    assert config_shapes(model_folder(only).config) is None
    assert count_model(only).total == count_model(path).total
