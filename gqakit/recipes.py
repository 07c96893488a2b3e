"""YAML recipes that map one-to-one onto a command's frozen dataclass."""
from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path

import yaml

from .errors import GqakitError


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(known)}"


def _coerce(key: str, value, hint, source: str):
    """Numbers as the dataclass declares them: YAML 1.1 reads 3e-4 and 1e9 (no dot) as strings."""
    kinds = (hint, *typing.get_args(hint))
    if int in kinds and float not in kinds and not isinstance(value, bool) and isinstance(value, (str, float)):
        try:
            number = float(value)
        except ValueError:
            raise GqakitError(f"{source}: {key}={value!r} must be an integer") from None
        if number != int(number):
            raise GqakitError(f"{source}: {key}={value!r} must be an integer")
        return int(number)
    if float in kinds and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise GqakitError(f"{source}: {key}={value!r} is not a number") from None
    return value


def from_dict(cls, data: dict, source: str = "recipe"):
    """Build dataclass `cls` from a mapping; unknown keys are an error naming the closest key."""
    known = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in known:
            raise GqakitError(f"{source}: unknown key '{key}'{_suggest(key, known)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        hint = hints.get(key)
        if typing.get_origin(hint) is tuple:  # YAML lists (or one bare item) -> tuples
            value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        value = _coerce(key, value, hint, source)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required key is missing
        raise GqakitError(f"{source}: {e}") from None


def load_recipe(cls, path: str | Path, overrides: list[str] = ()):
    """Read a YAML recipe into `cls`, applying `key=value` overrides on top."""
    path = Path(path)
    if not path.is_file():
        raise GqakitError(f"recipe {path} does not exist; pass the path of a YAML file (see recipes/)")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise GqakitError(f"recipe {path} must be a mapping of key: value, got {type(data).__name__}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise GqakitError(f"override '{item}' is not key=value; write e.g. steps=100")
        data[key] = yaml.safe_load(value)  # YAML's scalar rules: ints, floats, bools, lists
    return from_dict(cls, data, source=str(path))


def to_dict(obj) -> dict:
    """A recipe dataclass as plain YAML/JSON-friendly data."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(obj).items()}
