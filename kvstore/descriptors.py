"""Pool layouts and transfer descriptors: (layout, slot, pages) → (src, dst, length) runs.

Pure Python: no mooncake, no torch (tensors are read by duck typing: ``data_ptr()``,
``stride()``, ``shape``, ``element_size()``, ``dtype``).

The pools (docs/INTERFACES.md §1) are one tensor per kind; every one is a *region*:

    region       shape                      item = what one request owns in one layer
    kda_state    [L_kda, S, H, K, V] fp32   one slot:  H·K·V·4 bytes            (kind "slot")
    conv_state   [L_kda, S, W-1, 3HK]       one slot:  (W-1)·3HK·dtype bytes    (kind "slot")
    mla_latent   [L_mla, P, B, D]           one page:  B tokens × D·dtype bytes (kind "page")

Address of item ``i`` of local layer ``j``:  ``base + j·layer_stride + i·item_stride``; inside
an item the bytes are contiguous (token ``o`` of a page at ``+ o·token_bytes``).

A request's runs for one layer, tokens ``[t0, t1)`` (B = 4 here), src pages [7, 8, 2],
dst pages [3, 4, 5]:

    tokens      0 1 2 3 | 4 5 6 7 | 8 9
    src page    7       | 8       | 2          7→8 adjacent, 8→2 not
    dst page    3       | 4       | 5          3→4→5 adjacent
    runs        [---------------- ] [---]      two runs: pages 7-8 → 3-4 merged, 2 → 5

A run merges with the next only when both its source and destination end exactly where the
next begins; runs never merge across layers or regions, so a layer can be sent on its own.
Contiguous pages on both sides give one run per region per layer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "base": self.base,
            "layers": list(self.layers),
            "layer_stride": self.layer_stride,
            "item_stride": self.item_stride,
            "num_items": self.num_items,
            "item_bytes": self.item_bytes,
            "tokens_per_item": self.tokens_per_item,
            "dtype": self.dtype,
            "item_shape": list(self.item_shape),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RegionLayout:
        return cls(**{**d, "layers": tuple(d["layers"]), "item_shape": tuple(d["item_shape"])})


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "extra": self.extra,
            "regions": [r.to_dict() for r in self.regions],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolLayout:
        return cls(
            tuple(RegionLayout.from_dict(r) for r in d["regions"]),
            model=d.get("model", ""),
            extra=dict(d.get("extra") or {}),
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


# ---------------------------------------------------------------------- requests and runs
@dataclass(frozen=True)
class CacheRef:
    """Where one request's cache lives in one worker's pools.

    Attributes:
        slot: KDA/conv state slot.
        pages: MLA pages covering tokens ``[0, num_tokens)`` in order (page i holds tokens
            ``[i·B, (i+1)·B)``).
        num_tokens: tokens whose latents are in the pages (the prompt length).
    """

    slot: int
    pages: tuple[int, ...]
    num_tokens: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "pages", tuple(int(p) for p in self.pages))
        if self.num_tokens < 0:
            raise ValueError("CacheRef.num_tokens must be >= 0")

    @classmethod
    def of(cls, x: Any) -> CacheRef:
        """``x`` itself, or a CacheRef from anything with ``slot``, ``pages``, ``num_tokens``
        (e.g. ``k3serve.protocol.CacheHandle``)."""
        return x if isinstance(x, CacheRef) else cls(int(x.slot), tuple(x.pages), int(x.num_tokens))

    def to_dict(self) -> dict[str, Any]:
        return {"slot": self.slot, "pages": list(self.pages), "num_tokens": self.num_tokens}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CacheRef:
        return cls(int(d["slot"]), tuple(d["pages"]), int(d["num_tokens"]))


class Run(NamedTuple):
    """One contiguous copy: ``length`` bytes from local ``src`` to remote ``dst``."""

    src: int
    dst: int
    length: int
    layer: int
    region: str


def validate_ref(layout: PoolLayout, ref: CacheRef, side: str = "") -> None:
    """Raises ValueError when ``ref`` does not fit ``layout`` (slot/page out of range, too few
    pages for ``num_tokens``, a page listed twice)."""
    tag = f"{side} " if side else ""
    for r in layout.regions:
        if r.kind == SLOT and not 0 <= ref.slot < r.num_items:
            raise ValueError(f"{tag}slot {ref.slot} outside [0, {r.num_items}) of {r.name}")
        if r.kind == PAGE:
            need = -(-ref.num_tokens // r.tokens_per_item)
            if len(ref.pages) < need:
                raise ValueError(
                    f"{tag}{len(ref.pages)} pages cannot hold {ref.num_tokens} tokens "
                    f"(block size {r.tokens_per_item}: need {need})"
                )
            bad = [p for p in ref.pages if not 0 <= p < r.num_items]
            if bad:
                raise ValueError(f"{tag}pages {bad[:8]} outside [0, {r.num_items}) of {r.name}")
            if len(set(ref.pages[:need])) != need:
                raise ValueError(f"{tag}a page is listed twice in {list(ref.pages[:need])}")


def merge_runs(runs: list[Run]) -> list[Run]:
    """Merge each run into the previous one when both source and destination continue exactly
    where it ends (same layer and region). Order is kept."""
    out: list[Run] = []
    for r in runs:
        if out:
            p = out[-1]
            if (
                p.layer == r.layer
                and p.region == r.region
                and p.src + p.length == r.src
                and p.dst + p.length == r.dst
            ):
                out[-1] = p._replace(length=p.length + r.length)
                continue
        out.append(r)
    return out


def _check_pair(src: RegionLayout, dst: RegionLayout) -> None:
    if (src.kind, src.item_bytes, src.tokens_per_item) != (
        dst.kind,
        dst.item_bytes,
        dst.tokens_per_item,
    ):
        raise ValueError(
            f"region {src.name}: src (kind {src.kind}, item {src.item_bytes} B, "
            f"{src.tokens_per_item} tok) != dst (kind {dst.kind}, item {dst.item_bytes} B, "
            f"{dst.tokens_per_item} tok)"
        )


def layer_runs(
    src_layout: PoolLayout,
    src: CacheRef,
    dst_layout: PoolLayout,
    dst: CacheRef,
    layer: int,
    token_start: int = 0,
    token_end: int | None = None,
    with_state: bool = True,
) -> list[Run]:
    """Merged runs copying global ``layer``'s cache of one request.

    Args:
        src_layout, src: the sender's pools and the request's slot/pages there.
        dst_layout, dst: the receiver's pools and the slot/pages it reserved.
        layer: global layer index.
        token_start, token_end: the token range of paged regions to copy
            (default ``[0, src.num_tokens)``).
        with_state: include slot regions (KDA state, conv state) of this layer.

    Returns:
        Runs in region order then token order; a layer without cache in the given token
        range returns ``[]``.

    Raises:
        ValueError: the layer has no cache, src/dst items differ, a ref does not fit.
    """
    end = src.num_tokens if token_end is None else token_end
    if not 0 <= token_start <= end <= min(src.num_tokens, dst.num_tokens):
        raise ValueError(
            f"token range [{token_start}, {end}) outside [0, {min(src.num_tokens, dst.num_tokens)})"
        )
    dst_regions = {r.name: r for r in dst_layout.regions}
    runs: list[Run] = []
    for sr, j in src_layout.locate(layer):
        dr = dst_regions.get(sr.name)
        if dr is None or layer not in dr.layers:
            raise ValueError(f"layer {layer}: region {sr.name} missing on the destination")
        _check_pair(sr, dr)
        k = dr.layers.index(layer)
        if sr.kind == SLOT:
            if with_state:
                runs.append(
                    Run(sr.addr(j, src.slot), dr.addr(k, dst.slot), sr.item_bytes, layer, sr.name)
                )
            continue
        b, t = sr.tokens_per_item, token_start
        while t < end:
            i, off = divmod(t, b)
            n = min(b - off, end - t)
            runs.append(
                Run(
                    sr.addr(j, src.pages[i], off),
                    dr.addr(k, dst.pages[i], off),
                    n * sr.token_bytes,
                    layer,
                    sr.name,
                )
            )
            t += n
    return merge_runs(runs)


def plan_runs(
    src_layout: PoolLayout, src: CacheRef, dst_layout: PoolLayout, dst: CacheRef
) -> dict[int, list[Run]]:
    """Runs of every layer for the whole request: ``{global layer: runs}``, ascending.

    Raises:
        ValueError: as :func:`layer_runs` and :func:`validate_ref`; ``src.num_tokens !=
            dst.num_tokens``.
    """
    if src.num_tokens != dst.num_tokens:
        raise ValueError(f"src has {src.num_tokens} tokens, dst reserved {dst.num_tokens}")
    validate_ref(src_layout, src, "src")
    validate_ref(dst_layout, dst, "dst")
    return {l: layer_runs(src_layout, src, dst_layout, dst, l) for l in src_layout.layers}


def expected_layer_bytes(layout: PoolLayout, ref: CacheRef) -> dict[int, int]:
    """Bytes each layer must receive for ``ref`` (destination side, no source needed):
    slot regions one item each, page regions ``num_tokens × token_bytes``."""
    out: dict[int, int] = {}
    for r in layout.regions:
        per = r.item_bytes if r.kind == SLOT else ref.num_tokens * r.token_bytes
        for g in r.layers:
            out[g] = out.get(g, 0) + per
    return dict(sorted(out.items()))


def runs_bytes(runs: list[Run]) -> int:
    return sum(r.length for r in runs)


__all__ = [
    "PAGE",
    "SLOT",
    "CacheRef",
    "PoolLayout",
    "RegionLayout",
    "Run",
    "check_fingerprints",
    "expected_layer_bytes",
    "fingerprint_diff",
    "layer_runs",
    "merge_runs",
    "plan_runs",
    "region_from_tensor",
    "runs_bytes",
    "validate_ref",
]
