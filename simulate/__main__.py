"""``python -m simulate`` = ``k3serve simulate``."""

from simulate.cli import main

raise SystemExit(main())
