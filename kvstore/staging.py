"""Host staging: GPU pools reach the Transfer Engine through one pinned host mirror.

Why: Mooncake's ``tcp`` transport moves CUDA memory through the host itself, one 64 KiB slice
at a time (a ``cudaMemcpy`` per slice on each side, issued from TE's worker threads, ordered
behind whatever the serving process has queued on the device). Between the prefill and decode
processes of one H200 that gave 0.022 GB/s (``docs/results/gpu_serve.md``, 2026-12-01).
With staging, TE only ever sees host memory and CUDA does each copy once, in bulk:

    prefill GPU pools ──(per layer, one cudaMemcpyAsync per page run / state)──▶ pinned mirror
        ──(TE write, host → host; tcp or rdma)──▶ decode pinned mirror
        ──(at admission, before the request runs)──▶ decode GPU pools

The mirror has the pools' shapes and dtypes (so the fingerprint, the runs and their merging are
unchanged: the advertised :class:`~kvstore.layout.PoolLayout` is the mirror's, with host
addresses), and a request's bytes sit at the same slot / page positions as on the device.
Cost: host memory equal to the transferred pools (k3-mini worker defaults: 1.08 GB pinned per
worker; ``K3SERVE_KV_STAGING=direct`` turns it off and registers the device pools themselves).

Ordering: :meth:`HostStaging.stage_out` enqueues the device→host copies on the current CUDA
stream after the kernels that wrote the layer and returns a readiness check (a CUDA event); the
sender submits that layer's TE writes only once it is ready. :meth:`HostStaging.stage_in`
copies a landed request host→device on the current stream and waits for it (a few ms), so the
mirror region may be reused as soon as it returns. CPU pools (tests, CI) use the same code with
plain synchronous copies and an unpinned mirror.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstore.descriptors import CacheRef
from kvstore.layout import PAGE, SLOT, PoolLayout

#: ``K3SERVE_KV_STAGING`` values: ``auto`` (host staging for CUDA pools, none for CPU pools),
#: ``host`` (always), ``direct`` (never: TE reads / writes the pool tensors themselves).
STAGING_MODES = ("auto", "host", "direct")

_NAMES = ("kda_state", "conv_state", "mla_latent")


def _ranges(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive runs of ``ids`` as ``(first, count)``, in order: [7, 8, 2] → [(7, 2), (2, 1)]."""
    out: list[tuple[int, int]] = []
    for p in ids:
        p = int(p)
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


