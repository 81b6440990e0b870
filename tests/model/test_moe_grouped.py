"""The latent-MoE fast path against the per-expert loop (the plain-torch reference).

CPU, float32, tight tolerances: the torch grouped path (``torch._grouped_mm`` and the padded
``bmm`` fallback), the Triton grouped GEMM under ``TRITON_INTERPRET=1`` (bf16 and MXFP4
experts), the sync-free sort and block layout, and the ``MoE`` module's stacked expert views.
Routing cases: ragged token counts, every token on one expert, experts with no tokens, an empty
batch. On a CUDA machine the Triton tests run compiled; ``benchmarks/gpu_moe.py`` checks the
k3-mini sizes.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the @triton.jit definitions

from k3serve.config import PRESETS
from k3serve.kernels.moe.grouped import (
    _padded_grouped_mm,
    routed_experts_grouped,
    sort_by_expert,
)
from k3serve.kernels.moe.naive import routed_experts_loop
from k3serve.kernels.mxfp4 import pack_mxfp4, unpack_mxfp4
from k3serve.kernels.naive import situ_glu, swiglu
from k3serve.model.moe import MoE

torch.set_num_threads(1)
DEV = "cuda" if HAS_CUDA else "cpu"
TINY = PRESETS["k3-tiny"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) if b.numel() else 0.0


def routing(t: int, e: int, k: int, kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [T, k] int64, weights [T, k] float32)``; ``kind``: random | one_expert | few."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        ids = torch.rand(t, e, generator=gen).argsort(1)[:, :k]
    elif kind == "one_expert":  # expert 3 in every token's top-k, the rest fixed: skewed
        ids = torch.tensor([[3, *range(4, 4 + k - 1)]] * t, dtype=torch.int64).reshape(t, k)
    elif kind == "few":  # only experts {0, 1, …, k} used: most experts get no token
        ids = torch.rand(t, k + 1, generator=gen).argsort(1)[:, :k]
    else:
        raise ValueError(kind)
    ids = ids.reshape(t, k).to(torch.int64)
    w = torch.rand(t, k, generator=gen)
    if t:
        w[0] = 0.0  # a token whose experts all carry zero weight
    return ids, w


def weights(e: int, width: int, inter: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * inter, width, generator=gen) * width**-0.5
    w2 = torch.randn(e, width, inter, generator=gen) * inter**-0.5
    return w13, w2


CASES = [
    (t, kind)
    for t in (1, 3, 17, 64)
    for kind in ("random", "one_expert", "few")
] + [(0, "random")]  # fmt: skip
IDS = [f"T{t}-{kind}" for t, kind in CASES]


@pytest.mark.parametrize(("t", "kind"), CASES, ids=IDS)
def test_sort_by_expert_groups_every_assignment(t: int, kind: str) -> None:
    ids, _ = routing(t, 8, 2, kind)
    s = sort_by_expert(ids, 8)
    flat = ids.reshape(-1)
    assert torch.equal(flat[s.order], s.sorted_ids)
    assert torch.equal(s.ends.long(), torch.cumsum(torch.bincount(flat, minlength=8), 0))
    assert sorted(s.order.tolist()) == list(range(flat.numel()))


@pytest.mark.parametrize(("t", "kind"), CASES, ids=IDS)
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_grouped_torch_equals_loop(t: int, kind: str, act: str) -> None:
    fn = situ_glu if act == "situ" else swiglu
    w13, w2 = weights(8, 32, 16)
    ids, w = routing(t, 8, 2, kind)
    z = torch.randn(t, 32) * 3.0
    ref = routed_experts_loop(z, w13, w2, ids, w, fn)
    got = routed_experts_grouped(z, w13, w2, ids, w, fn)
    assert got.shape == (t, 32) and got.dtype == torch.float32
    assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize(("t", "kind"), CASES, ids=IDS)
def test_padded_bmm_fallback_equals_grouped_mm(t: int, kind: str) -> None:
    """The static-capacity fallback (torch without ``_grouped_mm`` for the dtype)."""
    w13, _ = weights(8, 32, 16)
    ids, _ = routing(t, 8, 2, kind)
    s = sort_by_expert(ids, 8)
    a = torch.randn(s.order.numel(), 32)
    ref = torch.zeros(a.shape[0], 32)
    start = 0
    for e, end in enumerate(s.ends.tolist()):
        ref[start:end] = a[start:end] @ w13[e].T
        start = end
    got = _padded_grouped_mm(a, w13, s.ends, s.sorted_ids, max(t, 1))
    assert rel_err(got, ref) < 1e-6


def test_loop_reference_equals_per_token_sum() -> None:
    """The reference itself: each token's weighted sum of its experts, computed token by token."""
    w13, w2 = weights(4, 32, 16)
    ids, w = routing(5, 4, 2, "random")
    z = torch.randn(5, 32)
    ref = routed_experts_loop(z, w13, w2, ids, w, situ_glu)
    for t in range(5):
        want = sum(
            w[t, j] * (w2[e] @ situ_glu(*(w13[e] @ z[t]).split(16)))
            for j, e in enumerate(ids[t].tolist())
        )
        assert torch.allclose(ref[t], want, atol=1e-5)


