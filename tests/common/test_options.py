"""Recipes and overrides read as their dataclass declares (gqakit.common.options)."""
import pytest

from gqakit.common.errors import GqakitError
from gqakit.common.recipes import load_recipe
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


def test_an_extra_option_without_a_value_is_named_not_dropped(tmp_path):
    """`{dilation:2}` in YAML is the key 'dilation:2' with no value, and `--attention-option dilation=` gives none:
    the name is checked and the missing value refused, where both used to be dropped unseen."""
    from gqakit.attention.kinds import command_attention_options

    with pytest.raises(GqakitError, match=r"takes no dilation:2 \(no kind takes it\)"):
        load_recipe(UptrainConfig, _recipe(tmp_path, "attention: sliding\nwindow: 8\nattention_options: {dilation:2}\n")
                    ).use_options()
    with pytest.raises(GqakitError, match=r"^--attention-option dilation has no value; write dilation=VALUE"):
        command_attention_options("sliding", 8, None, ("dilation=",))
    with pytest.raises(GqakitError, match=r"takes no --attention-option bogus"):
        command_attention_options("sparse", None, None, ("bogus=",))
    assert command_attention_options("sliding", 8, None, ("dilation=2",)) == {"window": 8, "dilation": 2}


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


# --- nested options: a field that holds another options dataclass, its flags prefixed ---------------------------

from gqakit.common.errors import opt, spelled  # noqa: E402
from gqakit.common.options import (check_fields, flags, from_args, options_given, replace,  # noqa: E402
                                   typed, typed_values)
from gqakit.common.recipes import from_dict, to_dict  # noqa: E402


@dataclasses.dataclass(frozen=True)
class _Train:
    """The nested options (convert's TransferOptions in small): real defaults, remembered flags."""

    steps: int = option(600, at_least=1, remember=True, help="most training steps")
    dtype: str = option("float32", choices=("float32", "bfloat16"), remember=True, help="training precision")
    lr: float = option(0.05, above=0)  # no flag: a recipe key only

    def __post_init__(self):
        check_fields(self)
        if self.steps > 10_000:
            raise GqakitError(f"{opt('steps', str(self.steps))} is too many; give at most 10000")


@dataclasses.dataclass(frozen=True)
class _Job:
    """The command's options (convert's ConvertConfig in small); its field `train` has the flags --transfer-*."""

    model: str = option(flag="MODEL", help="model folder")
    method: str = option("mean", choices=("mean", "transfer"), help="merge method")
    seed: int = option(0, help="seed")
    train: _Train = option(default_factory=_Train, prefix="transfer")
    given: frozenset = frozenset()  # typed on the command line

    def __post_init__(self):
        check_fields(self)
        if self.method != "transfer":
            ignored = [name for name in options_given(self, self.given) if name.startswith("train.")]
            if ignored:
                raise GqakitError(f"{opt(ignored[0])} is used only by {opt('method')} transfer; drop it")


def _job_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="job")
    add_arguments(parser, _Job)
    return parser


def _job(*argv: str) -> _Job:
    """As the command line runs it (gqakit.cli._dispatch): parsed, built inside the command's flag spellings."""
    args = _job_parser().parse_args(argv)
    with spelled(flags(_Job)):
        return from_args(_Job, args, given=typed(_Job, args))


def test_nested_options_are_prefixed_flags():
    assert flags(_Job) == {"model": "MODEL", "method": "--method", "seed": "--seed", "train.steps": "--transfer-steps",
                           "train.dtype": "--transfer-dtype"}
    text = " ".join(_job_parser().format_help().split())
    assert "--transfer-steps TRANSFER_STEPS most training steps (default: 600)" in text
    assert "--transfer-dtype {float32,bfloat16} training precision (default: float32)" in text
    assert "lr" not in text  # a nested field without help has no flag


def test_nested_flags_parse_into_the_nested_dataclass():
    assert _job("m", "--method", "transfer", "--transfer-steps", "10").train == _Train(steps=10)
    assert _job("m", "--method", "transfer", "--transfer-dtype", "bfloat16").train == _Train(dtype="bfloat16")
    assert _job("m").train == _Train()  # untouched: the nested defaults


def test_typed_names_a_nested_flag_by_its_dotted_path():
    args = _job_parser().parse_args(["m", "--transfer-steps", "600", "--method", "transfer"])
    assert typed(_Job, args) == {"train.steps"}  # typed at its default value
    assert typed_values(_Job, args) == {"train.steps": 600}
    assert typed(_Job, _job_parser().parse_args(["m"])) == frozenset()


def test_a_nested_option_that_the_method_ignores_is_refused_by_its_flag():
    with pytest.raises(GqakitError, match=r"^--transfer-steps is used only by --method transfer; drop it$"):
        _job("m", "--transfer-steps", "600")  # even at its default value: typed
    with pytest.raises(GqakitError, match=r"^--transfer-dtype is used only by --method transfer; drop it$"):
        _job("m", "--transfer-dtype", "bfloat16")
    with pytest.raises(GqakitError, match=r"^train.steps is used only by method transfer; drop it$"):
        _Job(model="m", train=_Train(steps=5))  # from Python: the dotted path, set to another value than its default
    assert _Job(model="m", train=_Train(steps=600)).train.steps == 600  # at the default: nothing to refuse
    assert options_given(_Job(model="m", method="transfer", seed=1, train=_Train(dtype="bfloat16"))) == [
        "model", "method", "seed", "train.dtype"]  # a required option is always given


