"""Transfer descriptors: (layout, slot, pages) → merged (src, dst, length) runs (pure).

No mooncake, no torch. The layouts themselves (regions, addresses, fingerprints) are
:mod:`kvstore.layout`; their names are re-exported here.

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

from dataclasses import dataclass
from typing import Any, NamedTuple

from k3serve.messages import CacheRefMsg
from kvstore.layout import (
    PAGE,
    SLOT,
    PoolLayout,
    RegionLayout,
    check_fingerprints,
    fingerprint_diff,
    region_from_tensor,
)


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

    def to_msg(self) -> CacheRefMsg:
        """The wire form (the decode side's reservation in a ``PairResponse``)."""
        return CacheRefMsg(slot=self.slot, pages=list(self.pages), num_tokens=self.num_tokens)

    @classmethod
    def from_msg(cls, m: CacheRefMsg) -> CacheRef:
        return cls(m.slot, tuple(m.pages), m.num_tokens)


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
