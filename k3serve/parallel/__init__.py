"""Parallelism inside one instance: the expert placement a worker serves (``expert_plan``, pure
numpy; the planner that computes one is ``deploy/experts.py``), per-layer expert load counters
(``counters``), expert parallelism with static-shape all-to-all dispatch (``ep``), tensor
parallelism for KDA / MLA / dense MLPs (``tp``), per-rank cache specs and the TP pairing rule
(``layout``, torch-free) and the multi-process instance runner (``runner``) over
``torch.distributed``.

Importing this package imports no torch; ``expert_plan`` and ``layout`` do not either.
"""
