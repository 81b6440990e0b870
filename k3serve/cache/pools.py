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

    # ------------------------------------------------------------------ bytes (shared store)
    @staticmethod
    def _raw(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8).cpu()

    def block_nbytes(self) -> int:
        """Bytes of one page over all MLA layers (``[L_mla, B, D]``)."""
        return self.mla_latent[:, 0].numel() * self.mla_latent.element_size()

    def snapshot_nbytes(self) -> int:
        """Bytes of one snapshot (``[L_kda, H, K, V]`` float32 + ``[L_kda, W-1, C]``)."""
        return (self.snap_state[:, 0].numel() * 4
                + self.snap_conv[:, 0].numel() * self.snap_conv.element_size())

    def block_bytes(self, page: int) -> torch.Tensor:
        """A copy of page ``page`` of every MLA layer as ``[block_nbytes]`` uint8 (CPU).

        Layout: ``mla_latent[:, page]`` (``[L_mla, B, D]``, row-major, the pool dtype).
        """
        self._check("page", page, self.num_pages)
        return self._raw(self.mla_latent[:, page])

    def load_block(self, page: int, data: bytes | torch.Tensor) -> None:
        """Write :meth:`block_bytes` output into page ``page``. Mutates the page.

        Raises:
            ValueError: ``page`` out of range or ``data`` of the wrong size.
        """
        self._check("page", page, self.num_pages)
        dst = self.mla_latent[:, page]
        src = self._from_bytes(data, self.block_nbytes(), "block")
        dst.copy_(src.view(dst.dtype).view(dst.shape))

    def snapshot_bytes(self, snap_id: int) -> torch.Tensor:
        """A copy of snapshot ``snap_id`` as ``[snapshot_nbytes]`` uint8 (CPU): the KDA states
        ``snap_state[:, id]`` then the conv states ``snap_conv[:, id]``."""
        self._check("snap_id", snap_id, self.num_snapshots)
        return torch.cat([self._raw(self.snap_state[:, snap_id]),
                          self._raw(self.snap_conv[:, snap_id])])

    def load_snapshot_bytes(self, snap_id: int, data: bytes | torch.Tensor) -> None:
        """Write :meth:`snapshot_bytes` output into snapshot ``snap_id``. Mutates it.

        Raises:
            ValueError: ``snap_id`` out of range or ``data`` of the wrong size.
        """
        self._check("snap_id", snap_id, self.num_snapshots)
        src = self._from_bytes(data, self.snapshot_nbytes(), "snapshot")
        st, cv = self.snap_state[:, snap_id], self.snap_conv[:, snap_id]
        n = st.numel() * 4
        st.copy_(src[:n].view(torch.float32).view(st.shape))
        cv.copy_(src[n:].view(cv.dtype).view(cv.shape))

    @staticmethod
    def _from_bytes(data: bytes | torch.Tensor, n: int, what: str) -> torch.Tensor:
        t = data if isinstance(data, torch.Tensor) else torch.frombuffer(bytearray(data),
                                                                            dtype=torch.uint8)
        if t.dtype != torch.uint8 or t.numel() != n:
            raise ValueError(f"data: a {what} is {n} bytes, got {t.numel()} ({t.dtype})")
        return t


__all__ = ["KVPools"]
