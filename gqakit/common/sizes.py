"""Byte sizes as people write them: '5GB' (10^9), '24GiB' (2^30), '512MB', or a plain number of bytes."""
from __future__ import annotations

import re

from gqakit.common.errors import GqakitError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"(\d+\.?\d*(?:e\d+)?|\.\d+)\s*([kmgt]?i?b)?", re.IGNORECASE)


def parse_size(value, what: str, examples: str) -> int:
    """Bytes from a size; a value that is not one is refused with one line naming `what` (the option) and
    `examples` (how to write one, e.g. '5GB, 500MB or 2GiB')."""
    match = _SIZE.fullmatch(str(value).strip())
    number = float(match.group(1)) if match and not isinstance(value, bool) else 0.0
    unit = (match.group(2) or "").lower() if match else ""
    if number <= 0 or unit not in _UNITS or int(number * _UNITS[unit]) <= 0:
        raise GqakitError(f"{what} {value!r} is not a size; write e.g. {examples}")
    return int(number * _UNITS[unit])
