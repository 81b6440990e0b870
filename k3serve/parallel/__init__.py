"""Parallelism inside one instance: the expert placement a worker serves (``expert_plan``, pure
numpy; the planner that computes one is ``deploy/experts.py``), per-layer expert load counters
(``counters``), expert parallelism with static-shape all-to-all dispatch (``ep``), tensor
parallelism for KDA / MLA / dense MLPs (``tp``), data-parallel attention groups with the experts
over all ranks (``groups``), per-rank cache specs, the attention-group count and the TP pairing
rule (``layout``, torch-free), the transfer collectives between rank 0's staging and the ranks
(``transfer``) and the multi-process instance runner (``runner``) over ``torch.distributed``.

Importing this package imports no torch; ``expert_plan`` and ``layout`` do not either.
"""
