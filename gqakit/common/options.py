"""A command's options as one frozen dataclass: the field schema, its checks and its command-line flags (the YAML
recipes that map onto the same dataclasses: `common/recipes.py`).

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

Nested options: a field whose annotation is itself an options dataclass, declared with a `prefix`,

    transfer: TransferOptions = option(default_factory=TransferOptions, prefix="transfer")

brings that dataclass's flags into the command's as `--transfer-steps`, `--transfer-dtype`, ... (a nested field
takes long flags only; its `flag`, if any, gets the prefix too). Everywhere but the command line a nested option
is named by its dotted path, "transfer.steps": the key of `flags` (so `errors.opt("transfer.steps")` is
--transfer-steps on the command line), what `typed` and `options_given` return, the `field` of a FieldError. While
`from_args` or `recipes.from_dict` builds the nested dataclass, its own messages' `opt("steps")` names that path
too (`errors.renamed`). A recipe writes nested options as a mapping under the field's name, `transfer: {steps: 10}`,
as `recipes.to_dict` writes them; a dotted key, `transfer.steps: 10` or the override `transfer.steps=10`, lays one
value over it. A command that refuses an option its other choices would ignore reads `options_given(cfg, typed)`: the
options typed on the command line (the `remember` ones even at their default value) or set to another value than
their default.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import types
import typing

from gqakit.common.errors import GqakitError, opt, renamed

_BOUNDS = {"above": (">", float.__gt__), "at_least": (">=", float.__ge__),
           "below": ("<", float.__lt__), "at_most": ("<=", float.__le__)}


# Seeds: accelerate's set_seed seeds numpy, which takes 0..2**32 - 1 (uptrain, and derived seeds modulo 2**32);
# commands that seed torch generators only (convert, eval) also take -SEED_MAX..-1, as they always did
SEED_MAX = 2 ** 32 - 1


def option(default=dataclasses.MISSING, *, default_factory=dataclasses.MISSING, above=None, at_least=None,
           below=None, at_most=None, choices=None, length=None, help=None, flag=None, metavar=None, parse=None,
           invert=False, repeat=None, remember=False, default_text=None, prefix=None):
    """A dataclass field with its allowed values: numeric bounds (each element's, for a tuple), choices, length;
    and, with `help`, its command-line flag (see the module docstring; `parse` turns the flag's text into the
    field's value, in `from_args`, so that its GqakitError is one line rather than argparse's usage; a tuple
    field's flag may be repeated, `repeat`, by default when it has no `parse`; `remember`: the flag's absence is
    kept, so the command can tell a typed default value from an untouched one: see `typed`; `default_text`: the
    default in words, shown in the help instead of the field's value, for a default that another option or the
    model decides, e.g. "min(512, the model's context)"). With `prefix`, the field holds nested options (its
    annotation is their dataclass): their flags join the command's as --PREFIX-NAME (see the module docstring)."""
    bounds = {k: v for k, v in (("above", above), ("at_least", at_least), ("below", below), ("at_most", at_most))
              if v is not None}
    rule = {"bounds": bounds, "choices": tuple(choices) if choices else None, "length": length}
    metadata = {"rule": rule}
    if prefix is not None:
        if help is not None or flag is not None:
            raise TypeError("nested options take their flags from their own fields: give them no help or flag")
        metadata["nested"] = {"prefix": prefix}
    if help is not None:
        metadata["cli"] = {"help": help, "flag": flag, "metavar": metavar, "parse": parse, "invert": invert,
                           "repeat": parse is None if repeat is None else repeat, "remember": remember,
                           "default_text": default_text}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class _Flag:
    """A field's command-line flag, nested options' flags included."""

    path: str  # the field's name, or its dotted path in nested options ("transfer.steps"): argparse's dest
    field: dataclasses.Field
    cli: dict
    kind: object  # its annotation, None taken out
    names: tuple[str, ...]  # "-o", "--output"; a positional's metavar


@functools.cache
def _flags(cls) -> tuple[_Flag, ...]:
    return tuple(_walk(cls, "", ""))


def _walk(cls, path: str, prefix: str):
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if "nested" in f.metadata:
            inner = _options_class(hints[f.name])
            if inner is None:
                raise TypeError(f"{cls.__name__}.{f.name} has a prefix, so its annotation must be a dataclass")
            yield from _walk(inner, f"{path}{f.name}.", f"{prefix}{f.metadata['nested']['prefix']}-")
        elif "cli" in f.metadata:
            names = (f.metadata["cli"]["flag"] or f"--{f.name.replace('_', '-')}").split("/")
            if prefix:
                if not all(n.startswith("--") for n in names):
                    raise TypeError(f"{cls.__name__}.{f.name}: nested options take long flags only (--name), which "
                                    "get the prefix")
                names = [f"--{prefix}{n[2:]}" for n in names]
            yield _Flag(path + f.name, f, f.metadata["cli"], _kind(hints[f.name])[1], tuple(names))


def _options_class(hint):
    """The dataclass of a nested options field's annotation, or None."""
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def flags(cls) -> dict[str, str]:
    """field name (a nested option's dotted path) -> how the command line spells it (its long flag, or a
    positional's metavar)."""
    return {fl.path: max(fl.names, key=len) for fl in _flags(cls)}


def add_arguments(parser, cls, show_defaults: bool = True) -> None:
    """Add the flag of every field of `cls` declared with `option(help=...)` to an argparse parser; each help ends
    with the field's default (`show_defaults`)."""
    for fl in _flags(cls):
        f, cli, kind, names = fl.field, fl.cli, fl.kind, fl.names
        default = _default(f)
        kwargs = {"help": cli["help"] + (_default_note(default, cli, kind) if show_defaults else "")}
        if kind is bool:
            kwargs.update(action="store_false" if cli["invert"] else "store_true", dest=fl.path)
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
            elif "." in fl.path and not f.metadata["rule"]["choices"]:  # argparse's name, not the dest's
                kwargs["metavar"] = next(n for n in names if n.startswith("--"))[2:].replace("-", "_").upper()
            if typing.get_origin(kind) is tuple and not names[0].startswith("-"):
                kwargs["nargs"] = "+"
            elif typing.get_origin(kind) is tuple and cli["repeat"]:
                kwargs.update(action="append", default=None)
        if names[0].startswith("-"):
            kwargs.setdefault("default", None if cli["parse"] or cli["remember"] or default is dataclasses.MISSING
                              else default)
            if kind is not bool:
                kwargs["dest"] = fl.path
            if default is dataclasses.MISSING:
                kwargs["required"] = True
            parser.add_argument(*names, **kwargs)
        else:
            kwargs.setdefault("metavar", names[0])
            parser.add_argument(fl.path, **kwargs)


def _default_note(default, cli: dict, kind) -> str:
    """The help's " (default: X)", from the field's default (or its `default_text`): none for a bool flag (the flag
    itself says what it turns on), a required option, or a default of None or () (nothing)."""
    shown = cli["default_text"]
    if shown is None and kind is not bool and default not in (dataclasses.MISSING, None, ()):
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
    return "" if shown is None else f" (default: {shown})".replace("%", "%%")  # argparse formats help with %


def from_args(cls, args, **given):
    """`cls` from parsed flags (`add_arguments`), with `given` fields set by the caller."""
    return _from_args(cls, args, "", given)


def _from_args(cls, args, path: str, given: dict):
    hints = _hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if "nested" in f.metadata:
            inner = _options_class(hints[f.name])
            with _nested(inner, f.name, path):
                values[f.name] = _from_args(inner, args, f"{path}{f.name}.", {})
        elif "cli" in f.metadata:
            values[f.name] = _flag_value(f, f.metadata["cli"], _kind(hints[f.name])[1], getattr(args, path + f.name))
    return cls(**{**values, **given})


def _flag_value(f: dataclasses.Field, cli: dict, kind, value):
    """A field's value from its parsed flag."""
    if value is not None and cli["parse"] is not None:  # the flag's text, parsed here (GqakitError: one line)
        value = [cli["parse"](v) for v in value] if isinstance(value, list) else cli["parse"](value)
        if cli["repeat"]:  # each use parsed to several values
            value = [item for part in value for item in part]
    if isinstance(value, list):
        return tuple(value)
    if value is None and typing.get_origin(kind) is tuple:
        return f.default if f.default is not dataclasses.MISSING else ()  # a repeatable flag not given
    if value is None and (cli["parse"] is not None or cli["remember"]):
        return _default(f)  # a parsed or remembered flag not given
    return value


@contextlib.contextmanager
def _nested(inner, name: str, path: str):
    """While nested options `name` (of options at `path`) are built from flags or a recipe: their own messages
    name their options by dotted path (`errors.opt("steps")` is opt("transfer.steps"), --transfer-steps on the
    command line), and a field error names the path."""
    with renamed({f.name: f"{path}{name}.{f.name}" for f in dataclasses.fields(inner)}):
        try:
            yield
        except FieldError as e:
            raise e.within(name) from None


def typed(cls, args) -> frozenset[str]:
    """The `remember` fields of `cls` (nested ones by dotted path, "transfer.steps") whose flags were typed on the
    command line (even at their default value)."""
    return frozenset(typed_values(cls, args))


def typed_values(cls, args) -> dict:
    """{field: value} of the `remember` flags typed on the command line (to lay over a recipe: `replace`)."""
    return {fl.path: getattr(args, fl.path) for fl in _flags(cls)
            if fl.cli["remember"] and getattr(args, fl.path, None) is not None}


def replace(obj, changes: dict):
    """`dataclasses.replace` that also takes nested options by dotted path ({"transfer.steps": 10})."""
    direct, inner = {}, {}
    for key, value in changes.items():
        head, dot, rest = key.partition(".")
        if dot:
            inner.setdefault(head, {})[rest] = value
        else:
            direct[key] = value
    for head, values in inner.items():
        direct[head] = replace(direct.get(head, getattr(obj, head)), values)
    return dataclasses.replace(obj, **direct)


def options_given(obj, typed: frozenset[str] = frozenset()) -> list[str]:
    """The options of `obj` that were given, by name (nested ones by dotted path), in declaration order: typed on
    the command line (`typed`, as `typed()` gives, for `remember` flags even at their default value) or set to
    another value than the field's default. For refusing an option that a choice would ignore."""
    return _given(obj, typed, "")


def _given(obj, typed: frozenset[str], path: str) -> list[str]:
    out = []
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if _options_class(hints[f.name]) and dataclasses.is_dataclass(value):
            out += _given(value, typed, f"{path}{f.name}.")
        elif path + f.name in typed or value != _default(f):
            out.append(path + f.name)
    return out


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
                shown = f"{bound:,}" if isinstance(bound, int) else f"{bound:g}"
                return f"must be {sign} {shown}" + (" (each item)" if isinstance(value, tuple) else "")
    return None


def check_fields(obj) -> None:
    """Refuse a field of `obj` whose value has the wrong type or lies outside its declared range (nested options'
    fields too, named by dotted path)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        optional, kind = _kind(hints[f.name])
        if value is None:
            if optional:
                continue
            raise GqakitError(f"{opt(f.name)} must be given")
        inner = _options_class(kind)
        if inner is not None:
            if not isinstance(value, inner):
                raise FieldError(f.name, f"{f.name}={value!r} must be {inner.__name__} options")
            with _nested(inner, f.name, ""):
                check_fields(value)
            continue
        problem = _type_problem(value, kind) or (_range_problem(value, f.metadata["rule"]) if "rule" in f.metadata
                                                 else None)
        if problem:
            shown = list(value) if isinstance(value, tuple) else value
            raise FieldError(f.name, f"{f.name}={shown!r} {problem}")


class FieldError(GqakitError):
    """A field's value has the wrong type or lies outside its range; `field` names it (by dotted path in nested
    options)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def within(self, name: str) -> FieldError:
        """The same error one level up, in the options that hold these as their field `name`."""
        message = str(self)
        return FieldError(f"{name}.{self.field}",
                          f"{name}.{message}" if message.startswith(f"{self.field}=") else message)


