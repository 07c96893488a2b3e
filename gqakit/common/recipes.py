"""YAML recipes that map one-to-one onto a command's options dataclass (`common/options.py`): `load_recipe` reads a
file with `key=value` overrides laid over it, `from_dict` builds the dataclass from a mapping (nested options as a
mapping under their field's name, or dotted keys), `to_dict` writes one back. Errors name the key, where it came from
(the recipe or an override) and the fix."""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from pathlib import Path

import yaml

from gqakit.common.errors import GqakitError
from gqakit.common.options import FieldError, _hints, _nested, _options_class


# YAML 1.1 spellings of booleans that YAML 1.2 (and this loader) keeps as strings: a bool field still takes them.
_WORDS = {"yes": True, "no": False, "on": True, "off": False, "y": True, "n": False}


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(known)}"


class _Placed(GqakitError):
    """An error that already says where in a recipe it lies (not to be prefixed again)."""


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
            raise _Placed(f"{source}: {key}={value!r} must be an integer") from None
        if not math.isfinite(number) or number != int(number):
            raise _Placed(f"{source}: {key}={value!r} must be an integer")
        return int(number)
    if float in kinds and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise _Placed(f"{source}: {key}={value!r} is not a number") from None
    return value


def from_dict(cls, data: dict, source: str = "recipe", sources: dict[str, str] | None = None):
    """Build dataclass `cls` from a mapping; unknown keys are an error naming the closest key. An error about a
    key names where the key came from: `sources[key]` (e.g. a command-line override), else `source`. Nested
    options are a mapping under their field's name, or dotted keys ("transfer.steps"), which lay over it."""
    def where(key: str) -> str:  # a nested key's own source, else its options' (an override of the whole mapping)
        parts = key.split(".")
        return next((sources[k] for k in (".".join(parts[:n]) for n in range(len(parts), 0, -1))
                     if k in (sources or {})), source)

    try:
        return _from_dict(cls, data, "", where)
    except _Placed:
        raise
    except TypeError as e:  # a required key is missing
        raise GqakitError(f"{source}: {e}") from None
    except FieldError as e:  # a field's type or range (check_fields, from __post_init__)
        raise GqakitError(f"{where(e.field)}: {e}") from None
    except GqakitError as e:
        raise GqakitError(f"{source}: {e}") from None


def _from_dict(cls, data: dict, path: str, where):
    hints = _hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    data = _unflatten(data, {k for k in known if _options_class(hints[k])})
    for key in data:
        if key not in known:
            raise _Placed(f"{where(path + key)}: unknown key '{path}{key}'"
                          f"{_suggest(path + key, [path + k for k in known])}")
    kwargs = {}
    for key, value in data.items():
        hint = hints.get(key)
        inner = _options_class(hint)
        if inner is not None and isinstance(value, dict):
            with _nested(inner, key, path):
                value = _from_dict(inner, value, f"{path}{key}.", where)
        elif inner is not None and not isinstance(value, inner):
            raise _Placed(f"{where(path + key)}: {path}{key}={value!r} must be a mapping of key: value")
        elif inner is None:
            if typing.get_origin(hint) is tuple:  # YAML lists (or one bare item) -> tuples
                value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
            value = _coerce(path + key, value, hint, where(path + key))
        kwargs[key] = value
    return cls(**kwargs)


def _unflatten(data: dict, nested: set[str]) -> dict:
    """Dotted keys of nested options ("transfer.steps": 10) into their mapping ("transfer": {"steps": 10}); a later
    key lays over an earlier one."""
    out = {}
    for key, value in data.items():
        head, dot, rest = key.partition(".")
        if head not in nested or not (dot or isinstance(value, dict)):
            out[key] = value
            continue
        given = {rest: value} if dot else value
        before = out.get(head)
        before = to_dict(before) if dataclasses.is_dataclass(before) else before
        out[head] = {**before, **given} if isinstance(before, dict) else given
    return out


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
        if key in sources:
            raise GqakitError(f"{key} is overridden twice ({sources[key][len('override '):]}, then {item}); give it "
                              "once")
        data[key] = _yaml(value.encode(errors="surrogateescape"), f"override {key}")  # ints, floats, bools, lists
        sources[key] = f"override {item}"
    return from_dict(cls, data, source=str(path), sources=sources)


_TWICE = " is given twice"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true / false (any case). YAML 1.1 also reads yes, no,
    on and off as booleans, so `mixed_precision: no` became False; here it stays the string "no". A key given twice
    in one mapping is an error (PyYAML keeps the last: `steps:` twice trained the second's steps without a word)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, typing.Hashable) and key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"the key {key!r}{_TWICE}",
                                                            key_node.start_mark)
                if isinstance(key, typing.Hashable):
                    seen.add(key)
        return super().construct_mapping(node, deep)


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
        if problem.endswith(_TWICE):
            raise GqakitError(f"{what} gives {problem[:-len(_TWICE)]} twice ({where.strip()}); keep one") from None
        raise GqakitError(f"{what} is not valid YAML{where} ({problem}); fix the syntax") from None


def to_dict(obj) -> dict:
    """A recipe dataclass as plain YAML/JSON-friendly data (nested options as mappings: what `from_dict` reads)."""
    return {k: to_dict(getattr(obj, k)) if dataclasses.is_dataclass(getattr(obj, k)) else
            list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(obj).items()}
