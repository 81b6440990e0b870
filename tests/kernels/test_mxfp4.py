"""MXFP4 packing (k3serve/kernels/mxfp4.py) against compressed-tensors and a hand-written table.

Layout under test (DESIGN.md §2, OCP MX v1.0): element 2i in the LOW nibble and 2i+1 in the
HIGH nibble of each byte; one E8M0 scale 2^(s-127) per 32 consecutive elements along the input
dimension. The outside oracle is ``compressed_tensors``' own ``mxfp4-pack-quantized``
compressor (``MXFP4PackedCompressor``), which K3 checkpoints are written with.
"""

from __future__ import annotations

import math

import pytest
import torch

from k3serve.kernels.mxfp4 import (
    mxfp4_linear,
    mxfp4_scale_exponents,
    pack_mxfp4,
    quantize_e2m1,
    unpack_mxfp4,
    unpack_mxfp4_codes,
)

# The 16 e2m1 codes written out by hand from OCP MX v1.0 §5.3.3 (sign | E E | M, bias 1):
#   0000 +0     0001 +0.5 (subnormal)   0010 +1.0   0011 +1.5
#   0100 +2.0   0101 +3.0               0110 +4.0   0111 +6.0   and 1xxx the negatives.
HAND_E2M1 = {
    0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5,
    0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0, 0b0111: 6.0,
    0b1000: -0.0, 0b1001: -0.5, 0b1010: -1.0, 0b1011: -1.5,
    0b1100: -2.0, 0b1101: -3.0, 0b1110: -4.0, 0b1111: -6.0,
}  # fmt: skip


def _ct():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    return MXFP4PackedCompressor, preset_name_to_scheme("MXFP4", ["Linear"])


def _all_codes_row() -> list[int]:
    """One row of 32 elements: codes 0..15 in order, twice, packed low nibble first."""
    codes = list(range(16)) * 2
    return [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]


