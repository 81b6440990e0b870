"""``python -m deploy [flags]``: the same as ``k3serve serve [flags]`` (deploy/serve.py)."""

from __future__ import annotations

from deploy.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
