"""Evaluation reports: reproducible artefacts written atomically, never over an old one by accident.

Every `gqakit eval` run writes one folder:

    results.json   the figures, the exact config (the command's dataclass), the command line, the time
                   and the versions of gqakit / torch / transformers / Python
    results.csv    the same rows as a flat table (one row per model, position bucket or passkey cell)
    *.png          a plot where a person would rather look

The default folder is `runs/eval-<kind>-<YYYYmmdd-HHMMSS>` under the current directory; runs that start in the same
second (several evaluations launched together) get `-2`, `-3`, ... after it, also when another run takes the name while
this one evaluates. A folder given with --output that exists is refused unless `force=True`; the check runs before the
(possibly long) evaluation and again at the end. Files go into a hidden temporary folder beside the target, renamed into
place at the end: an error or Ctrl-C leaves no half-written report (and, with force, the old one intact until then).
"""
from __future__ import annotations

import csv
import datetime
import json
import math
import os
import platform
import re
import sys
from collections.abc import Callable
from pathlib import Path

from gqakit.common.atomic import OutputTaken, atomic_output, check_replaceable, inside
from gqakit.common.errors import GqakitError, opt

RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
_EXISTS = "report folder {} already exists; pass {} to replace it or choose another --output"


def counted(n: int, noun: str) -> str:
    """'1 step', '2 steps', '1,024 tokens'."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def default_output(kind: str, now: datetime.datetime | None = None) -> Path:
    now = now or datetime.datetime.now()
    return Path("runs") / f"eval-{kind}-{now:%Y%m%d-%H%M%S}"


def free_default(target: Path) -> Path:
    """A default report folder `target` (runs/eval-<kind>-<timestamp>[-N]) if no file or folder holds its name,
    else the first free of <timestamp>-2, -3, ..."""
    found = re.fullmatch(r"(eval-[\w-]+-\d{8}-\d{6})(?:-\d+)?", target.name)
    base = target.with_name(found.group(1)) if found else target
    candidate, n = target, 2
    while os.path.lexists(candidate):
        candidate, n = base.with_name(f"{base.name}-{n}"), n + 1
    return candidate


# the fields of a command's options that name what it reads: a report folder may be none of them, nor hold one
INPUT_FIELDS = ("model", "models", "tokenizer", "text", "dataset", "haystack_text")


def inputs_of(cfg) -> list[tuple[str, str]]:
    """(option, path) of what `cfg`'s command reads (INPUT_FIELDS), local paths that exist only."""
    found = []
    for name in INPUT_FIELDS:
        value = getattr(cfg, name, None)
        for path in (value if isinstance(value, (tuple, list)) else (value,)):
            if path and os.path.lexists(path):
                found.append(("MODEL" if name in ("model", "models") else opt(name), str(path)))
    return found


def config_of(cfg) -> dict:
    """A command's options as its report's config: every field but `given` (which flags were typed)."""
    import dataclasses

    return {k: v for k, v in dataclasses.asdict(cfg).items() if k != "given"}


def prepare_output(output: str | Path | None, kind: str, force: bool, inputs=()) -> Path:
    """The report folder for this run; refuses an existing one given as `output` without `force`, and one that is,
    holds or sits inside an input (`inputs`: (option, path) pairs, `inputs_of`), before any work is done. Without
    `output`, a free default name under the current folder (refused inside an input too: a run started in the
    model's folder would write into it)."""
    target = Path(output) if output else free_default(default_output(kind))
    for name, path in inputs:
        if inside(target, Path(path)) or inside(Path(path), target):
            what = f"--output {target}" if output else f"the default report folder {target} (under the current folder)"
            raise GqakitError(f"{what} overlaps {name} {path} (the report would replace it or be written into it); "
                              f"choose an --output outside it")
    if not output:
        return target
    if target.exists() and not force:
        raise GqakitError(_EXISTS.format(target, opt("force")))
    if target.exists() and not target.is_dir():
        raise GqakitError(f"--output {target} is a file, not a folder; choose another --output")
    if force:
        check_replaceable(target, "--output", kind="report")
    return target


def prepare_for(cfg, kind: str) -> Path:
    """`prepare_output` for an eval command's options: their --output, --force and inputs (`inputs_of`)."""
    return prepare_output(cfg.output, kind, cfg.force, inputs_of(cfg))


def versions() -> dict:
    import torch
    import transformers

    from gqakit import __version__

    return {"gqakit": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def _jsonable(value):
    """Plain JSON: tuples to lists, non-finite floats to null (strict JSON has no NaN/Infinity)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def _write_csv(path: Path, rows: list[dict]) -> None:
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def write_report(target: Path, *, kind: str, command: str, config: dict, results: dict, rows: list[dict],
                 plots: dict[str, Callable[[Path], None]] | None = None, force: bool = False,
                 default: bool = False) -> Path:
    """Write results.json, results.csv and the plots into `target`, atomically; returns the folder written:
    `target`, or with `default` (a name `prepare_output` chose, no --output) the next free one if another run
    took `target` meanwhile, up to the moment of publishing (said on stderr). A default name is never forced:
    another run's report stays."""
    record = {"kind": kind, "command": command,
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": versions(), "config": config, "results": results}

    def publish(folder: Path, replace: bool) -> None:
        with atomic_output(folder, replace) as tmp:
            (tmp / RESULTS_JSON).write_text(json.dumps(_jsonable(record), indent=2) + "\n", encoding="utf-8")
            _write_csv(tmp / RESULTS_CSV, rows)
            for name, draw in (plots or {}).items():
                draw(tmp / name)

    chosen = Path(target)
    if not default:
        if os.path.lexists(chosen) and not force:  # it may have appeared while we evaluated
            raise GqakitError(_EXISTS.format(chosen, opt("force")))
        publish(chosen, force)
        return chosen
    target = chosen
    while True:  # a default name is never forced: another run's report stays
        target = free_default(target)
        try:
            publish(target, False)
            break
        except OutputTaken:  # published by another run while we wrote: the next free name
            continue
    if target != chosen:
        print(f"gqakit: {chosen} was written by another run meanwhile; this report goes to {target}", file=sys.stderr)
    return target


def read_report(folder: str | Path) -> dict:
    """The results.json of a report folder (for tests and for comparing runs)."""
    return json.loads((Path(folder) / RESULTS_JSON).read_text(encoding="utf-8"))
