"""Process-level helpers shared by the launcher, the router and the workers.

* :func:`set_title` — the process title that ``ps`` shows (``k3serve serve``,
  ``k3serve router :8000``, ...). setproctitle writes the title over the process's argv area;
  with ``SPT_NOENV`` set (the default here, unless the environment sets it) it leaves the
  environment block alone, so ``/proc/PID/environ`` stays readable and a long title is cut to
  the argv area's length.
* :class:`FlagParser` — an ``argparse.ArgumentParser`` that lists the actions of its arguments
  in ``flags``, so ``k3serve serve`` can pass the router's and the workers' own flags through
  without reading argparse's private fields.
"""

from __future__ import annotations

import argparse
import os


def set_title(title: str) -> None:
    """Show ``title`` as this process's name in ``ps`` / ``top``."""
    os.environ.setdefault("SPT_NOENV", "1")
    from setproctitle import setproctitle

    setproctitle(title)


class FlagParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose ``flags`` lists every action ``add_argument`` created, in
    order (``-h`` included)."""

    def add_argument(self, *args, **kwargs) -> argparse.Action:  # type: ignore[override]
        action = super().add_argument(*args, **kwargs)
        if "flags" not in self.__dict__:  # ArgumentParser.__init__ adds -h before ours runs
            self.flags: list[argparse.Action] = []
        self.flags.append(action)
        return action
