"""``python -m cli`` = ``k3serve``."""

from cli.main import main

raise SystemExit(main())
