"""The one exception class for mistakes in what the user gave (a flag, a config value, a path, a checkpoint).

`python -m mhar_lit` prints a UserError as one line (`error: ...`) and exits non-zero; anything else is a bug
and keeps its traceback. `--debug` (or MHAR_DEBUG=1) shows the traceback of a UserError too.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input, named in the message. A ValueError, so `except ValueError` callers keep working."""


class UserFileNotFoundError(UserError, FileNotFoundError):
    """A path the user gave does not exist (also a FileNotFoundError)."""
