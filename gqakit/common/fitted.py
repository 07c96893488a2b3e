"""The texts a model was fitted on, recorded in its folder, so that an evaluation can tell a held-out score from a
score on the model's own calibration or training text.

`FILE` (gqakit-fitted.json) lists every data file that fitted the model or one of its ancestors: what it fitted
(`calibration` for convert-gqa, `uptraining` for gqakit uptrain), its path as given, and digests of its start, never
its text (a folder may be published). A derived checkpoint carries its source's record over (convert-gqa and
uptrain copy side files) and adds its own entries. `gqakit eval ppl | stream` refuse a text that starts like an
entry, by overlap.py's rule over the digests: the entry's first `HEAD` bytes (all of them, for a shorter file) begin
the text; or the text, shorter, begins the entry, compared over its first whole multiple of `MIN_SHARED` bytes (one
digest per multiple is kept; at least `MIN_SHARED` bytes). Hub datasets (`hf:NAME`) and the model's own samples
leave no entry.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from gqakit.common.atomic import replace_text
from gqakit.common.errors import GqakitError, opt
from gqakit.common.overlap import HEAD, MIN_SHARED, data_files, head

FILE = "gqakit-fitted.json"
ROLES = ("calibration", "uptraining")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entries(paths, role: str) -> list[dict]:
    """One entry per data file under `paths` (files or folders; hub names are skipped)."""
    assert role in ROLES, role
    found = []
    for path in paths:
        if str(path).startswith("hf:"):
            continue
        for file in data_files(Path(path).expanduser()):
            start = head(file)
            if start:
                found.append({"role": role, "path": str(file), "head_bytes": len(start), "head_sha256": _digest(start),
                              "prefix_sha256": [_digest(start[:k]) for k in range(MIN_SHARED, len(start) + 1,
                                                                                  MIN_SHARED)]})
    return found


def read(model_dir: str | Path) -> list[dict]:
    """The record of a local model folder ([] without one, or for a hub name)."""
    path = Path(model_dir).expanduser() / FILE
    if not path.is_file():
        return []
    try:
        found = [dict(e) for e in json.loads(path.read_text(encoding="utf-8"))["fitted"]]
        if all(e["role"] in ROLES and isinstance(e["path"], str) and isinstance(e["head_bytes"], int)
               and isinstance(e["head_sha256"], str) and all(isinstance(d, str) for d in e["prefix_sha256"])
               for e in found):
            return found
    except (ValueError, KeyError, TypeError):
        pass
    raise GqakitError(f"{path} is not a gqakit record of fitted texts; repair it or delete it (it only lets "
                      "evaluations refuse the model's own training text)")


def add(folder: Path, new: list[dict]) -> None:
    """Append `new` to `folder`'s record (the source's, copied there already), without repeating an entry."""
    if not new:
        return
    old = read(folder)
    known = {(e["role"], e["head_sha256"], e["path"]) for e in old}
    kept = old + [e for e in new if (e["role"], e["head_sha256"], e["path"]) not in known]
    replace_text(folder / FILE, json.dumps({"fitted": kept}, indent=1) + "\n")


def _starts_like(start: bytes, entry: dict) -> bool:
    n = entry["head_bytes"]
    if len(start) >= n:  # the entry's head is this text's first n bytes (a shorter file counts from MIN_SHARED)
        return (n >= MIN_SHARED or len(start) == n) and _digest(start[:n]) == entry["head_sha256"]
    k = len(start) // MIN_SHARED  # this text is shorter: its first k x MIN_SHARED bytes against the entry's
    return k > 0 and _digest(start[:k * MIN_SHARED]) == entry["prefix_sha256"][k - 1]


def fitted_matches(models, texts: list[tuple[str, str]]) -> list[dict]:
    """(model, option, text file, entry) for each text under `texts` ((option, path) pairs) that starts like an
    entry of a model's record."""
    found = []
    for model in models:
        record = read(model)
        for option, path in texts:
            if not record or not path or str(path).startswith("hf:"):
                continue
            for file in data_files(Path(path).expanduser()):
                start = head(file)
                hit = next((e for e in record if start and _starts_like(start, e)), None)
                if hit is not None:
                    found.append({"model": str(model), "option": option, "text": str(file), "fitted": hit})
    return found


def refuse_fitted(models, texts: list[tuple[str, str]], allow: bool, flag: str) -> list[dict]:
    """Refuse in one line to score a text that fitted one of `models` (unless `allow`); returns the matches (each
    named in a report scored anyway)."""
    found = fitted_matches(models, texts)
    if found and not allow:
        first = found[0]
        entry = first["fitted"]
        same = Path(entry["path"]).exists() and Path(entry["path"]).resolve() == Path(first["text"]).resolve()
        raise GqakitError(f"{first['option']} {first['text']} {'is' if same else 'starts like'} the {entry['role']} "
                          f"text {entry['path']} that {first['model']} was fitted on ({FILE}), so its score would not "
                          f"be held out; score held-out text, or pass {flag} to score it anyway")
    for hit in found:
        print(f"note: {hit['text']} is or starts like {hit['fitted']['role']} text of {hit['model']} ({flag}): its "
              "score is not held out", file=sys.stderr)
    return found


def refuse_fitted_text(models, cfg) -> list[dict]:
    """`refuse_fitted` for an eval command scoring its --text / --dataset, with its --allow-fitted-text."""
    return refuse_fitted(models, [(opt("text"), cfg.text), (opt("dataset"), cfg.dataset)], cfg.allow_fitted_text,
                         opt("allow_fitted_text"))
