"""Parallelism inside one instance (issue 16): the expert placement planner (``planner``, pure
numpy), per-layer expert load counters (``counters``), expert parallelism with static-shape
all-to-all dispatch (``ep``), tensor parallelism for KDA / MLA / dense MLPs (``tp``) and the
multi-process instance runner (``runner``) over ``torch.distributed``.

Importing this package imports no torch; the submodules other than ``planner`` do.
"""
