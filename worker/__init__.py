"""worker — the plumbing a prefill or decode worker process is built on (not the roles).

::

    worker/config.py        WorkerConfig (frozen; flags + environment, read once), parse_config
    worker/loop.py          EngineLoop (the engine thread), build_engine
    worker/base.py          BaseWorker (engine, kvstore engine, metrics, info/usage), Failure
    worker/http.py          create_app: common routes, cluster-token check, ErrorBody answers
    worker/metrics.py       WorkerMetrics (DESIGN.md §6 worker names)
    worker/registration.py  register with the router, again after its restart
    worker/serve.py         serve(): bind (a taken port is one line), build, run uvicorn

The roles live in ``prefill/worker.py`` and ``decode/worker.py``; the request lifecycle they
implement is numbered in :mod:`k3serve.protocol`. Import direction: worker imports k3serve and
kvstore; k3serve imports neither.
"""
