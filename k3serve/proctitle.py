"""The process title that ``ps`` shows (``k3serve serve``, ``k3serve router :8000``, ...).

setproctitle writes the title over the process's argv area; with ``SPT_NOENV`` set (the default
here, unless the environment sets it) it leaves the environment block alone, so
``/proc/PID/environ`` stays readable and a long title is cut to the argv area's length.
"""

from __future__ import annotations

import os


def set_title(title: str) -> None:
    """Show ``title`` as this process's name in ``ps`` / ``top``."""
    os.environ.setdefault("SPT_NOENV", "1")
    from setproctitle import setproctitle

    setproctitle(title)
