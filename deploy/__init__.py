"""deploy — starting a k3serve stack, and what operators point at it.

::

    deploy/launcher.py     start_stack / serve (``k3serve serve`` = ``python -m deploy``): one
                           launcher, backends behind LaunchBackend
    deploy/local.py        backend "local": components as child processes that die with it
    deploy/grafana/        the dashboard (k3serve:* metrics)
    deploy/prometheus.yml  scrape config for the router and the workers
"""
