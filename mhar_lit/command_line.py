"""The one argument-parsing convention of every command: jsonargparse (as LightningCLI uses), underscore flags
(`--max_new_tokens`; the hyphenated spelling of a tool's own flags is accepted too), `--help`, and one line
`error: ...` with exit code 2 for anything wrong in what was given.

`OneLineErrors` is mixed into LightningCLI's parser (mhar_lit.cli) and into `CommandParser`, the parser of the
package's own tools, so a typo'd key, a missing config file or a bad value reads the same from every command:
one line, the close matches of an unknown key (`did you mean --model.warmup_steps?`), no 100 lines of usage.
`--debug` (or MHAR_DEBUG=1) shows jsonargparse's own message with its traceback instead.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import Any, NoReturn, Optional

from mhar_lit.errors import USER_ERROR_EXIT, debug_enabled

# The parts of jsonargparse's messages that name a key or a flag the parser does not have.
_UNKNOWN_PATTERNS = (
    re.compile(r"[Uu]nrecognized arguments:\s*(\S+)"),
    re.compile(r"[Nn]o action for key \"?([\w.\-]+)\"?"),
    re.compile(r"[Kk]ey \"?([\w.\-]+)\"? is not expected"),
    re.compile(r"[Nn]o action for destination key \"?([\w.\-]+)\"?"),
)


def known_keys(parser: Any) -> list[str]:
    """Every dotted key the parser accepts (`model.warmup_steps`, `trainer.max_steps`, `ckpt_path`)."""
    keys = []
    for action in getattr(parser, "_actions", []):
        dest = getattr(action, "dest", None)
        if dest and dest not in ("help", "config", "print_config") and not dest.startswith("=="):
            keys.append(dest)
        keys += [opt[2:] for opt in getattr(action, "option_strings", []) if opt.startswith("--")]
    return sorted(set(keys))


def unknown_key(message: str) -> Optional[str]:
    """The unknown key a jsonargparse message names (without leading dashes), or None."""
    for pattern in _UNKNOWN_PATTERNS:
        match = pattern.search(message)
        if match:
            return match.group(1).lstrip("-").split("=", 1)[0]
    return None


def close_matches(key: str, keys: list[str]) -> list[str]:
    """Up to three known keys close to `key`; the last dotted part is compared too (`warmup_stesp`)."""
    found = difflib.get_close_matches(key, keys, n=3, cutoff=0.75)
    if not found and "." in key:
        prefix, leaf = key.rsplit(".", 1)
        siblings = [k for k in keys if k.startswith(prefix + ".")]
        leaves = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[1] for k in siblings], n=3, cutoff=0.6)
        found = [f"{prefix}.{leaf}" for leaf in leaves]
    return found


def one_line(message: str) -> str:
    """jsonargparse's messages span lines (nested causes, indented details): one line, first cause first."""
    lines = [line.strip(" -") for line in str(message).splitlines()]
    return "; ".join(line for line in lines if line) or "invalid arguments"


class OneLineErrors:
    """Parser mixin: `error()` prints one line and exits USER_ERROR_EXIT (module docstring). `unknown_hint` is
    appended when an argument is not recognised (sweep: fit arguments go after `--`)."""

    unknown_hint: str = ""

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        if not getattr(self, "exit_on_error", True) or debug_enabled():
            super().error(message, ex)  # type: ignore[misc]  # raise for the caller, or the full story
        text = one_line(message)
        key = unknown_key(str(message))
        if key is not None:
            matches = close_matches(key, known_keys(self))
            if matches:
                text += " (did you mean " + " or ".join(f"--{m}" for m in matches) + "?)"
            if self.unknown_hint:
                text += f"; {self.unknown_hint}"
        prog = getattr(self, "prog", "").replace(" [options]", "")
        text += f" (see {prog} --help)" if prog and key is not None else ""
        from mhar_lit.tracking import redact_credentials

        print(f"error: {redact_credentials(text)}", file=sys.stderr)
        raise SystemExit(USER_ERROR_EXIT)


class RequiredGroupsAfterUnknown:
    """Parser mixin: a required mutually exclusive group (generate's --prompt / --prompt_file / --prompts_jsonl)
    is checked after the unrecognised arguments, as jsonargparse already does for required flags. argparse
    checks such a group while parsing, so `--ckptt x.ckpt --prompt hi` would read "one of the arguments
    --prompt ... is required" when the mistake is the typo: the typo has to be named first."""

    _deferred_groups: tuple = ()  # the required groups, while parsing (marked not required then)

    def _parse_known_args(self, *args: Any, **kwargs: Any):
        self._deferred_groups = tuple(g for g in self._mutually_exclusive_groups if g.required)
        self._mark_required(False)
        try:
            return super()._parse_known_args(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._mark_required(True)
            self._deferred_groups = ()

    def _mark_required(self, required: bool) -> None:
        for group in self._deferred_groups:
            group.required = required

    def format_usage(self) -> str:
        return self._as_declared(super().format_usage)  # type: ignore[misc]

    def format_help(self) -> str:
        return self._as_declared(super().format_help)  # type: ignore[misc]

    def _as_declared(self, format_text) -> str:
        """--help is answered while parsing: its text shows the deferred groups as required."""
        self._mark_required(True)
        try:
            return format_text()
        finally:
            self._mark_required(False)

    def parse_args(self, *args: Any, **kwargs: Any):
        parsed = super().parse_args(*args, **kwargs)  # type: ignore[misc]  # reports unknown arguments first
        for group in self._mutually_exclusive_groups:
            actions = group._group_actions
            if group.required and all(parsed.get(a.dest) == a.default for a in actions):
                names = " ".join(argparse._get_action_name(a) for a in actions)
                self.error(f"one of the arguments {names} is required")
        return parsed


def _help_formatter():
    """jsonargparse's help formatter keeping the description's line breaks (its usage examples)."""
    from jsonargparse import DefaultHelpFormatter

    return type("RawDescriptionHelpFormatter", (argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter), {})


def command_parser(command: str, description: str, unknown_hint: str = ""):
    """The jsonargparse parser of `python -m mhar_lit COMMAND`, with one-line errors."""
    from jsonargparse import ArgumentParser

    cls = type("CommandParser", (OneLineErrors, RequiredGroupsAfterUnknown, ArgumentParser),
               {"unknown_hint": unknown_hint})
    return cls(prog=f"python -m mhar_lit {command}", description=description, formatter_class=_help_formatter())


def checked_type(convert, ok, expected: str, kind: str):
    """An argument type: `convert` the text, then refuse values outside `ok`, naming what is expected."""
    return _Checked(convert, ok, expected, kind)


class _Checked:
    """A class so that --help names the type instead of printing a function's address."""

    def __init__(self, convert, ok, expected: str, kind: str) -> None:
        self.convert, self.ok, self.expected, self.kind = convert, ok, expected, kind

    def __call__(self, text):
        try:
            value = self.convert(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {self.kind}, got {text!r}") from None
        if not self.ok(value):
            raise argparse.ArgumentTypeError(f"must be {self.expected}, got {text}")
        return value

    def __repr__(self) -> str:
        return f"{self.convert.__name__} {self.expected}"


positive_int = checked_type(int, lambda v: v >= 1, ">= 1", "a whole number")
non_negative_float = checked_type(float, lambda v: v >= 0, ">= 0", "a number")
