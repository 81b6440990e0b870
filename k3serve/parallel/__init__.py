"""Parallelism inside one instance (issue 16): the expert placement planner (``planner``, pure
numpy), per-layer expert load counters (``counters``), expert parallelism with static-shape
all-to-all dispatch (``ep``), tensor parallelism for KDA / MLA / dense MLPs (``tp``), per-rank
cache specs and the TP pairing rule (``layout``, torch-free) and the multi-process instance
runner (``runner``) over ``torch.distributed``.

Importing this package imports no torch; ``planner`` and ``layout`` do not either.
"""
