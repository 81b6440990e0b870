"""MXFP4: e2m1 elements, two per byte, one E8M0 scale per 32 elements (plain torch).

Source: OCP Microscaling Formats (MX) Specification v1.0 (Open Compute Project, 2023):
§5 (an MX block = one shared scale X + k = 32 elements P_i, value = X · P_i), §5.3.3 (FP4
E2M1 element: 1 sign, 2 exponent (bias 1), 1 mantissa bit, no Inf/NaN, max normal ±6.0),
§5.4.1 (E8M0 scale: 8 exponent bits, bias 127, value 2^(s − 127), 0xFF = NaN, no sign, no
zero), §6.3 (conversion from a vector of floats: shared exponent
``floor(log2(max_i |V_i|)) − emax_elem`` with ``emax_elem = 2`` for E2M1, then each
``V_i / X`` rounded to the element format, clamping normals that exceed the element's max).

Storage layout used by K3 checkpoints and ``compressed-tensors`` (``mxfp4-pack-quantized``),
for a weight ``W [out, in]`` with ``in % 32 == 0``:

* ``weight_packed`` ``uint8 [out, in / 2]``: byte ``j`` of a row holds element ``2j`` in the
  LOW nibble (bits 0–3) and element ``2j + 1`` in the HIGH nibble (bits 4–7). A nibble is an
  e2m1 code: bit 3 = sign, bits 0–2 = magnitude index into (0, 0.5, 1, 1.5, 2, 3, 4, 6).
* ``weight_scale`` ``uint8 [out, in / 32]``: E8M0 exponent of the 32 consecutive elements
  ``[32b, 32b + 32)`` of the row, i.e. blocks run along the INPUT dimension.

So one row of ``in`` weights costs ``in / 2 + in / 32`` bytes (4.25 bits per weight).
``compressed-tensors`` (``MXFP4PackedCompressor.decompress``) is the test oracle for this
layout; ``tests/kernels/test_mxfp4.py`` checks it.

Everything here runs on any device; the GPU path will keep weights packed and dequantise
inside the expert matmul, which :func:`mxfp4_linear` mirrors tile by tile.
"""

from __future__ import annotations

import torch

MXFP4_BLOCK = 32
"""Elements per shared E8M0 scale (OCP MX v1.0 §5, k = 32)."""

E8M0_BIAS = 127
"""Exponent bias of the E8M0 scale (OCP MX v1.0 §5.4.1)."""

E8M0_NAN = 0xFF
"""The E8M0 encoding reserved for NaN (OCP MX v1.0 §5.4.1)."""

E2M1_EMAX = 2
"""Exponent of the largest normal e2m1 value, 6 = 1.5 · 2^2 (OCP MX v1.0 §5.3.3, §6.3)."""

E2M1_MAX = 6.0
"""Largest e2m1 magnitude."""

E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
"""All 16 e2m1 codes in code order: code ``c`` (0 ≤ c < 16) decodes to ``E2M1_VALUES[c]``.

Bit 3 is the sign; bits 2–1 the exponent E (bias 1) and bit 0 the mantissa M: E = 0 is the
subnormal 0.5·M, otherwise 2^(E−1)·(1 + M/2) (OCP MX v1.0 §5.3.3, Table 5).
"""

# Rounding thresholds between consecutive e2m1 magnitudes (0, .5, 1, 1.5, 2, 3, 4, 6) and, for
# each, whether the value AT the threshold rounds up: ties go to the even code (mantissa bit
# 0), i.e. round-half-to-even on the e2m1 grid, as IEEE-754 roundTiesToEven.
_MIDPOINTS: tuple[tuple[float, bool], ...] = (
    (0.25, False),  # 0 (even) | 0.5 (odd)
    (0.75, True),  # 0.5 (odd) | 1.0 (even)
    (1.25, False),  # 1.0 | 1.5
    (1.75, True),  # 1.5 | 2.0
    (2.5, False),  # 2.0 | 3.0
    (3.5, True),  # 3.0 | 4.0
    (5.0, False),  # 4.0 | 6.0
)

