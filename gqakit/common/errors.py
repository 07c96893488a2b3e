"""The one exception type that the CLI turns into a one-line message and a non-zero exit."""
from __future__ import annotations


class GqakitError(Exception):
    """A user error: the message names the problem, the numbers and the fix, on one line."""
