"""The help formatter of every ``k3serve`` command."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` once: not when the help text already says what the default is,
    and not for ``None`` / ``False`` / suppressed defaults (a flag that is off says nothing); a
    zero (``0``, ``0.0``) is shown like any other default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or any(action.default is v
                                    for v in (None, False, argparse.SUPPRESS)):
            return action.help
        return super()._get_help_string(action)


def use_formatter(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` with :class:`HelpFormatter` (for parsers built by deploy/ and simulate/)."""
    parser.formatter_class = HelpFormatter
    return parser


__all__ = ["HelpFormatter", "use_formatter"]
