"""Cache specs: byte arithmetic of the two cache kinds, the layout fingerprint, cache sizing.

One spec per cache kind (vLLM v1 style), each owning its sizes:

* :class:`MLALatentSpec` — paged MLA latents. One page holds ``block_size`` tokens of every
  MLA layer: pool ``mla_latent [L_mla, P, B, D]`` with ``D = kv_lora_rank + qk_rope_head_dim``.
* :class:`KDAStateSpec` — per-sequence KDA recurrent state ``[H, K, V]`` (fp32) + conv state
  ``[W-1, 3·H·K]`` per KDA layer; a state slot and a snapshot have the same size.

Pure Python (no torch): the simulator and the router size caches at K3 scale with these.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from k3serve.config import DTYPE_BYTES, ModelConfig


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name (``"float32"``, ``"bfloat16"``, …).

    Raises:
        ValueError: unknown dtype name.
    """
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class CacheDtypes:
    """Element dtypes of the cache pools (names as in :mod:`k3serve.config`).

    Attributes:
        latent: MLA latent pool dtype (model dtype on GPU; float32 on CPU).
        conv: KDA conv-state dtype (the model dtype, DESIGN.md §2).
        state: KDA recurrent-state dtype (always float32 in K3).
    """

    latent: str
    conv: str
    state: str = "float32"

    def __post_init__(self) -> None:
        for f in ("latent", "conv", "state"):
            dtype_bytes(getattr(self, f))

    @classmethod
    def for_config(cls, cfg: ModelConfig, compute_dtype: str | None = None) -> CacheDtypes:
        """Pools in ``compute_dtype`` (CPU: ``"float32"``), or the model dtype when ``None``."""
        d = compute_dtype or cfg.dtype
        return cls(latent=d, conv=d, state="float32")


@dataclass(frozen=True)
class MLALatentSpec:
    """Paged MLA latent cache: pages of ``block_size`` tokens across all MLA layers.

    Attributes:
        block_size: tokens per page ``B``.
        num_layers: MLA layers ``L_mla``.
        latent_dim: values per token per layer ``D = kv_lora_rank + qk_rope_head_dim``.
        dtype_bytes: bytes per value.
    """

    block_size: int
    num_layers: int
    latent_dim: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size: must be ≥ 1, got {self.block_size}")
        if self.num_layers < 0 or self.latent_dim < 1 or self.dtype_bytes < 1:
            raise ValueError("MLALatentSpec: num_layers ≥ 0, latent_dim ≥ 1, dtype_bytes ≥ 1")

    @classmethod
    def from_config(
        cls, cfg: ModelConfig, block_size: int, dtype: str | None = None
    ) -> MLALatentSpec:
        """From a model config; ``dtype`` defaults to ``cfg.dtype``."""
        return cls(
            block_size, cfg.num_mla_layers, cfg.mla_latent_dim, dtype_bytes(dtype or cfg.dtype)
        )

    @property
    def bytes_per_token(self) -> int:
        """One token's latents across all MLA layers, bytes (K3: 24 × 576 × 2 = 27 648)."""
        return self.num_layers * self.latent_dim * self.dtype_bytes

    @property
    def block_bytes_per_layer(self) -> int:
        """One page of one MLA layer: ``B × D × dtype_bytes`` bytes (the unit a transfer moves)."""
        return self.block_size * self.latent_dim * self.dtype_bytes

    @property
    def page_size_bytes(self) -> int:
        """One page across all MLA layers, bytes."""
        return self.block_bytes_per_layer * self.num_layers

    def page_shape(self) -> tuple[int, int]:
        """``(B, D)``: one page of one layer in ``mla_latent [L_mla, P, B, D]``."""
        return (self.block_size, self.latent_dim)

    def num_pages_for(self, num_tokens: int) -> int:
        """Pages covering ``num_tokens`` tokens: ``⌈num_tokens / B⌉``."""
        return -(-num_tokens // self.block_size)

    def bytes_for(self, num_tokens: int) -> int:
        """Bytes of the pages covering ``num_tokens`` tokens (whole pages)."""
        return self.num_pages_for(num_tokens) * self.page_size_bytes


@dataclass(frozen=True)
class KDAStateSpec:
    """Per-sequence KDA cache: recurrent state + conv state in every KDA layer.

    Attributes:
        num_layers: KDA layers ``L_kda``.
        num_heads: ``H``.
        head_dim: ``K == V``.
        conv_kernel: ``W``; the conv state keeps the last ``W - 1`` pre-conv inputs.
        conv_dim: channels through the conv, ``3·H·K`` (q | k | v).
        state_dtype_bytes: recurrent state element bytes (4: float32).
        conv_dtype_bytes: conv state element bytes (model dtype).
    """

    num_layers: int
    num_heads: int
    head_dim: int
    conv_kernel: int
    conv_dim: int
    state_dtype_bytes: int = 4
    conv_dtype_bytes: int = 2

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtypes: CacheDtypes | None = None) -> KDAStateSpec:
        """From a model config; ``dtypes`` defaults to :meth:`CacheDtypes.for_config`."""
        d = dtypes or CacheDtypes.for_config(cfg)
        return cls(
            num_layers=cfg.num_kda_layers,
            num_heads=cfg.kda_num_heads,
            head_dim=cfg.kda_head_dim,
            conv_kernel=cfg.kda_conv_kernel,
            conv_dim=cfg.kda_conv_dim,
            state_dtype_bytes=dtype_bytes(d.state),
            conv_dtype_bytes=dtype_bytes(d.conv),
        )

    def state_shape(self) -> tuple[int, int, int]:
        """``(H, K, V)``: one layer's recurrent state in ``kda_state [L_kda, S, H, K, V]``."""
        return (self.num_heads, self.head_dim, self.head_dim)

    def conv_shape(self) -> tuple[int, int]:
        """``(W-1, 3·H·K)``: one layer's conv state in ``conv_state [L_kda, S, W-1, 3HK]``."""
        return (self.conv_kernel - 1, self.conv_dim)

    @property
    def state_bytes_per_layer(self) -> int:
        """``H × K × V × state_dtype_bytes`` bytes."""
        return self.num_heads * self.head_dim * self.head_dim * self.state_dtype_bytes

    @property
    def conv_bytes_per_layer(self) -> int:
        """``(W-1) × 3HK × conv_dtype_bytes`` bytes."""
        return (self.conv_kernel - 1) * self.conv_dim * self.conv_dtype_bytes

    @property
    def bytes_per_layer(self) -> int:
        """Recurrent + conv state of one layer, bytes."""
        return self.state_bytes_per_layer + self.conv_bytes_per_layer

    @property
    def slot_size_bytes(self) -> int:
        """One sequence's state across all KDA layers, bytes (K3: ≈ 414 MiB + 14.6 MiB)."""
        return self.bytes_per_layer * self.num_layers

    @property
    def snapshot_size_bytes(self) -> int:
        """A snapshot is a copy of a slot: same bytes."""
        return self.slot_size_bytes


