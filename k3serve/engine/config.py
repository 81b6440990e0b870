"""Engine capacities and policy (:class:`EngineConfig`) and its counters (:class:`EngineStats`)."""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.engine.spec.config import SpecConfig


@dataclass(frozen=True)
class EngineConfig:
    """Engine capacities and policy.

    Attributes:
        block_size: tokens per latent page / hashed block ``B``.
        num_pages: latent pages ``P`` (capacity ``P·B`` tokens).
        num_slots: KDA state slots (running + held + reserved sequences).
        num_snapshots: KDA snapshot budget.
        max_num_batched_tokens: tokens per step (prefill chunks + decodes).
        max_num_seqs: most running sequences (``None``: ``num_slots``).
        enable_prefix_caching: reuse cached prefixes (blocks + snapshots).
        snapshot_interval_tokens: also snapshot every this many prompt tokens (0: off).
        rolling_snapshot_fraction: share of ``num_snapshots`` that decoding sequences may pin
            for their end-of-request snapshots (``CacheConfig.rolling_snapshot_fraction``).
        dense_snapshot_blocks: log-spaced prompt snapshots so the first divergence hits
            (``CacheConfig.dense_snapshot_blocks``; 0: off; -1: chosen from the byte
            arithmetic, ``k3serve.cache.specs.auto_dense_snapshot_blocks``).
        max_model_len: cap on prompt + output tokens (``None``: the model's, and at most
            ``P·B``).
        record_logits: keep each sampled token's logits in the outputs (tests).
        max_events: cache events kept for readers.
        gpu_memory_utilization: CUDA only: the share of the accelerator's memory this engine
            may hold (weights already loaded + activations + pools), as vLLM / SGLang's flag;
            the pools are then sized from what is free after the weights load
            (:func:`~k3serve.engine.memory.size_pools_from_memory`): ``num_slots = max(num_slots, max_num_seqs)``,
            ``num_snapshots`` as given, and ``num_pages`` from the rest (``num_pages`` is then
            ignored). ``None``: the explicit sizes (always on CPU).
        cuda_graphs: CUDA only: replay captured decode graphs
            (:class:`~k3serve.engine.cuda_graphs.CUDAGraphRunner`; buckets up to
            ``max_num_seqs`` or ``num_slots``); the pools get one scratch slot and page.
        speculative: speculative decoding (:class:`~k3serve.engine.spec.config.SpecConfig`)
            or ``None`` (off).
    """

    block_size: int = 64
    num_pages: int = 1024
    num_slots: int = 32
    num_snapshots: int = 32
    max_num_batched_tokens: int = 512
    max_num_seqs: int | None = None
    enable_prefix_caching: bool = True
    snapshot_interval_tokens: int = 0
    rolling_snapshot_fraction: float = 0.5
    dense_snapshot_blocks: int = 0
    max_model_len: int | None = None
    record_logits: bool = False
    max_events: int = 100_000
    gpu_memory_utilization: float | None = None
    cuda_graphs: bool = True
    speculative: SpecConfig | None = None

    def __post_init__(self) -> None:
        def check(fld: str, lo: int, optional: bool = False) -> None:
            v = getattr(self, fld)
            if optional and v is None:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                none = " or None" if optional else ""
                raise ValueError(f"EngineConfig.{fld}: must be an int ≥ {lo}{none}, got {v!r}")

        for fld in ("block_size", "num_pages", "num_slots", "max_num_batched_tokens", "max_events"):
            check(fld, 1)
        check("num_snapshots", 0)
        check("snapshot_interval_tokens", 0)
        check("dense_snapshot_blocks", -1)
        check("max_num_seqs", 1, optional=True)
        check("max_model_len", 2, optional=True)  # a prompt token and a generated one
        util = self.gpu_memory_utilization
        if util is not None and (
            isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1
        ):
            raise ValueError(
                f"EngineConfig.gpu_memory_utilization: must be a number in (0, 1] or None, "
                f"got {util!r}"
            )
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"EngineConfig.cuda_graphs: must be a bool, got {self.cuda_graphs!r}")
        if self.speculative is not None and not isinstance(self.speculative, SpecConfig):
            raise ValueError(
                f"EngineConfig.speculative: must be a SpecConfig or None, got {self.speculative!r}"
            )
        frac = self.rolling_snapshot_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac <= 1:
            raise ValueError(
                f"EngineConfig.rolling_snapshot_fraction: must be a number in [0, 1], got {frac!r}"
            )


@dataclass
class EngineStats:
    """Counters since start (tokens)."""

    num_steps: int = 0
    num_forwards: int = 0
    num_mixed_steps: int = 0  # steps with prefill chunks and decodes together
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0


__all__ = ["EngineConfig", "EngineStats"]
