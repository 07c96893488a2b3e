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
    from gqakit.common.attention_kinds import command_attention_options

    with pytest.raises(GqakitError, match=r"^set --window itself, not inside --attention-option$"):
        command_attention_options("sliding", 8, None, ("window=4",))
    with pytest.raises(GqakitError, match=r"set window itself, not inside attention_options$"):
        load_recipe(UptrainConfig, _recipe(tmp_path, "attention: sliding\nwindow: 8\nattention_options: {window: 4}\n")
                    ).use_options()  # what uptrain's check() and the model loader call


# --- the help: each flag's default printed from its field -------------------------------------------------------

import argparse  # noqa: E402
import dataclasses  # noqa: E402

from gqakit.common.options import add_arguments, option  # noqa: E402


@dataclasses.dataclass(frozen=True)
class _Toy:
    path: str = option(flag="PATH", help="a positional")
    name: str = option(help="required: no default to show")
    steps: int = option(600, help="steps")
    lr: float = option(0.05, help="step size")
    dtype: str = option("float32", choices=("float32", "bfloat16"), help="precision")
    lengths: tuple[int, ...] = option((1024, 2048), help="lengths")
    extra: tuple[str, ...] = option((), help="repeatable")
    window: int | None = option(None, help="window")
    context: int | None = option(None, help="context", default_text="min(512, the model's context)")
    force: bool = option(False, help="replace")
    progress: bool = option(True, flag="-q/--quiet", invert=True, help="no progress bar")
    greedy: bool = option(True, flag="--sample", invert=True, help="sample", default_text="greedy")
    share: float = option(0.5, help="50%% of it")
    seen: int = option(7, remember=True, help="remembered")
    part: int | None = option(None, help="part", default_text="10% of the tokens")


def _helps(cls=_Toy, **kwargs) -> dict[str, str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls, **kwargs)
    return {a.dest: a.help for a in parser._actions if a.dest != "help"}


def test_the_help_ends_with_the_fields_default():
    helps = _helps()
    assert helps["steps"] == "steps (default: 600)"
    assert helps["lr"] == "step size (default: 0.05)"
    assert helps["dtype"] == "precision (default: float32)"
    assert helps["seen"] == "remembered (default: 7)"  # argparse's default is None, the field's is printed


def test_a_tuple_default_is_printed_as_the_flag_takes_it_and_an_empty_one_not_at_all():
    helps = _helps()
    assert helps["lengths"] == "lengths (default: 1024,2048)"
    assert helps["extra"] == "repeatable"


def test_no_default_is_printed_for_none_a_required_option_a_positional_or_a_bool():
    helps = _helps()
    assert helps["window"] == "window"
    assert helps["name"] == "required: no default to show"
    assert helps["path"] == "a positional"
    assert helps["force"] == "replace" and helps["progress"] == "no progress bar"


def test_a_default_in_words():
    helps = _helps()
    assert helps["context"] == "context (default: min(512, the model's context))"
    assert helps["greedy"] == "sample (default: greedy)"  # a bool may say it in words too


def test_the_printed_help_shows_it_verbatim():
    parser = argparse.ArgumentParser(prog="toy")
    add_arguments(parser, _Toy)
    text = " ".join(parser.format_help().split())
    assert "50% of it (default: 0.5)" in text  # the help's own % is argparse's to format, as before
    assert "part (default: 10% of the tokens)" in text  # the default's is not
    assert "--lengths LENGTHS lengths (default: 1024,2048)" in text


def test_defaults_can_be_left_to_the_help_strings():
    assert _helps(show_defaults=False)["steps"] == "steps"