# ------------------------------------------------------------------ Triton (interpreter on CPU)
triton = pytest.importorskip("triton")

from k3serve.kernels.moe import grouped_triton
from k3serve.kernels.moe.grouped_triton import (
    Tiles,
    TritonExperts,
    align_blocks,
    routed_experts_triton,
)

TRITON_CASES = [(1, "random"), (5, "one_expert"), (19, "few"), (40, "random")]


@pytest.mark.parametrize(("t", "kind"), TRITON_CASES + [(0, "random")])
def test_align_blocks_layout(t: int, kind: str) -> None:
    ids, _ = routing(t, 8, 2, kind)
    lay = align_blocks(ids, 8, 16)
    m = ids.numel()
    slot = lay.slot_assign.long()
    real = slot[slot < m]
    assert sorted(real.tolist()) == list(range(m))  # every assignment exactly once
    blocks = slot.view(-1, 16)
    flat = ids.reshape(-1)
    for b, e in enumerate(lay.block_expert.tolist()):
        rows = blocks[b][blocks[b] < m]
        if e == 8:
            assert rows.numel() == 0
        else:
            assert (flat[rows] == e).all()


@pytest.mark.parametrize(("t", "kind"), TRITON_CASES, ids=[f"T{t}-{k}" for t, k in TRITON_CASES])
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_triton_equals_loop_fp32(t: int, kind: str, act: str) -> None:
    fn = situ_glu if act == "situ" else swiglu
    w13, w2 = weights(8, 64, 32)
    ids, w = routing(t, 8, 2, kind)
    z = torch.randn(t, 64) * 3.0
    ref = routed_experts_loop(z, w13, w2, ids, w, fn)
    got = routed_experts_triton(
        z.to(DEV), TritonExperts(w13.to(DEV), w2.to(DEV)), ids.to(DEV), w.to(DEV), act
    )
    assert rel_err(got, ref) < 1e-4


BF16_INTERP = pytest.mark.skipif(
    not HAS_CUDA, reason="triton's interpreter multiplies bf16 tl.dot operands as raw bits (3.9)"
)


@BF16_INTERP
def test_triton_bf16_close_to_loop() -> None:
    w13, w2 = weights(8, 64, 32)
    ids, w = routing(24, 8, 2, "random")
    z = torch.randn(24, 64)
    ref = routed_experts_loop(z, w13, w2, ids, w, situ_glu)
    bf = torch.bfloat16
    got = routed_experts_triton(
        z.to(DEV, bf), TritonExperts(w13.to(DEV, bf), w2.to(DEV, bf)), ids.to(DEV), w.to(DEV),
        "situ",
    )  # fmt: skip
    assert rel_err(got, ref) < 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=BF16_INTERP)])