# ---------------------------------------------------------------- compressed-tensors oracle
@pytest.mark.parametrize("shape", [(1, 32), (7, 64), (33, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_unpack_matches_compressed_tensors_random(shape):
    compressor, scheme = _ct()
    out, inp = shape
    g = torch.Generator().manual_seed(out * 1000 + inp)
    packed = torch.randint(0, 256, (out, inp // 2), dtype=torch.uint8, generator=g)
    # Every E8M0 byte except 0xFF (NaN in the spec; compressed-tensors gives 2^128 there).
    scales = torch.randint(0, 255, (out, inp // 32), dtype=torch.uint8, generator=g)
    ref = compressor.decompress({"weight_packed": packed, "weight_scale": scales}, scheme)["weight"]
    assert ref.shape == (out, inp)
    ours = unpack_mxfp4(packed, scales, dtype=ref.dtype)
    assert torch.equal(ours, ref)  # bit-exact, incl. ±inf where 6·2^127 overflows bf16
    # Same values in float32 wherever bf16 has them finite.
    ours32 = unpack_mxfp4(packed, scales, dtype=torch.float32)
    finite = torch.isfinite(ref)
    assert torch.equal(ours32[finite], ref.float()[finite])


def test_unpack_matches_compressed_tensors_nibble_order_and_scale_axis():
    """Distinct, asymmetric bytes and per-block scales: a swapped nibble order or a scale
    applied along the wrong axis (or to the wrong 32-block) would change the result."""
    compressor, scheme = _ct()
    out, inp = 3, 96
    packed = (torch.arange(out * inp // 2, dtype=torch.int64) * 37 % 256).to(torch.uint8)
    packed = packed.reshape(out, inp // 2)
    scales = torch.tensor([[127, 128, 125], [130, 120, 127], [126, 129, 131]], dtype=torch.uint8)
    ref = compressor.decompress({"weight_packed": packed, "weight_scale": scales}, scheme)["weight"]
    ours = unpack_mxfp4(packed, scales, dtype=torch.bfloat16)
    assert torch.equal(ours, ref)
    swapped = ((packed & 0x0F) << 4) | (packed >> 4)
    assert not torch.equal(unpack_mxfp4(swapped, scales, torch.bfloat16), ref)
    assert not torch.equal(unpack_mxfp4(packed, scales.flip(-1), torch.bfloat16), ref)


def test_pack_matches_compressed_tensors_compress():
    """Given our OCP scales, compressed-tensors quantises and packs to the same bytes."""
    compressor, scheme = _ct()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 128, generator=g) * torch.logspace(-3, 2, 24).unsqueeze(1)
    packed, scales = pack_mxfp4(w)
    scale_f = torch.tensor([2.0 ** (int(s) - 127) for s in scales.flatten()]).reshape(scales.shape)
    ref = compressor.compress({"weight": w, "weight_scale": scale_f}, scheme)
    assert torch.equal(ref["weight_packed"], packed)
    assert torch.equal(ref["weight_scale"], scales)


# ---------------------------------------------------------------- hand-written table
@pytest.mark.parametrize("s", [127, 128, 120, 133, 100, 1, 0, 200, 254])
def test_unpack_all_16_codes_at_scale(s):
    packed = torch.tensor([_all_codes_row()], dtype=torch.uint8)
    scales = torch.tensor([[s]], dtype=torch.uint8)
    got = unpack_mxfp4(packed, scales, dtype=torch.float64)[0]
    scale = math.ldexp(1.0, s - 127)
    want = [HAND_E2M1[c] * scale for c in list(range(16)) * 2]
    assert got.tolist() == want
    # The sign of zero survives too (code 8 is -0.0).
    assert math.copysign(1.0, got[8].item()) == -1.0 and math.copysign(1.0, got[0].item()) == 1.0


def test_nibble_order_by_hand():
    # byte 0x71: low nibble 0x1 -> element 0 = +0.5; high nibble 0x7 -> element 1 = +6.0
    # byte 0xA4: low 0x4 -> +2.0; high 0xA -> -1.0.  Scale 2^(128-127) = 2.
    row = [0x71, 0xA4] + [0] * 14
    got = unpack_mxfp4(
        torch.tensor([row], dtype=torch.uint8), torch.tensor([[128]], dtype=torch.uint8)
    )
    assert got[0, :4].tolist() == [1.0, 12.0, 4.0, -2.0]
    assert unpack_mxfp4_codes(torch.tensor([0x71, 0xA4], dtype=torch.uint8)).tolist() == [
        1,
        7,
        4,
        10,
    ]


def test_scale_applies_per_32_block_along_input():
    row = _all_codes_row() * 2  # 64 elements = two blocks, same codes in each
    packed = torch.tensor([row, row], dtype=torch.uint8)
    scales = torch.tensor([[127, 129], [126, 127]], dtype=torch.uint8)
    got = unpack_mxfp4(packed, scales, dtype=torch.float64)
    base = torch.tensor([HAND_E2M1[c] for c in list(range(16)) * 2], dtype=torch.float64)
    assert torch.equal(got[0, :32], base) and torch.equal(got[0, 32:], base * 4)
    assert torch.equal(got[1, :32], base / 2) and torch.equal(got[1, 32:], base)


def test_nan_scale_byte():
    packed = torch.tensor([_all_codes_row()], dtype=torch.uint8)
    got = unpack_mxfp4(packed, torch.tensor([[255]], dtype=torch.uint8))
    assert torch.isnan(got).all()


def test_batched_expert_stack():
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (4, 6, 32), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (4, 6, 2), dtype=torch.uint8, generator=g)
    stacked = unpack_mxfp4(packed, scales)
    for e in range(4):
        assert torch.equal(stacked[e], unpack_mxfp4(packed[e], scales[e]))


# ---------------------------------------------------------------- packing
def test_pack_unpack_round_trip_exact_on_grid():
    """Random codes and scales -> dense values -> pack -> same dense values (bit-exact)."""
    g = torch.Generator().manual_seed(7)
    out, inp = 40, 256
    packed = torch.randint(0, 256, (out, inp // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(60, 200, (out, inp // 32), dtype=torch.uint8, generator=g)
    # Force one ±6 into every block so the OCP scale choice recovers the same exponent.
    packed[:, ::16] = (packed[:, ::16] & 0xF0) | 0x07
    dense = unpack_mxfp4(packed, scales)
    p2, s2 = pack_mxfp4(dense)
    assert torch.equal(s2, scales)
    assert torch.equal(p2, packed)
    assert torch.equal(unpack_mxfp4(p2, s2), dense)
    # Any on-grid block (no forced max) still round-trips in value, through float64 and bf16.
    free = unpack_mxfp4(
        torch.randint(0, 256, (8, 64), dtype=torch.uint8, generator=g),
        torch.randint(100, 150, (8, 4), dtype=torch.uint8, generator=g),
    )
    for dt in (torch.float32, torch.float64, torch.bfloat16):
        assert torch.equal(unpack_mxfp4(*pack_mxfp4(free.to(dt))), free)


def test_ocp_scale_choice():
    def scale_of(block_max: float) -> int:
        w = torch.zeros(1, 32, dtype=torch.float64)
        w[0, 5] = block_max
        return int(mxfp4_scale_exponents(w)[0, 0])

    assert scale_of(6.0) == 127  # floor(log2 6) - 2 = 0
    assert scale_of(4.0) == 127
    assert scale_of(7.99) == 127  # saturates to 6 on packing
    assert scale_of(8.0) == 128
    assert scale_of(1.0) == 125  # 1.0 = 4 * 2^-2
    assert scale_of(-3.0) == 126
    assert scale_of(0.0) == 0  # all-zero block
    assert scale_of(2.0**-140) == 0  # clamped at the smallest E8M0 scale
    assert scale_of(2.0**200) == 254  # clamped at the largest finite one


def test_round_to_nearest_ties_to_even_and_saturate():
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 5.01, 7.9, 100.0, -0.1, -2.6])
    codes = quantize_e2m1(y).tolist()
    values = [HAND_E2M1[c] for c in codes]
    assert values == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, 6.0, 6.0, -0.0, -3.0]
    assert codes[-2] == 0b1000  # -0.1 rounds to -0


def test_pack_error_bound():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(16, 64, generator=g).double()
    packed, scales = pack_mxfp4(w)
    err = (unpack_mxfp4(packed, scales, torch.float64) - w).abs().unflatten(-1, (2, 32))
    x = torch.tensor([2.0 ** (int(s) - 127) for s in scales.flatten()], dtype=torch.float64)
    x = x.reshape(scales.shape).unsqueeze(-1)
    scaled = w.abs().unflatten(-1, (2, 32)) / x
    # OCP MX §6.3: |V/X| < 8; inside the grid (<= 6) the error is at most half the largest gap
    # (4 -> 6), i.e. 1·X; above 6 the value saturates to 6 (error < 2·X).
    assert (scaled < 8).all()
    assert (err[scaled <= 6] <= x.expand_as(err)[scaled <= 6]).all()
    assert (err <= 2 * x).all()
    assert (err[scaled > 6] == (scaled[scaled > 6] - 6) * x.expand_as(err)[scaled > 6]).all()


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="in % 32"):
        pack_mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="NaN/Inf"):
        pack_mxfp4(torch.full((1, 32), float("inf")))
    with pytest.raises(ValueError, match="float"):
        pack_mxfp4(torch.zeros(1, 32, dtype=torch.int32))


def test_unpack_rejects_mismatched_scales():
    with pytest.raises(ValueError, match="do not match"):
        unpack_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        unpack_mxfp4(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))


# ---------------------------------------------------------------- matmul reference
@pytest.mark.parametrize("rows_per_tile", [1024, 5])
def test_mxfp4_linear_matches_dequantised_matmul(rows_per_tile):
    g = torch.Generator().manual_seed(13)
    w = torch.randn(24, 96, generator=g)
    packed, scales = pack_mxfp4(w)
    dense = unpack_mxfp4(packed, scales)
    x = torch.randn(2, 3, 96, generator=g)
    bias = torch.randn(24, generator=g)
    got = mxfp4_linear(x, packed, scales, bias=bias, rows_per_tile=rows_per_tile)
    torch.testing.assert_close(got, x @ dense.T + bias, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="features"):
        mxfp4_linear(torch.zeros(1, 64), packed, scales)