def test_the_nested_dataclasses_own_errors_name_the_prefixed_flag():
    with pytest.raises(GqakitError, match=r"^--transfer-steps 20000 is too many; give at most 10000$"):
        _job("m", "--method", "transfer", "--transfer-steps", "20000")
    with pytest.raises(GqakitError, match=r"^train.steps=0 must be >= 1$") as info:
        _job("m", "--method", "transfer", "--transfer-steps", "0")
    assert info.value.field == "train.steps"  # a FieldError names the dotted path: flags(_Job) spells it
    assert flags(_Job)[info.value.field] == "--transfer-steps"
    with pytest.raises(GqakitError, match=r"^steps=20000 is too many"):
        _Train(steps=20000)  # on its own, it names its own field
    with pytest.raises(GqakitError, match=r"^train=\{'steps': 1\} must be _Train options$"):
        _Job(model="m", train={"steps": 1})


def test_recipes_write_nested_options_as_a_mapping_or_dotted_keys(tmp_path):
    assert from_dict(_Job, {"model": "m", "method": "transfer", "train": {"steps": 10}}).train == _Train(steps=10)
    assert from_dict(_Job, {"model": "m", "method": "transfer", "train.steps": 10}).train == _Train(steps=10)
    both = {"model": "m", "method": "transfer", "train": {"steps": 10, "lr": 0.1}, "train.steps": 20}
    assert from_dict(_Job, both).train == _Train(steps=20, lr=0.1)  # the dotted key lays over the mapping
    path = tmp_path / "job.yaml"
    path.write_text("model: m\nmethod: transfer\ntrain:\n  steps: 1e3\n  dtype: bfloat16\n")
    assert load_recipe(_Job, path).train == _Train(steps=1000, dtype="bfloat16")  # YAML 1.1's 1e3 read as int
    assert load_recipe(_Job, path, ["train.steps=7"]).train == _Train(steps=7, dtype="bfloat16")
    job = _Job(model="m", method="transfer", train=_Train(steps=3))
    assert to_dict(job)["train"] == {"steps": 3, "dtype": "float32", "lr": 0.05}
    assert from_dict(_Job, to_dict(job)) == job


def test_recipe_errors_name_the_nested_key_and_where_it_came_from(tmp_path):
    with pytest.raises(GqakitError, match=r"^recipe: unknown key 'train.stpes'; did you mean 'train.steps'\?$"):
        from_dict(_Job, {"model": "m", "train": {"stpes": 1}})
    with pytest.raises(GqakitError, match=r"^recipe: unknown key 'train.stpes'; did you mean 'train.steps'\?$"):
        from_dict(_Job, {"model": "m", "train.stpes": 1})
    with pytest.raises(GqakitError, match=r"^recipe: train=5 must be a mapping of key: value$"):
        from_dict(_Job, {"model": "m", "train": 5})
    with pytest.raises(GqakitError, match=r"^recipe: train.steps='many' must be an integer$"):
        from_dict(_Job, {"model": "m", "train": {"steps": "many"}})
    with pytest.raises(GqakitError, match=r"^recipe: train.steps=0 must be >= 1$"):
        from_dict(_Job, {"model": "m", "method": "transfer", "train": {"steps": 0}})
    with pytest.raises(GqakitError, match=r"^recipe: train.steps=20000 is too many"):
        from_dict(_Job, {"model": "m", "method": "transfer", "train": {"steps": 20000}})
    path = tmp_path / "job.yaml"
    path.write_text("model: m\nmethod: transfer\n")
    with pytest.raises(GqakitError, match=r"^override train.steps=0: train.steps=0 must be >= 1$"):
        load_recipe(_Job, path, ["train.steps=0"])
    with pytest.raises(GqakitError, match=r"^override train=\{steps: 0\}: train.steps=0 must be >= 1$"):
        load_recipe(_Job, path, ["train={steps: 0}"])


def test_replace_takes_nested_options_by_dotted_path():
    job = _Job(model="m", method="transfer")
    assert replace(job, {"train.steps": 5, "seed": 1}) == _Job(model="m", method="transfer", seed=1,
                                                              train=_Train(steps=5))


def test_a_nested_field_takes_long_flags_only_and_no_help_of_its_own():
    @dataclasses.dataclass(frozen=True)
    class Short:
        quiet: bool = option(False, flag="-q/--quiet", help="quiet")

    @dataclasses.dataclass(frozen=True)
    class Holder:
        inner: Short = option(default_factory=Short, prefix="inner")

    with pytest.raises(TypeError, match="long flags only"):
        flags(Holder)
    with pytest.raises(TypeError, match="no help or flag"):
        option(default_factory=Short, prefix="inner", help="the inner options")