def layout_fingerprint(
    cfg: ModelConfig,
    block_size: int,
    dtypes: CacheDtypes | Mapping[str, str],
    weights_id: str | None = None,
) -> str:
    """Fingerprint of everything that fixes the cache's bytes: the hash salt's base.

    Two workers may exchange cache (and hit each other's hashes) only when their fingerprints
    are equal: same model layout (``cfg.fingerprint_fields()``: layers, KDA shapes,
    ``kv_lora_rank`` and ``qk_rope_head_dim`` each, …), block size, pool dtypes and weights
    (two checkpoints of the same shape compute different caches for the same tokens).

    Args:
        cfg: the model config.
        block_size: tokens per page ``B``.
        dtypes: :class:`CacheDtypes` or a mapping with keys ``latent``, ``conv``, ``state``.
        weights_id: identity of the weights (``checkpoint_identity`` of a checkpoint,
            ``random_init_identity(seed)`` for random init; both in
            ``k3serve.model.checkpoint``); ``None`` when unknown (an engine built around a
            model object without one).

    Returns:
        32 lowercase hex characters (BLAKE2b-128 of canonical JSON).

    Raises:
        ValueError: ``block_size`` < 1, unknown dtype names or missing keys.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: must be an int ≥ 1, got {block_size!r}")
    if not isinstance(dtypes, CacheDtypes):
        try:
            dtypes = CacheDtypes(
                latent=dtypes["latent"], conv=dtypes["conv"], state=dtypes.get("state", "float32")
            )
        except KeyError as e:
            raise ValueError(f"dtypes: missing key {e}") from None
    doc = {
        "v": "k3serve-layout-2",
        "model": cfg.fingerprint_fields(),
        "block_size": block_size,
        "dtypes": [dtypes.latent, dtypes.conv, dtypes.state],
        "weights": weights_id,
    }
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


@dataclass(frozen=True)
class CacheConfig:
    """Capacities and policy of one worker's cache (the allocator's sizes).

    Attributes:
        num_pages: MLA latent pages ``P`` (each ``block_size`` tokens).
        num_slots: KDA state slots ``S`` (= max running sequences).
        num_snapshots: KDA snapshot budget ``N_snap`` (0 disables snapshots, hence hits).
        block_size: tokens per page / per hashed block ``B``.
        enable_prefix_caching: index full blocks and snapshots and reuse them.
        snapshot_interval_tokens: also snapshot every this many prompt tokens (rounded down
            to a block multiple, at least one block); 0 = off.
        rolling_snapshot_fraction: the most snapshots that decoding sequences may pin at once
            for their end-of-request snapshot (the *rolling* snapshot), as a fraction of
            ``num_snapshots`` (rounded down; in ``[0, 1]``). The rest stays for prompt
            snapshots: without a cap, ``num_snapshots`` concurrent decodes would pin the whole
            budget and every new prompt's snapshots would be skipped.
        dense_snapshot_blocks: log-spaced prompt snapshots (``prefix.log_snapshot_points``):
            every block up to this many blocks, then doubling spacings, so the first prompt
            that diverges from a cached one still hits; 0 = off. :func:`auto_dense_snapshot_blocks`
            picks it from the byte arithmetic.

    Raises:
        ValueError: a field out of range (named).
    """

    num_pages: int
    num_slots: int
    num_snapshots: int = 0
    block_size: int = 64
    enable_prefix_caching: bool = True
    snapshot_interval_tokens: int = 0
    rolling_snapshot_fraction: float = 0.5
    dense_snapshot_blocks: int = 0

    def __post_init__(self) -> None:
        frac = self.rolling_snapshot_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac <= 1:
            raise ValueError(
                f"CacheConfig.rolling_snapshot_fraction: must be a number in [0, 1], got {frac!r}"
            )
        for f, lo in (
            ("num_pages", 1),
            ("num_slots", 1),
            ("num_snapshots", 0),
            ("block_size", 1),
            ("snapshot_interval_tokens", 0),
            ("dense_snapshot_blocks", 0),
        ):
            v = getattr(self, f)
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"CacheConfig.{f}: must be an int ≥ {lo}, got {v!r}")

    @property
    def max_rolling_snapshots(self) -> int:
        """Snapshots decoding sequences may pin at once: ``⌊num_snapshots × fraction⌋``."""
        return int(self.num_snapshots * self.rolling_snapshot_fraction)

    @property
    def snapshot_interval_blocks(self) -> int:
        """Interval in blocks (0 = off)."""
        if self.snapshot_interval_tokens == 0:
            return 0
        return max(1, self.snapshot_interval_tokens // self.block_size)

    @classmethod
    def from_memory(
        cls,
        mla: MLALatentSpec,
        kda: KDAStateSpec,
        latent_bytes: int,
        num_slots: int,
        snapshot_bytes: int = 0,
        **policy: object,
    ) -> CacheConfig:
        """Size the pools from byte budgets.

        Args:
            mla: latent spec (its ``block_size`` becomes the config's).
            kda: state spec.
            latent_bytes: bytes for MLA pages.
            num_slots: state slots (their memory ``num_slots × kda.slot_size_bytes`` is on top).
            snapshot_bytes: bytes for snapshots.
            **policy: ``enable_prefix_caching``, ``snapshot_interval_tokens``,
                ``rolling_snapshot_fraction``.

        Raises:
            ValueError: a budget too small for one page.
        """
        pages = latent_bytes // mla.page_size_bytes if mla.page_size_bytes else 0
        if pages < 1:
            raise ValueError(
                f"latent_bytes: {latent_bytes} B holds no page of {mla.page_size_bytes} B"
            )
        snaps = snapshot_bytes // kda.snapshot_size_bytes if kda.snapshot_size_bytes else 0
        return cls(
            num_pages=pages,
            num_slots=num_slots,
            num_snapshots=snaps,
            block_size=mla.block_size,
            **policy,
        )  # type: ignore[arg-type]


#: :func:`auto_dense_snapshot_blocks`: log-spaced snapshots while one snapshot costs at most
#: this many blocks of latents.
MAX_DENSE_SNAPSHOT_COST_BLOCKS = 64


def auto_dense_snapshot_blocks(mla: MLALatentSpec, kda: KDAStateSpec) -> int:
    """The first-divergence snapshot policy chosen from the byte arithmetic (DESIGN.md §3).

    ``r`` = one snapshot's bytes / one page's bytes (blocks of latents a snapshot costs). Log-
    spaced snapshots (``dense_snapshot_blocks = 4``: every block to 256 tokens at ``B = 64``,
    then doubling spacings) take ``4 + 2·log2(L/256)`` snapshots per prompt — 10 for a
    2,048-token prompt, i.e. ``10·r`` blocks of memory in the snapshot budget (own LRU) and in
    the shared store:

    ========  =====================  ======  ====================================
    preset    snapshot               r       10 snapshots of a 2k prompt
    ========  =====================  ======  ====================================
    k3-tiny   0.45 MB                11–20   ~4.5 MB: on (4)
    k3-mini   20 MB                  23–45   ~200 MB: on (4)
    K3        429 MB                 ~250    4.3 GB per prompt: off (0)
    ========  =====================  ======  ====================================

    (``r`` ranges: float32 latents on CPU / bfloat16 on GPU.) At K3 sizes intervals crowd out
    latents (DESIGN.md §3's 512-token interval collapses to ~18 %), so there only the prompt-end,
    router-marked and end-of-answer snapshots are kept.

    Returns:
        4 when ``r ≤ MAX_DENSE_SNAPSHOT_COST_BLOCKS``, else 0.
    """
    r = kda.snapshot_size_bytes / max(1, mla.page_size_bytes)
    return 4 if r <= MAX_DENSE_SNAPSHOT_COST_BLOCKS else 0


__all__ = [
    "CacheConfig",
    "CacheDtypes",
    "KDAStateSpec",
    "MLALatentSpec",
    "auto_dense_snapshot_blocks",
    "dtype_bytes",
    "layout_fingerprint",
]