_E2M1_CACHE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_E8M0_CACHE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def e2m1_table(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The 16 e2m1 code values as a tensor (see :data:`E2M1_VALUES`).

    Returns:
        ``[16]`` tensor of ``dtype`` on ``device``; index = 4-bit code. Every value is exact in
        any float dtype with at least 2 mantissa bits.
    """
    key = (torch.device(device or "cpu"), dtype)
    t = _E2M1_CACHE.get(key)
    if t is None:
        t = torch.tensor(E2M1_VALUES, dtype=dtype, device=key[0])
        _E2M1_CACHE[key] = t
    return t


def e8m0_table(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decoded value of every E8M0 byte: ``2^(s − 127)`` for ``s < 255`` and NaN for ``s = 255``.

    Built from exact Python powers of two, so every entry is exact in float32/float64
    (``2^-127`` is a float32 subnormal) and in bfloat16 (same exponent range).

    Returns:
        ``[256]`` tensor of ``dtype`` on ``device``; index = the scale byte.
    """
    key = (torch.device(device or "cpu"), dtype)
    t = _E8M0_CACHE.get(key)
    if t is None:
        vals = [2.0 ** (s - E8M0_BIAS) for s in range(255)] + [float("nan")]
        t = torch.tensor(vals, dtype=torch.float64).to(dtype=dtype, device=key[0])
        _E8M0_CACHE[key] = t
    return t


def _check_packed(packed: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    """Validate a packed pair; return ``(in_features, blocks)``."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"mxfp4: packed and scales must be uint8, got {packed.dtype} and {scales.dtype}"
        )
    if packed.dim() < 2 or scales.dim() != packed.dim():
        raise ValueError(
            f"mxfp4: packed [..., out, in/2] and scales [..., out, in/32] need the same rank "
            f">= 2, got {tuple(packed.shape)} and {tuple(scales.shape)}"
        )
    in_features = packed.shape[-1] * 2
    blocks = scales.shape[-1]
    if packed.shape[:-1] != scales.shape[:-1] or blocks * MXFP4_BLOCK != in_features:
        raise ValueError(
            f"mxfp4: scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)} "
            f"(expected [..., out, in/{MXFP4_BLOCK}] for in = 2 * packed.shape[-1] = {in_features})"
        )
    return in_features, blocks


def unpack_mxfp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """Split each byte into its two e2m1 codes: element ``2j`` = low nibble, ``2j+1`` = high.

    Args:
        packed: ``uint8 [..., n/2]``.

    Returns:
        ``uint8 [..., n]`` codes in ``[0, 16)``.
    """
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def unpack_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantise an MXFP4 weight: ``W[o, i] = e2m1(code[o, i]) · 2^(scales[o, i // 32] − 127)``.

    The product is formed in float32 (float64 when ``dtype`` is float64) and is exact there
    (a 2-bit significand times a power of two; OCP MX v1.0 §5), then cast to ``dtype``.
    A scale byte 0xFF decodes to NaN (OCP MX v1.0 §5.4.1).

    Args:
        packed: ``uint8 [..., out, in/2]`` (element ``2j`` in the low nibble of byte ``j``).
        scales: ``uint8 [..., out, in/32]`` E8M0 exponents along the input dimension.
        dtype: output float dtype.

    Returns:
        ``[..., out, in]`` tensor of ``dtype`` on ``packed.device``.

    Raises:
        ValueError: non-uint8 inputs or shapes that do not pair up.
    """
    _, blocks = _check_packed(packed, scales)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    values = e2m1_table(packed.device, work)[unpack_mxfp4_codes(packed).long()]
    scale = e8m0_table(packed.device, work)[scales.long()]
    values = values.unflatten(-1, (blocks, MXFP4_BLOCK)) * scale.unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def mxfp4_scale_exponents(w: torch.Tensor) -> torch.Tensor:
    """Shared E8M0 scale bytes of each 32-block, chosen as in OCP MX v1.0 §6.3.

    ``s = clamp(floor(log2(max_i |V_i|)) − 2, −127, 127) + 127``; an all-zero block gets
    ``s = 0`` (any scale represents it). ``floor(log2(·))`` is read exactly from the float
    exponent (``torch.frexp``), not from a rounded ``log2``.

    Args:
        w: float ``[..., in]`` with ``in % 32 == 0`` and only finite values.

    Returns:
        ``uint8 [..., in/32]``.
    """
    amax = w.abs().unflatten(-1, (-1, MXFP4_BLOCK)).amax(dim=-1)
    _, exp = torch.frexp(amax.to(torch.float64))  # amax = m · 2^exp, m in [0.5, 1)
    shared = (exp.to(torch.int32) - 1) - E2M1_EMAX
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -E8M0_BIAS))
    return (shared.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)