class HostStaging:
    """A host mirror of the transferred pools (module docstring).

    Args:
        device_pools: ``{"kda_state": [L_kda, S, H, K, V], "conv_state": [L_kda, S, W-1, C],
            "mla_latent": [L_mla, P, B, D] or None}`` tensors (any device; dim 0 layer, dim 1
            slot / page, each item contiguous).
        layout: the :class:`PoolLayout` of ``device_pools`` (names the global layers; its model
            and fingerprint extras are kept).

    Attributes:
        layout: the mirror's layout (host addresses): register it with the TE and advertise it.
        pinned: whether the mirror is page-locked (CUDA pools).

    Raises:
        ValueError: a region of ``layout`` has no tensor in ``device_pools`` or a different shape.
    """

    def __init__(self, device_pools: dict[str, torch.Tensor | None], layout: PoolLayout) -> None:
        self.device = {n: t for n, t in device_pools.items() if t is not None}
        self.device_layout = layout
        self.pinned = any(t.is_cuda for t in self.device.values())
        self._cuda = next((t.device for t in self.device.values() if t.is_cuda), None)
        self.host: dict[str, torch.Tensor] = {}
        for r in layout.regions:
            t = self.device.get(r.name)
            if t is None:
                raise ValueError(f"HostStaging: region {r.name} has no pool tensor")
            if tuple(t.shape[2:]) != r.item_shape or t.shape[0] != len(r.layers):
                raise ValueError(f"HostStaging: {r.name} shape {tuple(t.shape)} != its layout")
            self.host[r.name] = torch.zeros(
                t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pinned
            )
        h = self.host
        self.layout = PoolLayout.from_pools(
            h["kda_state"],
            h["conv_state"],
            h.get("mla_latent"),
            kda_layers=layout.region("kda_state").layers,
            mla_layers=layout.region("mla_latent").layers if "mla_latent" in h else (),
            model=layout.model,
            extra=layout.extra,
        )
        if self.layout.fingerprint() != layout.fingerprint():  # same bytes, same meaning
            raise ValueError("HostStaging: the mirror's fingerprint differs from the pools'")

    @classmethod
    def from_kvpools(cls, pools: Any, layout: PoolLayout) -> HostStaging:
        """The mirror of a ``KVPools`` (duck-typed: ``kda_state``, ``conv_state``,
        ``mla_latent``) whose layout is ``layout``."""
        return cls({n: getattr(pools, n, None) for n in _NAMES}, layout)

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the mirror holds."""
        return sum(t.numel() * t.element_size() for t in self.host.values())

    # ------------------------------------------------------------------ copies
    def _copy_layer(
        self,
        to_host: bool,
        layer: int,
        slot: int | None,
        pages: Sequence[int],
        last_tokens: int | None = None,
    ) -> None:
        """Copy one global layer's slot item (``slot`` not None) and ``pages`` between device
        and mirror; ``last_tokens``: only that many tokens of the last page (None: whole)."""
        for r in self.layout.regions:
            if layer not in r.layers:
                continue
            j = r.layers.index(layer)
            d, h = self.device[r.name][j], self.host[r.name][j]
            src, dst = (d, h) if to_host else (h, d)
            nb = self.pinned
            if r.kind == SLOT:
                if slot is not None:
                    dst[slot].copy_(src[slot], non_blocking=nb)
            elif r.kind == PAGE and pages:
                whole = list(pages)
                if last_tokens is not None and last_tokens < r.tokens_per_item:
                    p = int(whole.pop())
                    dst[p, :last_tokens].copy_(src[p, :last_tokens], non_blocking=nb)
                for p0, n in _ranges(whole):
                    dst[p0 : p0 + n].copy_(src[p0 : p0 + n], non_blocking=nb)

    def stage_out(
        self, ref: CacheRef, layer: int, token_start: int, token_end: int, with_state: bool
    ) -> Callable[[], bool] | None:
        """Copy global ``layer``'s cache of one request device → mirror: the pages holding
        tokens ``[token_start, token_end)`` (whole pages) and, with ``with_state``, its KDA /
        conv state slot.

        Returns:
            ``None`` when the copy is complete on return (CPU pools, or nothing to copy), else
            a non-blocking check that is True once the copies have landed (a CUDA event
            recorded after them on the current stream).

        Raises:
            ValueError: the layer has no cache in the layout.
        """
        regions = self.layout.locate(layer)  # ValueError for a layer without cache
        b = next((r.tokens_per_item for r, _ in regions if r.kind == PAGE), 0)
        pages: Sequence[int] = ()
        if b and token_end > token_start:
            pages = ref.pages[token_start // b : -(-token_end // b)]
        if not pages and not with_state:
            return None
        with torch.inference_mode():
            self._copy_layer(True, layer, ref.slot if with_state else None, pages)
        if not self.pinned:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self._cuda))
        return ev.query

    def stage_in(self, slot: int, pages: Sequence[int], num_tokens: int | None = None) -> None:
        """Copy a landed request mirror → device pools (every layer: slot ``slot``, the latent
        ``pages`` holding tokens ``[0, num_tokens)``; None: the pages whole) and wait until
        the device has it. Nothing outside the request's tokens changes on the device."""
        b = self.layout.block_size
        last = None
        if num_tokens is not None and b and pages:
            last = int(num_tokens) - (len(pages) - 1) * b
            if not 0 < last <= b:
                raise ValueError(f"num_tokens {num_tokens} does not fill {len(pages)} pages of {b}")
        with torch.inference_mode():
            for layer in self.layout.layers:
                self._copy_layer(False, layer, int(slot), list(pages), last)
        if self.pinned:
            torch.cuda.current_stream(self._cuda).synchronize()

    def stage_in_ref(self, ref: CacheRef) -> None:
        """:meth:`stage_in` of a reservation: its slot and the pages holding its
        ``num_tokens`` tokens."""
        b = self.layout.block_size
        pages = ref.pages[: -(-ref.num_tokens // b)] if b else ()
        self.stage_in(ref.slot, pages, ref.num_tokens if pages else None)


def make_staging(mode: str, pools: Any, layout: PoolLayout) -> HostStaging | None:
    """The staging a worker uses for ``pools`` (``KVPools``-like) under ``K3SERVE_KV_STAGING``
    ``mode``: a :class:`HostStaging` for ``host``, and for ``auto`` when the pools are on CUDA;
    else ``None`` (the TE registers the pools themselves).

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in STAGING_MODES:
        raise ValueError(f"K3SERVE_KV_STAGING={mode!r}: expected one of {STAGING_MODES}")
    if mode == "direct":
        return None
    on_cuda = any(getattr(getattr(pools, n, None), "is_cuda", False) for n in _NAMES)
    if mode == "auto" and not on_cuda:
        return None
    return HostStaging.from_kvpools(pools, layout)


__all__ = ["STAGING_MODES", "HostStaging", "make_staging"]
