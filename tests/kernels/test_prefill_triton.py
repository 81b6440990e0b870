"""The prefill-only kernels against their torch references: the KDA varlen conv and the
Block-AttnRes mix (``k3serve/kernels/prefill_triton.py``), the large-M routed experts
(``routed_experts_large_m``: ``torch._grouped_mm`` + Triton GLU / weighted un-sort), and the
model wiring (prefill forwards use them, decode steps do not; MLA layers share one host read).

On CPU the Triton code runs under ``TRITON_INTERPRET=1`` on small shapes; on a CUDA machine the
same tests run compiled and the ``gpu`` tests add k3-mini sizes.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the @triton.jit definitions

triton = pytest.importorskip("triton")

from k3serve.kernels import dispatch
from k3serve.kernels.kda.naive import causal_conv_varlen
from k3serve.kernels.moe.grouped import has_grouped_mm
from k3serve.kernels.moe.grouped_triton import routed_experts_large_m
from k3serve.kernels.moe.naive import routed_experts_loop
from k3serve.kernels.naive import attn_res_mix, l2norm, situ_glu, swiglu
from k3serve.kernels.prefill_triton import (
    ATTN_RES_MAX_SOURCES,
    attn_res_mix_triton,
    conv_varlen_triton,
    l2norm_heads_triton,
)

DEV = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _ref_conv(x, w, cu, hist):
    """The reference on the same device, without the fused dispatch (K3SERVE_KERNELS=torch)."""
    old = os.environ.get("K3SERVE_KERNELS")
    os.environ["K3SERVE_KERNELS"] = "torch"
    try:
        return causal_conv_varlen(x, w, cu, hist)
    finally:
        if old is None:
            os.environ.pop("K3SERVE_KERNELS")
        else:
            os.environ["K3SERVE_KERNELS"] = old


@pytest.mark.parametrize("lens", [[5, 0, 1, 40, 2, 3], [1], [0, 7], [33, 64, 2]])
@pytest.mark.parametrize("with_hist", [True, False])
def test_conv_varlen_equals_reference(lens, with_hist) -> None:
    g = torch.Generator().manual_seed(len(lens) + 10 * with_hist)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    t, c, w = int(cu[-1]), 40, 4
    x = torch.randn(t, c, generator=g).to(DEV)
    wt = torch.randn(c, w, generator=g).to(DEV)
    hist = torch.randn(len(lens), w - 1, c, generator=g).to(DEV) if with_hist else None
    y0, h0 = _ref_conv(x, wt, cu.to(DEV), hist)
    y = torch.full_like(x, float("nan"))  # every element must be written
    y1, h1 = conv_varlen_triton(x, wt, cu.to(DEV), hist)
    y[:] = y1
    assert not y.isnan().any() and h1.shape == h0.shape and h1.dtype == x.dtype
    assert _rel(y, y0) < 1e-6 if t else y.numel() == 0
    assert torch.equal(h1, h0)  # the new history is a copy of inputs: exact


def test_conv_varlen_bf16_one_rounding() -> None:
    g = torch.Generator().manual_seed(5)
    lens = [9, 30, 4]
    cu = torch.tensor([0, 9, 39, 43], dtype=torch.int64, device=DEV)
    x = torch.randn(sum(lens), 64, generator=g).to(DEV, torch.bfloat16)
    wt = torch.randn(64, 4, generator=g).to(DEV, torch.bfloat16)
    hist = torch.randn(3, 3, 64, generator=g).to(DEV, torch.bfloat16)
    y0, h0 = _ref_conv(x, wt, cu, hist)
    y1, h1 = conv_varlen_triton(x, wt, cu, hist)
    assert y1.dtype == torch.bfloat16 and torch.equal(h1, h0)
    # both compute in float32 and round once: they differ by at most one bf16 step
    assert (y1.float() - y0.float()).abs().max() <= 2**-7 * y0.float().abs().max()


def test_conv_varlen_rejects_bad_shapes() -> None:
    x = torch.randn(6, 8, device=DEV)
    cu = torch.tensor([0, 6], device=DEV)
    with pytest.raises(ValueError, match="weight"):
        conv_varlen_triton(x, torch.randn(7, 4, device=DEV), cu, None)
    with pytest.raises(ValueError, match="history"):
        conv_varlen_triton(x, torch.randn(8, 4, device=DEV), cu, torch.randn(1, 2, 8, device=DEV))


@pytest.mark.parametrize("s", [2, 3, 5, ATTN_RES_MAX_SOURCES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_res_mix_equals_reference(s, dtype) -> None:
    g = torch.Generator().manual_seed(s)
    t, d = 13, 200  # d not a power of two: masked tail
    # separate allocations (the kernel addresses them by offset from the first)
    src = [torch.randn(t, d, generator=g).to(DEV, dtype) * (1 + i) for i in range(s)]
    nw = (torch.rand(d, generator=g) + 0.5).to(DEV, dtype)
    q = (torch.randn(1, d, generator=g) * 0.3).to(DEV, dtype)
    ref = attn_res_mix(src, nw, q, 1e-5)
    out = attn_res_mix_triton(src, nw, q, 1e-5)
    assert out.dtype == dtype and out.shape == (t, d)
    assert _rel(out, ref) < (1e-6 if dtype == torch.float32 else 8e-3)


def test_attn_res_mix_rejects() -> None:
    with pytest.raises(ValueError, match="sources"):
        attn_res_mix_triton([], torch.ones(4), torch.zeros(4), 1e-5)
    many = [torch.randn(2, 4, device=DEV) for _ in range(ATTN_RES_MAX_SOURCES + 1)]
    with pytest.raises(ValueError, match="sources"):
        attn_res_mix_triton(many, torch.ones(4, device=DEV), torch.zeros(4, device=DEV), 1e-5)
    # the dispatch falls back to the reference instead
    out = dispatch.attn_res_mix_prefill(many, torch.ones(4, device=DEV), torch.zeros(4, device=DEV),
                                        1e-5)  # fmt: skip
    assert torch.allclose(out, attn_res_mix(many, torch.ones(4, device=DEV),
                                            torch.zeros(4, device=DEV), 1e-5))  # fmt: skip


needs_gmm = pytest.mark.skipif(not has_grouped_mm(DEV, torch.float32),
                               reason="torch._grouped_mm missing for this device")  # fmt: skip


@needs_gmm
@pytest.mark.parametrize("act,fn", [("situ", situ_glu), ("silu", swiglu)])
def test_large_m_experts_equal_loop(act, fn) -> None:
    g = torch.Generator().manual_seed(3)
    e, inter, width, t, k = 8, 64, 96, 70, 3
    z = torch.randn(t, width, generator=g).to(DEV)
    w13 = (torch.randn(e, 2 * inter, width, generator=g) * 0.1).to(DEV)
    w2 = (torch.randn(e, width, inter, generator=g) * 0.1).to(DEV)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[:20] = torch.tensor([0, 1, 2])  # skewed load, and experts 5..7 may stay empty
    ids = ids.to(DEV)
    tw = torch.rand(t, k, generator=g).to(DEV)
    ref = routed_experts_loop(z, w13, w2, ids, tw, fn)
    out = routed_experts_large_m(z, w13, w2, ids, tw, act)
    assert out.dtype == torch.float32 and _rel(out, ref) < 1e-5


@needs_gmm
def test_dispatch_takes_large_m_path_from_threshold(monkeypatch) -> None:
    from k3serve.kernels.moe import grouped_triton as gt

    if not dispatch.use_triton(DEV):
        monkeypatch.setenv("K3SERVE_KERNELS", "triton")
    calls = []
    real = gt.routed_experts_large_m
    monkeypatch.setattr(
        gt, "routed_experts_large_m", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    g = torch.Generator().manual_seed(4)
    e, inter, width, k = 4, 32, 64, 2
    w13 = (torch.randn(e, 2 * inter, width, generator=g) * 0.1).to(DEV)
    w2 = (torch.randn(e, width, inter, generator=g) * 0.1).to(DEV)
    for t, expect in ((gt.LARGE_M_ROWS_PER_EXPERT * e // k - 1, 0),
                      (gt.LARGE_M_ROWS_PER_EXPERT * e // k, 1)):  # fmt: skip
        calls.clear()
        z = torch.randn(t, width, generator=g).to(DEV)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEV)
        tw = torch.rand(t, k, generator=g).to(DEV)
        out = dispatch.routed_experts(z, w13, w2, ids, tw, "situ")
        assert len(calls) == expect
        assert _rel(out, routed_experts_loop(z, w13, w2, ids, tw, situ_glu)) < 1e-4


def test_model_prefill_uses_fused_mix_decode_does_not(monkeypatch) -> None:
    """Prefill forwards route the AttnRes mixes through ``attn_res_mix_prefill`` and the MLA
    layers share one host read of the metadata; decode steps never take the prefill mix."""
    from k3serve.cache.pools import KVPools
    from k3serve.config import PRESETS
    from k3serve.kernels.mla import prefill_sdpa
    from k3serve.model.batch import make_batch
    from k3serve.model.model import K3ForCausalLM

    cfg = PRESETS["k3-tiny"]
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).eval()
    pools = KVPools(cfg, 3, 8, 16, 0, torch.float32, "cpu")
    mixes, metas = [], []
    real_mix, real_meta = dispatch.attn_res_mix_prefill, prefill_sdpa.make_host_meta
    monkeypatch.setattr(
        dispatch, "attn_res_mix_prefill", lambda *a: mixes.append(1) or real_mix(*a)
    )
    monkeypatch.setattr(prefill_sdpa, "make_host_meta", lambda *a: metas.append(1) or real_meta(*a))
    b = make_batch([5, 3], [0, 0], [0, 1], [[0], [1]], 16, "cpu")
    ids = torch.randint(3, cfg.vocab_size, (8,))
    with torch.no_grad():
        model(ids, b, pools)
    n_mix = 2 * cfg.num_layers + 1  # two per layer and the output mix
    assert len(mixes) == n_mix and not metas  # make_batch's host copy: nothing read back
    with torch.no_grad():
        model(ids, dataclasses.replace(b, host=None), pools)
    assert len(metas) == 1  # without it: one read, shared by the MLA layers
    mixes.clear()
    metas.clear()
    d = make_batch([1, 1], [5, 3], [0, 1], [[0], [1]], 16, "cpu")
    assert d.is_decode
    with torch.no_grad():
        model(torch.tensor([7, 9]), d, pools)
    assert not mixes and not metas


def test_l2norm_heads_equals_reference() -> None:
    """Strided ``[T, 2, H, K]`` column slices (the conv output's q | k) → ``[2, T, H, K]``."""
    g = torch.Generator().manual_seed(5)
    t, h, k = 37, 3, 16
    big = torch.randn(t, 3 * h * k + 5, generator=g).to(DEV) * 4.0
    x = big[:, : 2 * h * k].view(t, 2, h, k)
    y = l2norm_heads_triton(x)
    assert y.shape == (2, t, h, k) and y.is_contiguous() and torch.isfinite(y).all()
    for i in range(2):
        assert _rel(y[i], l2norm(x[:, i])) < 1e-6
    yb = l2norm_heads_triton(x.bfloat16(), dtype=torch.bfloat16)
    assert yb.dtype == torch.bfloat16 and _rel(yb[1], l2norm(x[:, 1])) < 8e-3
    assert l2norm_heads_triton(x[:0]).shape == (2, 0, h, k)
    with pytest.raises(ValueError, match="unit last stride"):
        l2norm_heads_triton(big[:, ::2].reshape(t, 1, 1, -1)[..., :8])


def test_kda_prefill_stacked_equals_reference(monkeypatch) -> None:
    """The stacked KDA prefill (one input GEMM, strided conv input, fused l2norm, gate fused
    into the chunk kernel, host ``cu_seqlens``) == the unstacked torch branch, output and the
    written KDA / conv states, ragged sequences continuing a history, float32."""
    from k3serve.config import PRESETS
    from k3serve.model.kda import KDAMixer

    cfg = PRESETS["k3-tiny"]
    torch.manual_seed(1)
    mix = KDAMixer(cfg, torch.float32).to(DEV).eval()
    slots = torch.tensor([2, 0, 1], device=DEV)  # sequences of 9, 1 and 70 tokens
    cu_host = [0, 9, 10, 80]
    cu = torch.tensor(cu_host, device=DEV)
    x = torch.randn(80, cfg.hidden_size, device=DEV)
    hk = cfg.kda_num_heads * cfg.kda_head_dim
    s0 = torch.randn(3, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim, device=DEV) * 0.1
    c0 = torch.randn(3, cfg.kda_conv_kernel - 1, 3 * hk, device=DEV)
    outs, taken = {}, []
    real = mix._forward_prefill_stacked
    monkeypatch.setattr(mix, "_forward_prefill_stacked", lambda *a: taken.append(1) or real(*a))
    for backend in ("torch", "triton"):
        monkeypatch.setenv("K3SERVE_KERNELS", backend)
        st, cv = s0.clone(), c0.clone()
        with torch.inference_mode():
            o = mix(x, cu, slots, st, cv, False, cu_host=cu_host if backend == "triton" else None)
        outs[backend] = (o, st, cv)
    (o0, st0, cv0), (o1, st1, cv1) = outs["torch"], outs["triton"]
    assert taken == [1] and torch.isfinite(o1).all()  # the triton run took the stacked path
    assert _rel(o1, o0) < 1e-4, _rel(o1, o0)
    assert _rel(st1, st0) < 1e-4, _rel(st1, st0)
    # the new conv history copies the projection: one stacked GEMM vs three may round apart
    assert _rel(cv1, cv0) < 1e-6, _rel(cv1, cv0)


@gpu
def test_gpu_prefill_kernels_k3mini_sizes() -> None:
    """k3-mini sizes: conv over 8k tokens × 6144 channels, a 5-source mix, 64k assignments."""
    g = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0, 3000, 3001, 8192], device="cuda")
    x = torch.randn(8192, 6144, device="cuda", generator=g).bfloat16()
    wt = torch.randn(6144, 4, device="cuda", generator=g).bfloat16()
    hist = torch.randn(3, 3, 6144, device="cuda", generator=g).bfloat16()
    y0, h0 = _ref_conv(x, wt, cu, hist)
    y1, h1 = conv_varlen_triton(x, wt, cu, hist)
    assert _rel(y1, y0) < 5e-3 and torch.equal(h1, h0)
    src = [torch.randn(8192, 2048, device="cuda", generator=g).bfloat16() for _ in range(5)]
    nw = torch.rand(2048, device="cuda", generator=g).bfloat16() + 0.5
    q = torch.randn(1, 2048, device="cuda", generator=g).bfloat16() * 0.05
    assert _rel(attn_res_mix_triton(src, nw, q, 1e-5), attn_res_mix(src, nw, q, 1e-5)) < 8e-3
    e, inter, width, t, k = 64, 768, 1024, 8192, 8
    z = torch.randn(t, width, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * inter, width, device="cuda", generator=g) * 0.03).bfloat16()
    w2 = (torch.randn(e, width, inter, device="cuda", generator=g) * 0.03).bfloat16()
    ids = torch.rand(t, e, device="cuda", generator=g).topk(k, -1)[1]
    tw = torch.rand(t, k, device="cuda", generator=g)
    ref = routed_experts_loop(z.float(), w13.float(), w2.float(), ids, tw, situ_glu)
    assert _rel(routed_experts_large_m(z, w13, w2, ids, tw, "situ"), ref) < 1e-2
