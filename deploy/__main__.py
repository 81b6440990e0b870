"""``python -m deploy [flags]``: the same as ``k3serve serve [flags]``."""

from __future__ import annotations

from deploy.launcher import main

if __name__ == "__main__":
    raise SystemExit(main())
