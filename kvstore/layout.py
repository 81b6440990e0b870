"""Pool layouts: what one worker's cache pools look like to the transfer engine (pure).

No mooncake, no torch (tensors are read by duck typing: ``data_ptr()``, ``stride()``,
``shape``, ``element_size()``, ``dtype``). The pools (docs/INTERFACES.md §1) are one tensor per
kind; every one is a *region*:

    region       shape                      item = what one request owns in one layer
    kda_state    [L_kda, S, H, K, V] fp32   one slot:  H·K·V·4 bytes            (kind "slot")
    conv_state   [L_kda, S, W-1, 3HK]       one slot:  (W-1)·3HK·dtype bytes    (kind "slot")
    mla_latent   [L_mla, P, B, D]           one page:  B tokens × D·dtype bytes (kind "page")

Address of item ``i`` of local layer ``j``:  ``base + j·layer_stride + i·item_stride``; inside
an item the bytes are contiguous (token ``o`` of a page at ``+ o·token_bytes``).

The wire forms are :class:`k3serve.messages.RegionLayoutMsg` / ``PoolLayoutMsg`` (the decode
side's layout travels in its ``PairResponse``); the fingerprint (:meth:`PoolLayout.fingerprint`)
is what both sides compare before any byte moves. Turning a layout and a request's slot/pages
into copy runs is :mod:`kvstore.descriptors`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from k3serve.messages import PoolLayoutMsg, RegionLayoutMsg
from kvstore.errors import FingerprintMismatch

SLOT = "slot"
PAGE = "page"


@dataclass(frozen=True)
class RegionLayout:
    """One pool tensor as seen by the transfer engine.

    Attributes:
        name: ``kda_state``, ``conv_state``, ``mla_latent`` (any name; both sides must agree).
        kind: ``"slot"`` (one item per sequence, sent whole) or ``"page"`` (paged tokens).
        base: address of element 0 (bytes, ``data_ptr()``).
        layers: global layer index of each local layer (dim 0 of the tensor).
        layer_stride: bytes between local layer j and j+1.
        item_stride: bytes between slot/page i and i+1.
        num_items: number of slots / pages.
        item_bytes: bytes of one item (contiguous).
        tokens_per_item: page size B in tokens for ``"page"``; 1 for ``"slot"``.
        dtype: element type name (``float32``, ``bfloat16``, ...).
        item_shape: shape of one item (e.g. ``(H, K, V)`` or ``(B, D)``).
    """

    name: str
    kind: str
    base: int
    layers: tuple[int, ...]
    layer_stride: int
    item_stride: int
    num_items: int
    item_bytes: int
    tokens_per_item: int = 1
    dtype: str = "uint8"
    item_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in (SLOT, PAGE):
            raise ValueError(
                f"RegionLayout {self.name}: kind must be 'slot' or 'page', not {self.kind!r}"
            )
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        object.__setattr__(self, "item_shape", tuple(int(x) for x in self.item_shape))
        if self.num_items <= 0 or self.item_bytes <= 0 or not self.layers:
            raise ValueError(f"RegionLayout {self.name}: empty region")
        if self.tokens_per_item <= 0 or self.item_bytes % self.tokens_per_item:
            raise ValueError(
                f"RegionLayout {self.name}: item_bytes {self.item_bytes} is not a multiple of "
                f"tokens_per_item {self.tokens_per_item}"
            )
        if self.kind == SLOT and self.tokens_per_item != 1:
            raise ValueError(f"RegionLayout {self.name}: a slot region has tokens_per_item 1")
        multi_l, multi_i = len(self.layers) > 1, self.num_items > 1
        if (
            (multi_l and self.layer_stride < self.item_bytes)
            or (multi_i and self.item_stride < self.item_bytes)
            or (multi_l and multi_i and self.layer_stride == self.item_stride)
        ):
            raise ValueError(
                f"RegionLayout {self.name}: strides (layer {self.layer_stride}, item "
                f"{self.item_stride}) overlap items of {self.item_bytes} bytes"
            )

    @property
    def token_bytes(self) -> int:
        """Bytes of one token inside a page (``item_bytes`` for a slot region)."""
        return self.item_bytes // self.tokens_per_item

    @property
    def extent(self) -> tuple[int, int]:
        """``(start address, length in bytes)`` covering every item: what to register."""
        end = (
            self.base
            + (len(self.layers) - 1) * self.layer_stride
            + (self.num_items - 1) * self.item_stride
            + self.item_bytes
        )
        return self.base, end - self.base

    def addr(self, local_layer: int, item: int, token: int = 0) -> int:
        """Address of ``token`` in item ``item`` of local layer ``local_layer`` (bytes)."""
        return (
            self.base
            + local_layer * self.layer_stride
            + item * self.item_stride
            + token * self.token_bytes
        )

    def fingerprint(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "dtype": self.dtype,
            "item_shape": list(self.item_shape),
            "item_bytes": self.item_bytes,
            "tokens_per_item": self.tokens_per_item,
            "layers": list(self.layers),
        }

    def to_msg(self) -> RegionLayoutMsg:
        """The wire form (addresses included: only the pairing sender sees it)."""
        return RegionLayoutMsg(
            name=self.name,
            kind=self.kind,
            base=self.base,
            layers=list(self.layers),
            layer_stride=self.layer_stride,
            item_stride=self.item_stride,
            num_items=self.num_items,
            item_bytes=self.item_bytes,
            tokens_per_item=self.tokens_per_item,
            dtype=self.dtype,
            item_shape=list(self.item_shape),
        )

    @classmethod
    def from_msg(cls, m: RegionLayoutMsg) -> RegionLayout:
        """Raises ValueError as the constructor (empty region, overlapping strides)."""
        return cls(
            **{**m.model_dump(), "layers": tuple(m.layers), "item_shape": tuple(m.item_shape)}
        )


def region_from_tensor(
    name: str, kind: str, t: Any, layers: tuple[int, ...] | list[int]
) -> RegionLayout:
    """Describe a pool tensor ``[L, N, *item]`` (dim 0 layer, dim 1 slot/page).

    Args:
        name: region name.
        kind: ``"slot"`` or ``"page"`` (for pages, dim 2 is the token in the page).
        t: a tensor (anything with ``data_ptr``, ``stride``, ``shape``, ``element_size``,
            ``dtype``); may be a strided view as long as each item is contiguous.
        layers: global layer index of each entry of dim 0.

    Raises:
        ValueError: fewer than 3 dims, ``len(layers) != shape[0]``, a non-contiguous item.
    """
    shape, stride, es = tuple(t.shape), tuple(t.stride()), int(t.element_size())
    if len(shape) < 3:
        raise ValueError(f"{name}: expected [L, N, *item], got shape {shape}")
    if len(layers) != shape[0]:
        raise ValueError(f"{name}: {len(layers)} layer ids for dim 0 of size {shape[0]}")
    expect = 1
    for size, st in zip(reversed(shape[2:]), reversed(stride[2:])):
        if size > 1 and st != expect:
            raise ValueError(f"{name}: one item {shape[2:]} must be contiguous (strides {stride})")
        expect *= size
    item_bytes = expect * es
    return RegionLayout(
        name=name,
        kind=kind,
        base=int(t.data_ptr()),
        layers=tuple(layers),
        layer_stride=stride[0] * es,
        item_stride=stride[1] * es,
        num_items=shape[1],
        item_bytes=item_bytes,
        tokens_per_item=shape[2] if kind == PAGE else 1,
        dtype=str(t.dtype).removeprefix("torch."),
        item_shape=shape[2:],
    )


@dataclass(frozen=True)
class PoolLayout:
    """All regions of one worker's cache pools plus what identifies the model.

    Attributes:
        regions: the pool regions, in send order.
        model: model name (preset or checkpoint name).
        extra: more fingerprint fields (e.g. ``ModelConfig.fingerprint_fields()``).
    """

    regions: tuple[RegionLayout, ...]
    model: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regions", tuple(self.regions))
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"PoolLayout: duplicate region names {names}")

    @classmethod
    def from_pools(
        cls,
        kda_state: Any,
        conv_state: Any,
        mla_latent: Any,
        *,
        kda_layers: tuple[int, ...] | list[int],
        mla_layers: tuple[int, ...] | list[int],
        model: str = "",
        extra: dict[str, Any] | None = None,
    ) -> PoolLayout:
        """The layout of the three pools of INTERFACES.md §1 (``mla_latent`` may be None when
        the model has no MLA layer). Raises ValueError as :func:`region_from_tensor`."""
        regs = [
            region_from_tensor("kda_state", SLOT, kda_state, kda_layers),
            region_from_tensor("conv_state", SLOT, conv_state, kda_layers),
        ]
        if mla_latent is not None and len(mla_layers):
            regs.append(region_from_tensor("mla_latent", PAGE, mla_latent, mla_layers))
        return cls(tuple(regs), model=model, extra=dict(extra or {}))

    @classmethod
    def from_kvpools(cls, pools: Any, extra: dict[str, Any] | None = None) -> PoolLayout:
        """The layout of a ``k3serve.cache.pools.KVPools`` (duck-typed: ``cfg``, ``kda_state``,
        ``conv_state``, ``mla_latent``; snapshot pools are not transferred). ``extra``
        defaults to ``cfg.fingerprint_fields()``."""
        cfg = pools.cfg
        return cls.from_pools(
            pools.kda_state,
            pools.conv_state,
            pools.mla_latent,
            kda_layers=cfg.kda_layers,
            mla_layers=cfg.mla_layers,
            model=cfg.name,
            extra=cfg.fingerprint_fields() if extra is None else extra,
        )

    # ------------------------------------------------------------------ lookups
    def region(self, name: str) -> RegionLayout:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"PoolLayout: no region {name!r} (have {[r.name for r in self.regions]})")

    @property
    def layers(self) -> tuple[int, ...]:
        """Every global layer that owns cache in some region, ascending."""
        return tuple(sorted({g for r in self.regions for g in r.layers}))

    def locate(self, layer: int) -> list[tuple[RegionLayout, int]]:
        """``(region, local layer index)`` for every region holding global ``layer``."""
        out = [(r, r.layers.index(layer)) for r in self.regions if layer in r.layers]
        if not out:
            raise ValueError(f"layer {layer} has no cache in this layout (layers {self.layers})")
        return out

    @property
    def block_size(self) -> int:
        """Tokens per page (0 when there is no page region)."""
        return next((r.tokens_per_item for r in self.regions if r.kind == PAGE), 0)

    # ------------------------------------------------------------------ fingerprint
    def fingerprint(self) -> dict[str, Any]:
        """What must be equal on both sides for bytes to mean the same thing: model, block
        size, and per region its kind, dtype, item shape/bytes and layer ids."""
        return {
            "model": self.model,
            "block_size": self.block_size,
            "regions": {r.name: r.fingerprint() for r in self.regions},
            **({"extra": self.extra} if self.extra else {}),
        }

    def fingerprint_hash(self) -> str:
        """BLAKE2b-128 hex of the canonical JSON of :meth:`fingerprint`."""
        raw = json.dumps(self.fingerprint(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(raw, digest_size=16).hexdigest()

    def to_msg(self) -> PoolLayoutMsg:
        """The wire form sent in a ``PairResponse``."""
        return PoolLayoutMsg(
            model=self.model, extra=self.extra, regions=[r.to_msg() for r in self.regions]
        )

    @classmethod
    def from_msg(cls, m: PoolLayoutMsg) -> PoolLayout:
        """Raises ValueError as :class:`RegionLayout` and on duplicate region names."""
        return cls(
            tuple(RegionLayout.from_msg(r) for r in m.regions), model=m.model, extra=dict(m.extra)
        )


def fingerprint_diff(local: dict[str, Any], remote: dict[str, Any], prefix: str = "") -> list[str]:
    """Differences between two fingerprints, one line each: ``path: local=X remote=Y``."""
    out: list[str] = []
    for k in sorted(set(local) | set(remote)):
        path = f"{prefix}{k}"
        a, b = local.get(k, "<missing>"), remote.get(k, "<missing>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += fingerprint_diff(a, b, path + ".")
        elif a != b:
            out.append(f"{path}: local={a!r} remote={b!r}")
    return out


def check_fingerprints(local: dict[str, Any], remote: dict[str, Any], context: str = "") -> None:
    """Raises FingerprintMismatch naming every differing field."""
    diffs = fingerprint_diff(local, remote)
    if diffs:
        raise FingerprintMismatch(diffs, context)


__all__ = [
    "PAGE",
    "SLOT",
    "PoolLayout",
    "RegionLayout",
    "check_fingerprints",
    "fingerprint_diff",
    "region_from_tensor",
]
