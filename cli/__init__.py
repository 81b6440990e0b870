"""The ``k3serve`` command line and its load generator, above the core and the deploy tools.

::

    cli/main.py       ``k3serve`` (``python -m cli``): info, generate, bench, experts plan here;
                      serve, plan and simulate run deploy/ and simulate/ in this process
    cli/help.py       the help formatter every ``k3serve`` command shares
    cli/bench/        ``k3serve bench``: trace replay or random load against a live stack

Nothing below (k3serve/, router/, worker/, deploy/, simulate/) imports this package.
"""
