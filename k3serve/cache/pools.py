"""The cache pool tensors of one worker (INTERFACES.md §1).

One contiguous tensor per kind, so a transfer engine can register each as one memory region::

    kda_state   [L_kda, S, H, K, V]     float32      KDA layer j, state slot s
    conv_state  [L_kda, S, W-1, 3*H*K] model dtype  channels q | k | v, oldest input first
    mla_latent  [L_mla, P, B, D]        model dtype  MLA layer m, page p, offset; D = [c_kv ; k_pe]
    snap_state  [L_kda, N_snap, H, K, V], snap_conv [L_kda, N_snap, W-1, 3*H*K]   snapshot id

The allocator (who owns which slot / page / snapshot) is pure bookkeeping elsewhere; this class
only holds tensors and copies between slots and snapshots.
"""

from __future__ import annotations

import torch

from k3serve.config import ModelConfig


class KVPools:
    """Allocated cache pools for one model config.

    Args:
        cfg: model config (layer counts, head shapes, conv kernel, latent width).
        num_slots: S, concurrent sequences with a KDA/conv state.
        num_pages: P, MLA latent pages.
        block_size: B, tokens per page.
        num_snapshots: N_snap, KDA snapshot slots (0 allowed).
        dtype: model dtype for conv states and latents (KDA states are always float32).
        device: where the pools live.

    Raises:
        ValueError: a non-positive ``num_slots`` / ``num_pages`` / ``block_size`` or negative
            ``num_snapshots``.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        num_pages: int,
        block_size: int = 64,
        num_snapshots: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, v, lo in (
            ("num_slots", num_slots, 1),
            ("num_pages", num_pages, 1),
            ("block_size", block_size, 1),
            ("num_snapshots", num_snapshots, 0),
        ):
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"KVPools.{name}: must be an int ≥ {lo}, got {v!r}")
        self.cfg = cfg
        self.num_slots, self.num_pages, self.block_size = num_slots, num_pages, block_size
        self.num_snapshots = num_snapshots
        self.dtype = dtype
        lk, h, k = cfg.num_kda_layers, cfg.kda_num_heads, cfg.kda_head_dim
        w1 = cfg.kda_conv_kernel - 1
        self.kda_state = torch.zeros(lk, num_slots, h, k, k, dtype=torch.float32, device=device)
        self.conv_state = torch.zeros(
            lk, num_slots, w1, cfg.kda_conv_dim, dtype=dtype, device=device
        )
        self.mla_latent = torch.zeros(
            cfg.num_mla_layers,
            num_pages,
            block_size,
            cfg.mla_latent_dim,
            dtype=dtype,
            device=device,
        )
        self.snap_state = torch.zeros(
            lk, num_snapshots, h, k, k, dtype=torch.float32, device=device
        )
        self.snap_conv = torch.zeros(
            lk, num_snapshots, w1, cfg.kda_conv_dim, dtype=dtype, device=device
        )

    # ------------------------------------------------------------------ sizes
    def nbytes(self) -> dict[str, int]:
        """Bytes of each pool tensor, keyed by pool name."""
        return {n: t.numel() * t.element_size() for n, t in self.tensors().items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The pool tensors by name (for registration with a transfer engine)."""
        return {
            "kda_state": self.kda_state,
            "conv_state": self.conv_state,
            "mla_latent": self.mla_latent,
            "snap_state": self.snap_state,
            "snap_conv": self.snap_conv,
        }

    # ------------------------------------------------------------------ slot / snapshot copies
    def _check(self, name: str, v: int, hi: int) -> None:
        if not (0 <= v < hi):
            raise ValueError(f"KVPools: {name} {v} out of range [0, {hi})")

    def zero_slot(self, slot: int) -> None:
        """Zero the KDA and conv state of ``slot`` (a fresh sequence). Mutates the pools."""
        self._check("slot", slot, self.num_slots)
        self.kda_state[:, slot].zero_()
        self.conv_state[:, slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy all KDA + conv state of slot ``src`` into slot ``dst``. Mutates ``dst``."""
        self._check("src", src, self.num_slots)
        self._check("dst", dst, self.num_slots)
        self.kda_state[:, dst].copy_(self.kda_state[:, src])
        self.conv_state[:, dst].copy_(self.conv_state[:, src])

    def save_snapshot(self, slot: int, snap_id: int) -> None:
        """Copy slot ``slot``'s KDA + conv state into snapshot ``snap_id``. Mutates the snapshot."""
        self._check("slot", slot, self.num_slots)
        self._check("snap_id", snap_id, self.num_snapshots)
        self.snap_state[:, snap_id].copy_(self.kda_state[:, slot])
        self.snap_conv[:, snap_id].copy_(self.conv_state[:, slot])

    def load_snapshot(self, snap_id: int, slot: int) -> None:
        """Copy snapshot ``snap_id`` into slot ``slot`` (a prefix hit). Mutates the slot."""
        self._check("slot", slot, self.num_slots)
        self._check("snap_id", snap_id, self.num_snapshots)
        self.kda_state[:, slot].copy_(self.snap_state[:, snap_id])
        self.conv_state[:, slot].copy_(self.snap_conv[:, snap_id])


__all__ = ["KVPools"]
