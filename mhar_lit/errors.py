"""The one exception class for mistakes in what the user gave (a flag, a config value, a path, a checkpoint).

`python -m mhar_lit` prints a UserError as one line (`error: ...`) and exits non-zero; anything else is a bug
and keeps its traceback. `--debug` (or MHAR_DEBUG=1) shows the traceback of a UserError too.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from typing import Callable, Optional

USER_ERROR_EXIT = 2  # as argparse / jsonargparse for a bad flag


class UserError(ValueError):
    """Bad input, named in the message. A ValueError, so `except ValueError` callers keep working."""


class UserFileNotFoundError(UserError, FileNotFoundError):
    """A path the user gave does not exist (also a FileNotFoundError)."""


def debug_enabled() -> bool:
    """MHAR_DEBUG set to anything but '' or '0' (`--debug` on the command line sets it)."""
    return os.environ.get("MHAR_DEBUG", "") not in ("", "0")


_URI_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@'\"]+):[^@\s/'\"]+@")


def redact_credentials(text: str) -> str:
    """`scheme://user:secret@host` -> `scheme://user:***@host` anywhere in `text` (printed and uploaded
    configs); the URI the logger uses is left as given."""
    return _URI_PASSWORD.sub(r"\1:***@", text)


def report_user_error(err: BaseException) -> int:
    """Print `error: MESSAGE` to stderr (a URI's password shown as ***) and return the exit code for it."""
    print(f"error: {redact_credentials(str(err))}", file=sys.stderr)
    return USER_ERROR_EXIT


def exits_on_user_error(*kinds: type[BaseException]) -> Callable:
    """Decorate a tool's `main(argv) -> int`: an exception of `kinds` (default UserError) is printed as one line
    and returns USER_ERROR_EXIT, or re-raised with its traceback under MHAR_DEBUG."""
    kinds = kinds or (UserError,)

    def decorate(main: Callable[[Optional[list[str]]], int]) -> Callable[[Optional[list[str]]], int]:
        @functools.wraps(main)
        def wrapper(argv: Optional[list[str]] = None) -> int:
            try:
                return main(argv)
            except kinds as err:
                if debug_enabled():
                    raise
                return report_user_error(err)
        return wrapper
    return decorate