@pytest.mark.parametrize("split", [True, False], ids=["split", "interleave"])
def test_triton_mxfp4_equals_dequantised(dtype: torch.dtype, split: bool) -> None:
    """Packed experts dequantised inside the kernel == the loop on ``unpack_mxfp4`` weights."""
    w13, w2 = weights(8, 64, 32, seed=3)
    p13, s13 = pack_mxfp4(w13)
    p2, s2 = pack_mxfp4(w2)
    d13, d2 = unpack_mxfp4(p13, s13), unpack_mxfp4(p2, s2)
    ids, w = routing(19, 8, 2, "random")
    z = torch.randn(19, 64)
    ref = routed_experts_loop(z.to(dtype).float(), d13, d2, ids, w, situ_glu)
    ex = TritonExperts(p13.to(DEV), p2.to(DEV), s13.to(DEV), s2.to(DEV))
    got = routed_experts_triton(
        z.to(DEV, dtype), ex, ids.to(DEV), w.to(DEV), "situ", mx_split=split
    )
    assert rel_err(got, ref) < (1e-4 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize(
    "tiles", [Tiles(16, 64, 256, 4, 2), Tiles(32, 32, 32, 2, 3, True)], ids=["bk256", "bm32-split"]
)
def test_triton_mxfp4_tiles_any_shape_same_function(
    tiles: Tiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every launch shape of the per-shape table computes the same function (the loop on the
    dequantised weights), and ``TILE_TABLE`` entries are what ``_config`` hands out."""
    w13, w2 = weights(8, 64, 32, seed=4)
    p13, s13 = pack_mxfp4(w13)
    p2, s2 = pack_mxfp4(w2)
    ids, w = routing(19, 8, 2, "random", seed=2)
    z = torch.randn(19, 64)
    ref = routed_experts_loop(z, unpack_mxfp4(p13, s13), unpack_mxfp4(p2, s2), ids, w, situ_glu)
    ex = TritonExperts(p13.to(DEV), p2.to(DEV), s13.to(DEV), s2.to(DEV))
    got = routed_experts_triton(z.to(DEV), ex, ids.to(DEV), w.to(DEV), "situ", tiles=tiles)
    assert rel_err(got, ref) < 1e-4
    table = {(True, 8): tiles, (True, 1): Tiles(*tiles[:3], 8, 4)}
    monkeypatch.setattr(grouped_triton, "TILE_TABLE", table)
    assert grouped_triton._config(38, 8, mx=True) == tiles  # 4.75 rows per expert: bound 8
    assert grouped_triton._config(38, 8, mx=False) == Tiles(16, 32, 128, 4, 4)  # bf16: heuristic
    assert grouped_triton._config(9 * 8, 8, mx=True) == Tiles(16, 32, 128, 4, 4)  # over every bound
    again = routed_experts_triton(z.to(DEV), ex, ids.to(DEV), w.to(DEV), "situ")
    assert torch.equal(again, got)


def test_triton_rejects_bad_input() -> None:
    w13, w2 = weights(4, 64, 32)
    ids, w = routing(3, 4, 2, "random")
    with pytest.raises(ValueError, match="act"):
        routed_experts_triton(torch.randn(3, 64), TritonExperts(w13, w2), ids, w, "gelu")
    with pytest.raises(ValueError, match="w13"):
        routed_experts_triton(torch.randn(3, 32), TritonExperts(w13, w2), ids, w, "situ")


# ------------------------------------------------------------------ the MoE module
def random_moe(cfg, dtype=torch.float32, seed=0) -> MoE:
    torch.manual_seed(seed)
    m = MoE(cfg, dtype).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.5)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return m


@pytest.mark.parametrize("latent", [True, False])
@pytest.mark.parametrize("t", [1, 7, 33])
@torch.no_grad()
def test_moe_grouped_equals_loop(latent: bool, t: int) -> None:
    cfg = TINY if latent else dataclasses.replace(TINY, moe_latent_size=None, hidden_act="silu")
    m = random_moe(cfg)
    x = torch.randn(t, cfg.hidden_size)
    m.expert_impl = "loop"
    ref = m(x)
    m.expert_impl = "grouped"
    assert rel_err(m(x), ref) < 1e-5


@torch.no_grad()
def test_moe_stack_shares_storage_and_follows_moves() -> None:
    m = random_moe(TINY)
    st = m.stacked_experts()
    w1 = m.experts[5].w1.weight
    assert w1.data_ptr() == st.w13[5].data_ptr()  # a view: no second copy of the experts
    w1.copy_(torch.ones_like(w1))  # an in-place load updates the stack
    assert torch.equal(st.w13[5, : TINY.moe_intermediate_size], torch.ones_like(w1))
    assert m.stacked_experts() is st
    m.to(torch.float64)  # every parameter replaced: the stack is rebuilt
    st2 = m.stacked_experts()
    assert st2 is not st and st2.w13.dtype == torch.float64
    x = torch.randn(9, TINY.hidden_size, dtype=torch.float64)
    m.expert_impl = "loop"
    ref = m(x)
    m.expert_impl = "grouped"
    assert rel_err(m(x), ref) < 1e-10
    with pytest.raises(ValueError, match="expert_impl"):
        m.expert_impl = "fast"
        m(x)


@torch.no_grad()
def test_moe_mxfp4_bytes_drive_the_triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``expert_quant="mxfp4"`` and packed bytes attached (as the checkpoint loader does),
    the Triton path reads the bytes; equal to the loop over the dequantised dense weights."""
    monkeypatch.setenv("K3SERVE_KERNELS", "triton")
    cfg = dataclasses.replace(TINY, expert_quant="mxfp4")
    m = random_moe(cfg).to(DEV)
    for e in m.experts:
        for lin in (e.w1, e.w2, e.w3):
            packed, scales = pack_mxfp4(lin.weight)
            lin.weight.copy_(unpack_mxfp4(packed, scales))
            lin.register_buffer("weight_packed", packed, persistent=False)
            lin.register_buffer("weight_scale", scales, persistent=False)
    x = torch.randn(11, cfg.hidden_size, device=DEV)
    m.expert_impl = "loop"
    ref = m(x)
    m.expert_impl = "grouped"
    got = m(x)
    assert m.use_packed
    st = m.stacked_experts()
    assert (
        m.experts[2].w3.weight_packed.data_ptr()
        == st.packed[0][2, cfg.moe_intermediate_size :].data_ptr()
    )
    assert rel_err(got, ref) < 1e-4
    # corrupt the bytes: the output must change (the dense weights are NOT what was read)
    st.packed[0].zero_()
    assert rel_err(m(x), ref) > 1e-2


# ------------------------------------------------------------------ fused elementwise kernels
from k3serve.kernels.fused_triton import glu_triton, rms_norm_triton
from k3serve.kernels.naive import rms_norm


@pytest.mark.parametrize("shape", [(1, 128), (5, 3, 96), (0, 64)])
@pytest.mark.parametrize("gated", [False, True])
def test_fused_rms_norm_equals_reference(shape: tuple[int, ...], gated: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=gen) * 3
    w = torch.randn(shape[-1], generator=gen)
    g = torch.randn(*shape, generator=gen) if gated else None
    ref = rms_norm(x, w, 1e-5)
    if gated:
        ref = ref * torch.sigmoid(g)
    got = rms_norm_triton(x.to(DEV), w.to(DEV), 1e-5, None if g is None else g.to(DEV))
    assert got.shape == x.shape
    assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_fused_glu_equals_reference(act: str) -> None:
    gen = torch.Generator().manual_seed(2)
    g, u = torch.randn(7, 300, generator=gen) * 8, torch.randn(7, 300, generator=gen) * 40
    ref = situ_glu(g, u, 4.0, 25.0) if act == "situ" else swiglu(g, u)
    got = glu_triton(g.to(DEV), u.to(DEV), act)
    assert rel_err(got, ref) < 1e-5
    with pytest.raises(ValueError, match="act"):
        glu_triton(g, u, "gelu")


@torch.no_grad()
def test_moe_layer_with_every_triton_kernel_equals_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole MoE layer (fused norm + GLU + grouped experts) against the torch path."""
    m = random_moe(TINY).to(DEV)
    x = torch.randn(6, TINY.hidden_size, device=DEV)
    monkeypatch.setenv("K3SERVE_KERNELS", "torch")
    m.expert_impl = "loop"
    ref = m(x)
    monkeypatch.setenv("K3SERVE_KERNELS", "triton")
    m.expert_impl = "grouped"
    assert rel_err(m(x), ref) < 1e-4
