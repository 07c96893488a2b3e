"""sha256 of a file's bytes, or of a folder's files: what a record compares to tell whether its inputs changed."""
from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_of(path: Path, skip: tuple[str, ...] = ()) -> str:
    """Hex sha256 of a file's bytes, or of a folder's files' bytes in sorted path order (names in `skip` left
    out), read in 1 MiB blocks."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and p.name not in skip)
    digest = hashlib.sha256()
    for f in files:
        with open(f, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
