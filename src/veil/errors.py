"""One error type for every bad input a user can give veil.

The CLI catches `VeilError` and prints its message as one line, exit code 2, no traceback.
"""

from __future__ import annotations


class VeilError(Exception):
    """A problem with the user's input: a file, a config key, a name, a shape."""


def check(condition: bool, message: str) -> None:
    """Raise `VeilError(message)` unless `condition` holds."""
    if not condition:
        raise VeilError(message)