def quantize_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round floats to the nearest e2m1 code (ties to even), saturating at ±6.

    Negative values (and −0.0) get the sign bit, so a negative value that rounds to zero
    becomes code 8 (−0), as IEEE rounding would give.

    Args:
        y: float tensor, already divided by its block scale.

    Returns:
        ``uint8`` codes, same shape as ``y``.
    """
    mag = y.abs()
    idx = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for threshold, tie_up in _MIDPOINTS:
        idx += (mag >= threshold if tie_up else mag > threshold).to(torch.uint8)
    return idx | (torch.signbit(y).to(torch.uint8) << 3)


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a float weight to MXFP4 (OCP MX v1.0 §6.3) and pack it two codes per byte.

    Per block of 32 consecutive input elements: shared exponent from
    :func:`mxfp4_scale_exponents`, then ``V_i / 2^shared`` rounded to the nearest e2m1 value
    (ties to even) with saturation at ±6. Values already on the grid of their block's scale
    round-trip exactly through :func:`unpack_mxfp4`.

    Args:
        w: float ``[..., out, in]`` (any float dtype; quantised in float64), ``in % 32 == 0``.

    Returns:
        ``(packed uint8 [..., out, in/2], scales uint8 [..., out, in/32])`` on ``w.device``;
        ``out · in / 2 + out · in / 32`` bytes.

    Raises:
        ValueError: ``w`` not floating point, fewer than 2 dims, ``in % 32 != 0``, or
            non-finite values (MX v1.0 §6.3 would produce a NaN scale; weights never should).
    """
    if not w.is_floating_point():
        raise ValueError(f"pack_mxfp4: expected a float tensor, got {w.dtype}")
    if w.dim() < 2 or w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(
            f"pack_mxfp4: expected [..., out, in] with in % {MXFP4_BLOCK} == 0, got {tuple(w.shape)}"
        )
    w64 = w.detach().to(torch.float64)
    if not bool(torch.isfinite(w64).all()):
        raise ValueError("pack_mxfp4: weight has NaN/Inf values")
    scales = mxfp4_scale_exponents(w64)
    inv = e8m0_table(w.device, torch.float64)[(2 * E8M0_BIAS - scales.long()).clamp(0, 254)]
    y = (w64.unflatten(-1, (-1, MXFP4_BLOCK)) * inv.unsqueeze(-1)).flatten(-2)
    codes = quantize_e2m1(y)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), scales.contiguous()


def mxfp4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    rows_per_tile: int = 1024,
) -> torch.Tensor:
    """``y = x Wᵀ (+ bias)`` with ``W`` kept in MXFP4 and dequantised one row tile at a time.

    Reference for the GPU expert matmul: only a ``[rows_per_tile, in]`` slice of the weight is
    ever dense (in ``x.dtype``), like a kernel that dequantises each weight tile in registers.
    The result equals ``x @ unpack_mxfp4(packed, scales, x.dtype).T`` up to the summation
    order the matmul backend picks per tile (same products, same dense weight values).

    Args:
        x: float ``[..., in]``.
        packed: ``uint8 [out, in/2]``.
        scales: ``uint8 [out, in/32]``.
        bias: optional ``[out]``.
        rows_per_tile: output rows dequantised per step (memory ≈ rows_per_tile · in
            elements of ``x.dtype``).

    Returns:
        ``[..., out]`` in ``x.dtype``.

    Raises:
        ValueError: bad packed/scales pair, a 3-D+ weight, or ``x.shape[-1] != in``.
    """
    in_features, _ = _check_packed(packed, scales)
    if packed.dim() != 2:
        raise ValueError(f"mxfp4_linear: expected a 2-D packed weight, got {tuple(packed.shape)}")
    if x.shape[-1] != in_features:
        raise ValueError(
            f"mxfp4_linear: x has {x.shape[-1]} features, weight expects {in_features}"
        )
    out_features = packed.shape[0]
    if out_features <= rows_per_tile:
        return torch.nn.functional.linear(x, unpack_mxfp4(packed, scales, x.dtype), bias)
    parts = []
    for r in range(0, out_features, rows_per_tile):
        w_tile = unpack_mxfp4(packed[r : r + rows_per_tile], scales[r : r + rows_per_tile], x.dtype)
        b_tile = None if bias is None else bias[r : r + rows_per_tile]
        parts.append(torch.nn.functional.linear(x, w_tile, b_tile))
    return torch.cat(parts, dim=-1)


__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E8M0_BIAS",
    "MXFP4_BLOCK",
    "e2m1_table",
    "e8m0_table",
    "mxfp4_linear",
    "mxfp4_scale_exponents",
    "pack_mxfp4",
    "quantize_e2m1",
    "unpack_mxfp4",
    "unpack_mxfp4_codes",
]
