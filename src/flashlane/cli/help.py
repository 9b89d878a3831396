"""`--help` that shows every flag's default, and errors that come from the subcommand's parser."""

from __future__ import annotations

import argparse
import difflib


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, except where the help text already says what the default is
    (``default: ...`` written out), and with readable on/off, lists and "none"."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("%(default)" in text or "default" in text.lower() or action.default is argparse.SUPPRESS
                or action.required):
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        if action.default is None or (isinstance(action.default, (list, tuple, dict)) and not action.default):
            return text + " (default: none)"
        if isinstance(action.default, bool) or action.nargs == 0:
            return text + (" (default: on)" if action.default else " (default: off)")
        if isinstance(action.default, (list, tuple)):
            return text + " (default: " + ",".join(str(v) for v in action.default) + ")"
        return text + " (default: %(default)s)"


def unknown_arguments_error(parser: argparse.ArgumentParser, extras: list[str]) -> None:
    """``parser.error`` for arguments no option took, with the closest spelling of a flag."""
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    for arg in extras:
        if arg.startswith("-"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1)
            if close:
                hints.append(f"{arg.split('=', 1)[0]} -> did you mean {close[0]}?")
    parser.error(f"unrecognized arguments: {' '.join(extras)}" + ("; " + "; ".join(hints) if hints else ""))
