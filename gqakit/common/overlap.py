"""Whether held-out text is also training or calibration text: the check that keeps a held-out score held out.

Two inputs count as one text when they are the same file or folder, or when some data file of one starts with the
same bytes as some data file of the other: their first `HEAD` bytes, or all of the shorter one when that is at least
`MIN_SHARED` bytes or the two files are equal (a copy, a prefix or a truncation of the other, the same file under
two names). In a folder only data files count (.txt, .jsonl, .json, .parquet, .arrow), not the metadata that any two
datasets of one schema share (`save_to_disk`'s dataset_info.json / state.json, READMEs, licences). Only those heads
are read, so the check costs little on large corpora; a passage cut from the middle of a training file is not caught
(keep held-out text in files of its own). Hub datasets (`hf:NAME`) are not read.
"""
from __future__ import annotations

from pathlib import Path

from gqakit.common.errors import GqakitError

HEAD = 4096  # bytes: different books, articles or datasets differ well within it; a shared licence header does not
MIN_SHARED = 256  # bytes a shorter file must hold to count as a part of another it begins (unless they are equal)
DATA_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet", ".arrow")
METADATA = ("dataset_info.json", "dataset_dict.json", "state.json")


def data_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES
                      and p.name not in METADATA and not p.name.startswith((".", "README", "LICENSE")))
    return []


def head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(HEAD)


def shared_text(a: str | Path, b: str | Path) -> tuple[Path, Path] | None:
    """A pair of files, one from each input, that hold the same text by the module's rule (the inputs themselves when
    they are one path), or None."""
    a, b = Path(a).expanduser(), Path(b).expanduser()
    if str(a).startswith("hf:") or str(b).startswith("hf:") or not a.exists() or not b.exists():
        return None
    if a.resolve() == b.resolve():
        return a, b
    # b's heads by their first MIN_SHARED bytes (a match shares at least those), and whole by content (equal files)
    by_start: dict[bytes, list[tuple[bytes, Path]]] = {}
    whole: dict[bytes, Path] = {}
    for path in data_files(b):
        start = head(path)
        if start:
            whole.setdefault(start, path)
            by_start.setdefault(start[:MIN_SHARED], []).append((start, path))
    for path in data_files(a):
        start = head(path)
        if start in whole and len(start) < HEAD:  # two whole files, equal (short ones included)
            return path, whole[start]
        if len(start) < MIN_SHARED:
            continue
        for other, where in by_start.get(start[:MIN_SHARED], ()):
            n = min(len(start), len(other))
            if start[:n] == other[:n]:
                return path, where
    return None


def refuse_shared(held: tuple[str, str], used: list[tuple[str, str]], fix: str) -> None:
    """Refuse in one line when the held-out input `held` (key, path) holds the same text as one of `used`."""
    key, path = held
    for other_key, other in used:
        pair = shared_text(path, other)
        if pair is not None:
            detail = ("the same file" if pair[0].resolve() == pair[1].resolve() else
                      f"{pair[0]} and {pair[1]} start alike: a copy, or one a part of the other")
            raise GqakitError(f"{key} {path} and {other_key} {other} hold the same text ({detail}), so the held-out "
                              f"score would count text the model was fitted on; {fix}")
