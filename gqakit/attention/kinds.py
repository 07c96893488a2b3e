"""The attention kinds: ONE registry of their names and options, read by `gqakit.attention.use`, the command
line, recipes, eval and generate. Pure data and checks, no torch: the command line parses without loading it.

`KINDS` names every kind gqakit registers as `gqakit_<kind>`; `OPTIONS` what each takes, `DEFAULTS` their
values when not given. `gqakit.attention.options` checks them against a model and builds the mask patterns.
Adding a kind: see docs/architecture.md.
"""
from __future__ import annotations

from collections.abc import Callable

import yaml

from gqakit.common.errors import GqakitError, opt

KINDS = ("tiled", "sliding", "sinks", "sparse")
OPTIONS = {
    "tiled": {"block_q", "block_k"},
    "sliding": {"window", "dilation", "global_tokens", "block_q", "block_k"},
    "sinks": {"sinks", "window", "block_q", "block_k"},
    "sparse": {"pattern", "stride", "summary", "part", "block_q", "block_k"},
}
# Options that may be given per layer (a list of num_hidden_layers values) and, within a layer, per query
# head (a list of num_attention_heads values); see patterns.check_layered.
LAYERED = {"sliding": ("window", "dilation"), "sparse": ("pattern", "stride", "summary", "part")}
DEFAULTS = {"block_q": 128, "block_k": 128, "dilation": 1, "global_tokens": (), "sinks": 4, "window": None,
            "pattern": "strided", "stride": None, "summary": None, "part": "both"}
SPARSE_PATTERNS = ("strided", "fixed")
CONFIG_KEY = "gqakit_attention"
DEFAULT = "default"  # a command's choice for the model's own attention
CHOICES = (DEFAULT, *KINDS)
LONG_CONTEXT = ("sliding", "sinks")  # kinds that make positions past the model's limit sensible


def adds_position_bias(config) -> bool:
    """Whether a model adds T5's learned relative position bias to its attention scores (T5, mT5, UMT5, LongT5,
    gqakit's grouped T5), from a config.json dict or a transformers config."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    return get("relative_attention_num_buckets") is not None


def position_bias_refusal(name: str, kind: str, default: str | None = None) -> str:
    """One line: gqakit attention `kind` cannot run `name`, which adds T5's relative position bias; the fix is
    `default`, the model's own attention as the caller spells it (a recipe: attention=default)."""
    default = default or opt("attention", DEFAULT)
    return (f"{name} adds T5's relative position bias to its attention scores, an additive bias that gqakit's {kind} "
            f"attention does not take; use {default} (T5's own sdpa or eager attention)")


def _cli_flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def kinds_taking(name: str) -> list[str]:
    """The kinds that take option `name`, in registry order."""
    return [kind for kind in KINDS if name in OPTIONS[kind]]


def attention_options(kind: str | None, given: dict, extra: dict | None = None, *,
                      extra_name: str = "--attention-option", flag: Callable[[str], str] = _cli_flag,
                      kind_flag: str = "--attention ") -> dict:
    """The `gqakit.attention.use` options of `kind` from the options a command was given (None: not given):
    `given`, its own options (window, sinks), and `extra`, any other option of the kind (`extra_name`).

    An option the kind does not take is refused, never dropped; `flag(name)` spells an option as the user
    wrote it (`--window` on the command line, `window` in a recipe) and `kind_flag` the kind's choice."""
    given = {name: value for name, value in given.items() if value is not None}  # None: the flag was not given
    for name, value in (extra or {}).items():  # named by the user: checked even without a value
        if name in given:
            raise GqakitError(f"set {flag(name)} itself, not inside {extra_name}")
        given[name] = value
    kind = kind or DEFAULT
    if kind not in CHOICES:
        raise GqakitError(f"unknown {kind_flag.strip()} {kind!r}; choose one of {', '.join(CHOICES)}")
    if kind == DEFAULT:
        if given:
            names = "/".join(flag(name) for name in given)
            takers = sorted({k for name in given for k in kinds_taking(name)}, key=KINDS.index)
            verb = "applies" if len(given) == 1 else "apply"
            if not takers:
                raise GqakitError(f"{names} is not an option of any gqakit attention kind (options: "
                                  f"{', '.join(sorted({o for opts in OPTIONS.values() for o in opts}))})")
            raise GqakitError(f"{names} only {verb} with {kind_flag}{' or '.join(takers)}; add one of them")
        return {}
    for name in given:
        if name not in OPTIONS[kind]:
            takers = kinds_taking(name)
            where = f"it applies with {kind_flag}{' or '.join(takers)}" if takers else "no kind takes it"
            raise GqakitError(f"{kind_flag}{kind} takes no {flag(name)} ({where}); it takes "
                              f"{', '.join(flag(n) for n in sorted(OPTIONS[kind]))}")
    empty = [name for name, value in given.items() if value is None]
    if empty:
        raise GqakitError(f"{extra_name} {empty[0]} has no value; write {empty[0]}=VALUE, or in a YAML mapping "
                          f"{{{empty[0]}: VALUE}} (a space after the colon)")
    return given


def parse_assignments(items: list[str] | tuple[str, ...], flag: str = "--attention-option") -> dict:
    """`['stride=128', 'pattern=fixed']` -> {'stride': 128, 'pattern': 'fixed'} (values read as YAML scalars or
    lists: 128, 1.5, [0, 1])."""
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise GqakitError(f"{flag} {item!r} is not NAME=VALUE; write e.g. {flag} stride=128")
        try:
            out[name.strip()] = yaml.safe_load(text)
        except yaml.YAMLError:
            raise GqakitError(f"{flag} {item!r}: {text!r} is not a value; write e.g. 128, 0.5 or [0, 1]") from None
    return out


def _eval_flag(name: str) -> str:
    return f"--{name}" if name in ("window", "sinks") else f"--attention-option {name}"


def command_attention_options(kind: str | None, window: int | None, sinks: int | None,
                              assignments: tuple[str, ...] = ()) -> dict:
    """The options of `--attention KIND [--window W] [--sinks S] [--attention-option NAME=VALUE ...]`."""
    return attention_options(kind, {"window": window, "sinks": sinks}, parse_assignments(assignments),
                             flag=_eval_flag)