_GIVEN = "_gqakit_flags_given"  # the flags each parse has met, on its namespace (dropped by `drop_given`)
_REPEATABLE = ("_AppendAction", "_AppendConstAction", "_CountAction", "_HelpAction", "_VersionAction",
               "_ExtendAction", "_SubParsersAction")


def strict_parser(parser, prog: str | None = None) -> None:
    """Make every flag of `parser` and its subcommands refuse to be given twice (argparse keeps the last: `--groups 2
    --groups 4` converted to 4 without a word); flags declared repeatable (append) are left as they are. Their
    errors become one line, `PROG: error: ...` as every other refusal (argparse printed its usage first)."""
    import argparse

    prog = prog or parser.prog
    parser.error = functools.partial(_one_line_error, parser, prog)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                strict_parser(sub, prog)
        elif (action.option_strings and type(action).__name__ not in _REPEATABLE
              and not getattr(action, "refuses_repeats", False)):
            action.__class__ = _once(type(action))


def _one_line_error(parser, prog: str, message: str):
    """argparse's error, in one line that names --help (where the usage is)."""
    parser.exit(2, f"{prog}: error: {message} (see {parser.prog} --help)\n")


@functools.lru_cache(maxsize=None)
def _once(base):
    import argparse

    class Once(base):
        refuses_repeats = True

        def __call__(self, parser, namespace, values, option_string=None):
            given = namespace.__dict__.setdefault(_GIVEN, set())
            if self.dest in given:
                raise argparse.ArgumentError(self, "given twice (argparse would keep the last); give it once")
            given.add(self.dest)
            super().__call__(parser, namespace, values, option_string)

    Once.__name__ = base.__name__
    return Once


def drop_given(args) -> None:
    """Remove `strict_parser`'s bookkeeping from a parsed namespace."""
    vars(args).pop(_GIVEN, None)


def each_once(values, flag: str) -> list:
    """`values` of a comma-separated flag, refused in one line where one is given twice (once meant once)."""
    seen = set()
    for value in values:
        if value in seen:
            raise GqakitError(f"{flag} lists {value!r} twice; give each once")
        seen.add(value)
    return list(values)
