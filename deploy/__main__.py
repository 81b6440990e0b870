"""``python -m deploy [flags]``: the same as ``k3serve serve [flags]`` (deploy/serve.py). A
Ctrl-C before the launcher has set its own handler (while it imports) ends it with one line
and exit status 130, as ``k3serve`` does."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    try:
        from deploy.serve import main

        code = main()
    except KeyboardInterrupt:
        print("k3serve: interrupted", file=sys.stderr, flush=True)
        code = 130
    raise SystemExit(code)
