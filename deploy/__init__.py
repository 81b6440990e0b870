"""deploy — starting a k3serve stack, planning one, and what operators point at it.

::

    deploy/serve.py        ``k3serve serve`` (= ``python -m deploy``): the flags, run until stopped
    deploy/launcher.py     start_stack: one launcher, backends behind LaunchBackend
    deploy/local.py        backend "local": components as child processes that die with it
    deploy/ray_backend.py  backend "ray": instances as Ray actors from a deployment config
    deploy/config.py       deployment configs (deploy/configs/*.yaml)
    deploy/plan.py         ``k3serve plan``: per-rank memory of a deployment config
    deploy/experts.py      ``k3serve experts plan``: expert placement with redundant copies
    deploy/grafana/        the dashboard (k3serve:* metrics)
    deploy/prometheus/     scrape config and recording rules for the router and the workers
"""
