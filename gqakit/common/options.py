"""YAML recipes that map one-to-one onto a command's frozen dataclass, and the field checks they share.

A field's type comes from its annotation and its range from `option(...)`, declared once beside it:

    lr: float = option(3e-4, above=0)
    betas: tuple[float, ...] = option((0.9, 0.95), length=2, at_least=0, below=1)
    attention: str = option("default", choices=("default", "tiled", "sliding", "sinks"))

`check_fields(obj)` (call it from `__post_init__`) refuses, in one line, a value of the wrong type (a
bool where a number belongs, a float where an int does, a string where a bool does), a non-finite
number, a value out of range or not among the choices, and a tuple of the wrong length.

A command's flag is declared on its field too, once: `option(..., help="...")` makes `--field-name` (or the
`flag` given: "-o/--output-dir", a positional "MODEL_DIR", "-q/--quiet" with `invert=True` for a bool the flag
clears); `add_arguments(parser, cls)` adds every such flag to an argparse parser, `from_args(cls, args)` builds
the dataclass from the parsed flags, and `flags(cls)` says how the command line spells each field (for
`errors.spelled`, so that errors name the flag the user typed). The help ends with the field's default, as
argparse's "(default: X)", so a help string never repeats it; where the default is None because another option or
the model decides it, `default_text` says it in words (`option(None, default_text="min(512, the model's context)")`).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from pathlib import Path

import yaml

from gqakit.common.errors import GqakitError

_BOUNDS = {"above": (">", float.__gt__), "at_least": (">=", float.__ge__),
           "below": ("<", float.__lt__), "at_most": ("<=", float.__le__)}


def option(default=dataclasses.MISSING, *, above=None, at_least=None, below=None, at_most=None, choices=None,
           length=None, help=None, flag=None, metavar=None, parse=None, invert=False, repeat=None,
           remember=False, default_text=None):
    """A dataclass field with its allowed values: numeric bounds (each element's, for a tuple), choices, length;
    and, with `help`, its command-line flag (see the module docstring; `parse` turns the flag's text into the
    field's value, in `from_args`, so that its GqakitError is one line rather than argparse's usage; a tuple
    field's flag may be repeated, `repeat`, by default when it has no `parse`; `remember`: the flag's absence is
    kept, so the command can tell a typed default value from an untouched one: see `typed`; `default_text`: the
    default in words, shown in the help instead of the field's value, for a default that another option or the
    model decides, e.g. "min(512, the model's context)")."""
    bounds = {k: v for k, v in (("above", above), ("at_least", at_least), ("below", below), ("at_most", at_most))
              if v is not None}
    rule = {"bounds": bounds, "choices": tuple(choices) if choices else None, "length": length}
    metadata = {"rule": rule}
    if help is not None:
        metadata["cli"] = {"help": help, "flag": flag, "metavar": metavar, "parse": parse, "invert": invert,
                           "repeat": parse is None if repeat is None else repeat, "remember": remember,
                           "default_text": default_text}
    return dataclasses.field(default=default, metadata=metadata)


def _cli_fields(cls) -> list[tuple[dataclasses.Field, dict]]:
    return [(f, f.metadata["cli"]) for f in dataclasses.fields(cls) if "cli" in f.metadata]


def _spellings(f: dataclasses.Field, cli: dict) -> list[str]:
    return (cli["flag"] or f"--{f.name.replace('_', '-')}").split("/")


def flags(cls) -> dict[str, str]:
    """field name -> how the command line spells it (its long flag, or a positional's metavar)."""
    return {f.name: max(_spellings(f, cli), key=len) for f, cli in _cli_fields(cls)}


def add_arguments(parser, cls, show_defaults: bool = True) -> None:
    """Add the flag of every field of `cls` declared with `option(help=...)` to an argparse parser; each help ends
    with the field's default (`show_defaults`)."""
    hints = _hints(cls)
    for f, cli in _cli_fields(cls):
        names = _spellings(f, cli)
        _, kind = _kind(hints[f.name])
        default = None if f.default is dataclasses.MISSING else f.default
        kwargs = {"help": cli["help"] + (_default_note(f, cli, kind) if show_defaults else "")}
        if kind is bool:
            kwargs.update(action="store_false" if cli["invert"] else "store_true", dest=f.name)
            if cli["remember"]:
                kwargs["default"] = None
        else:
            item = typing.get_args(kind)[0] if typing.get_origin(kind) is tuple else kind
            # a `parse` runs in from_args, inside the command's error handling: argparse would print usage instead
            kwargs["type"] = item if item in (int, float) and cli["parse"] is None else str
            if f.metadata["rule"]["choices"]:
                kwargs["choices"] = f.metadata["rule"]["choices"]
            if cli["metavar"]:
                kwargs["metavar"] = cli["metavar"]
            if typing.get_origin(kind) is tuple and not names[0].startswith("-"):
                kwargs["nargs"] = "+"
            elif typing.get_origin(kind) is tuple and cli["repeat"]:
                kwargs.update(action="append", default=None)
        if names[0].startswith("-"):
            kwargs.setdefault("default", None if cli["parse"] or cli["remember"] else default)
            if kind is not bool:
                kwargs["dest"] = f.name
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                kwargs["required"] = True
            parser.add_argument(*names, **kwargs)
        else:
            kwargs.setdefault("metavar", names[0])
            parser.add_argument(f.name, **kwargs)


def _default_note(f: dataclasses.Field, cli: dict, kind) -> str:
    """The help's " (default: X)", from the field's default (or its `default_text`): none for a bool flag (the flag
    itself says what it turns on), a required option, or a default of None or () (nothing)."""
    shown = cli["default_text"]
    if shown is None and kind is not bool:
        value = (f.default if f.default is not dataclasses.MISSING else
                 f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        if value is not None and value != ():
            shown = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
    return "" if shown is None else f" (default: {shown})".replace("%", "%%")  # argparse formats help with %


def from_args(cls, args, **given):
    """`cls` from parsed flags (`add_arguments`), with `given` fields set by the caller."""
    values = {f.name: getattr(args, f.name) for f, _ in _cli_fields(cls)}
    for f, cli in _cli_fields(cls):
        value = values[f.name]
        if value is not None and cli["parse"] is not None:  # the flag's text, parsed here (GqakitError: one line)
            value = [cli["parse"](v) for v in value] if isinstance(value, list) else cli["parse"](value)
            if cli["repeat"]:  # each use parsed to several values
                value = [item for part in value for item in part]
        if isinstance(value, list):
            value = tuple(value)
        elif value is None and typing.get_origin(_kind(_hints(cls)[f.name])[1]) is tuple:
            value = f.default if f.default is not dataclasses.MISSING else ()  # a repeatable flag not given
        elif value is None and (cli["parse"] is not None or cli["remember"]):
            value = f.default  # a parsed or remembered flag not given
        values[f.name] = value
    return cls(**{**values, **given})


def typed(cls, args) -> frozenset[str]:
    """The `remember` fields of `cls` whose flags were typed on the command line (even at their default value)."""
    return frozenset(typed_values(cls, args))


def typed_values(cls, args) -> dict:
    """{field: value} of the `remember` flags typed on the command line (to lay over a recipe)."""
    return {f.name: getattr(args, f.name) for f, cli in _cli_fields(cls)
            if cli["remember"] and getattr(args, f.name, None) is not None}


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _kind(hint) -> tuple[bool, object]:
    """(None allowed, the type underneath) of an annotation such as `int | None`."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return True, rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]
    return False, hint


def _type_problem(value, kind) -> str | None:
    """Why `value` is not a `kind` (None when it is), in words a recipe's author reads."""
    if kind is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if kind is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number"
        return None if math.isfinite(value) else "must be a finite number"
    if kind is str:
        return None if isinstance(value, str) else "must be a string"
    if typing.get_origin(kind) is tuple:
        if not isinstance(value, tuple):
            return "must be a list"
        inner = typing.get_args(kind)[0]
        problems = [_type_problem(v, inner) for v in value]
        return next((f"must hold items that each {p.removeprefix('must ')}" for p in problems if p), None)
    if typing.get_origin(kind) is dict or kind is dict:
        return None if isinstance(value, dict) else "must be a mapping of key: value"
    return None  # an annotation this checker does not know: the field's own code checks it


def _range_problem(value, rule: dict) -> str | None:
    if rule["length"] is not None and len(value) != rule["length"]:
        return f"must hold exactly {rule['length']} items"
    if rule["choices"] and value not in rule["choices"]:
        return f"is not one of {', '.join(map(str, rule['choices']))}"
    for item in value if isinstance(value, tuple) else (value,):
        for name, bound in rule["bounds"].items():
            sign, holds = _BOUNDS[name]
            if not holds(float(item), float(bound)):
                return f"must be {sign} {bound:g}" + (" (each item)" if isinstance(value, tuple) else "")
    return None


def check_fields(obj) -> None:
    """Refuse a field of `obj` whose value has the wrong type or lies outside its declared range."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        optional, kind = _kind(hints[f.name])
        if value is None:
            if optional:
                continue
            raise GqakitError(f"{f.name} must be given")
        problem = _type_problem(value, kind) or (_range_problem(value, f.metadata["rule"]) if "rule" in f.metadata
                                                 else None)
        if problem:
            shown = list(value) if isinstance(value, tuple) else value
            raise FieldError(f.name, f"{f.name}={shown!r} {problem}")


class FieldError(GqakitError):
    """A field's value has the wrong type or lies outside its range; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# YAML 1.1 spellings of booleans that YAML 1.2 (and this loader) keeps as strings: a bool field still takes them.
_WORDS = {"yes": True, "no": False, "on": True, "off": False, "y": True, "n": False}


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(known)}"


def _coerce(key: str, value, hint, source: str):
    """Numbers as the dataclass declares them: YAML 1.1 reads 3e-4 and 1e9 (no dot) as strings; and yes / no /
    on / off, which the loader keeps as strings (`mixed_precision: no`), as booleans where a field is one."""
    kinds = (hint, *typing.get_args(hint))
    if bool in kinds and isinstance(value, str) and value.lower() in _WORDS:
        return _WORDS[value.lower()]
    if int in kinds and float not in kinds and not isinstance(value, bool) and isinstance(value, (str, float)):
        try:
            number = float(value)
        except ValueError:
            raise GqakitError(f"{source}: {key}={value!r} must be an integer") from None
        if not math.isfinite(number) or number != int(number):
            raise GqakitError(f"{source}: {key}={value!r} must be an integer")
        return int(number)
    if float in kinds and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise GqakitError(f"{source}: {key}={value!r} is not a number") from None
    return value


def from_dict(cls, data: dict, source: str = "recipe", sources: dict[str, str] | None = None):
    """Build dataclass `cls` from a mapping; unknown keys are an error naming the closest key. An error about a
    key names where the key came from: `sources[key]` (e.g. a command-line override), else `source`."""
    where = lambda key: (sources or {}).get(key, source)  # noqa: E731
    known = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in known:
            raise GqakitError(f"{where(key)}: unknown key '{key}'{_suggest(key, known)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        hint = hints.get(key)
        if typing.get_origin(hint) is tuple:  # YAML lists (or one bare item) -> tuples
            value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        value = _coerce(key, value, hint, where(key))
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required key is missing
        raise GqakitError(f"{source}: {e}") from None
    except FieldError as e:  # a field's type or range (check_fields, from __post_init__)
        raise GqakitError(f"{where(e.field)}: {e}") from None
    except GqakitError as e:
        raise GqakitError(f"{source}: {e}") from None


def load_recipe(cls, path: str | Path, overrides: list[str] = ()):
    """Read a YAML recipe into `cls`, applying `key=value` overrides on top."""
    path = Path(path)
    if not path.is_file():
        raise GqakitError(f"recipe {path} does not exist; pass the path of a YAML file (see recipes/)")
    data = _yaml(path.read_bytes(), f"recipe {path}") or {}
    if not isinstance(data, dict):
        raise GqakitError(f"recipe {path} must be a mapping of key: value, got {type(data).__name__}")
    sources = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise GqakitError(f"override '{item}' is not key=value; write e.g. steps=100")
        data[key] = _yaml(value.encode(errors="surrogateescape"), f"override {key}")  # ints, floats, bools, lists
        sources[key] = f"override {item}"
    return from_dict(cls, data, source=str(path), sources=sources)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true / false (any case). YAML 1.1 also reads yes, no,
    on and off as booleans, so `mixed_precision: no` became False; here it stays the string "no"."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def _yaml(raw: bytes, what: str):
    """YAML text -> data, or a one-line error that says where the text is broken."""
    try:
        return yaml.load(raw.decode("utf-8"), Loader=_Loader)
    except UnicodeDecodeError:
        raise GqakitError(f"{what} is not UTF-8 text (a binary file?); give a YAML text file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise GqakitError(f"{what} is not valid YAML{where} ({problem}); fix the syntax") from None


def to_dict(obj) -> dict:
    """A recipe dataclass as plain YAML/JSON-friendly data."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(obj).items()}
