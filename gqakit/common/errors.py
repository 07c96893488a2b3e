"""The one exception type that the CLI turns into a one-line message and a non-zero exit, and how a message
names an option the way the user gave it.

Library code names options by their own names: `opt("text_column")` is `text_column` (a recipe key, a keyword
argument) and `opt("text_column", "NAME")` is `text_column=NAME`. The command line wraps each command in
`spelled(...)` with its flags, and the same messages then read `--text-column` and `--text-column NAME`. So one
message serves every caller, and the mapping from option names to flags lives in one place (the command's
options schema, `common.options.flags`). A caller that hands its own option to a shared loader under another
name (convert's `calibration` is the text loader's `text`) says so with `renamed(...)`. Nested options are named
by their dotted path: `opt("transfer.steps")` is `--transfer-steps` on the command line.
"""
from __future__ import annotations

import contextvars
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


class GqakitError(Exception):
    """A user error: the message names the problem, the numbers and the fix, on one line."""


_SPELLING: contextvars.ContextVar = contextvars.ContextVar("gqakit_option_spelling", default=None)
_RENAMED: contextvars.ContextVar = contextvars.ContextVar("gqakit_option_renamed", default={})


def opt(name: str, value: str | None = None) -> str:
    """Option `name` (given `value`) as the user wrote it: see the module docstring."""
    name = _RENAMED.get().get(name, name)
    spelling = _SPELLING.get()
    if spelling is None:
        return name if value is None else f"{name}={value}"
    names, assign = spelling
    return names.get(name, name) if value is None else f"{names.get(name, name)}{assign}{value}"


@contextmanager
def spelled(names: Mapping[str, str], assign: str = " ") -> Iterator[None]:
    """Within this block, `opt(name)` is `names[name]` (when there) and `opt(name, v)` is `names[name] + assign + v`:
    e.g. a command line's flags ({"text_column": "--text-column"}, " ")."""
    token = _SPELLING.set((dict(names), assign))
    try:
        yield
    finally:
        _SPELLING.reset(token)


@contextmanager
def renamed(names: Mapping[str, str]) -> Iterator[None]:
    """Within this block, option `name` is the caller's option `names[name]` (then spelled as usual)."""
    token = _RENAMED.set({**_RENAMED.get(), **names})
    try:
        yield
    finally:
        _RENAMED.reset(token)
