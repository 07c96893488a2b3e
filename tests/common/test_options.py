"""Recipes and overrides read as their dataclass declares (gqakit.common.options)."""
import pytest

from gqakit.common.errors import GqakitError
from gqakit.common.options import load_recipe
from gqakit.uptrain.config import UptrainConfig


def _recipe(tmp_path, text: str):
    path = tmp_path / "r.yaml"
    path.write_text("model: m\noutput_dir: out\n" + text)
    return path


@pytest.mark.parametrize("text, overrides", [("mixed_precision: no\n", []), ("", ["mixed_precision=no"]),
                                             ("mixed_precision: 'no'\n", [])])
def test_mixed_precision_no_is_the_string_no(tmp_path, text, overrides):
    assert load_recipe(UptrainConfig, _recipe(tmp_path, text), overrides).mixed_precision == "no"


@pytest.mark.parametrize("word, value", [("yes", True), ("no", False), ("on", True), ("off", False), ("true", True),
                                         ("False", False)])
def test_a_bool_key_takes_yaml_1_1_words(tmp_path, word, value):
    cfg = load_recipe(UptrainConfig, _recipe(tmp_path, f"gradient_checkpointing: {word}\n"), [f"force={word}"])
    assert cfg.gradient_checkpointing is value and cfg.force is value


def test_an_override_is_blamed_as_an_override(tmp_path):
    path = _recipe(tmp_path, "lr: 1.0e-3\n")
    with pytest.raises(GqakitError) as info:
        load_recipe(UptrainConfig, path, ["mixed_precision=maybe"])
    assert str(info.value).startswith("override mixed_precision=maybe: ")
    with pytest.raises(GqakitError) as info:
        load_recipe(UptrainConfig, _recipe(tmp_path, "mixed_precision: maybe\n"))
    assert str(info.value).startswith(f"{path}: mixed_precision='maybe'")
    with pytest.raises(GqakitError, match=r"^override lr=abc: lr='abc' is not a number"):
        load_recipe(UptrainConfig, path, ["lr=abc"])


def test_window_and_sinks_are_refused_inside_the_extra_options(tmp_path):
    """window and sinks have their own flag / key; given again among a kind's other options they are refused."""
    from gqakit.attention.kinds import command_attention_options

    with pytest.raises(GqakitError, match=r"^set --window itself, not inside --attention-option$"):
        command_attention_options("sliding", 8, None, ("window=4",))
    with pytest.raises(GqakitError, match=r"set window itself, not inside attention_options$"):
        load_recipe(UptrainConfig, _recipe(tmp_path, "attention: sliding\nwindow: 8\nattention_options: {window: 4}\n")
                    ).use_options()  # what uptrain's check() and the model loader call
