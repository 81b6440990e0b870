"""The fused decode-step kernels against their plain-torch references, and the whole fused
k3-tiny decode step against the unfused one (``K3SERVE_FUSED_DECODE=0``).

On CPU every kernel runs under ``TRITON_INTERPRET=1`` (set before the kernels are defined; the
interpreter rounds float32 → bf16 differently from the GPU, so bf16 checks allow a few bf16
ulps); on a CUDA machine the same tests run compiled.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the @triton.jit definitions

triton = pytest.importorskip("triton")

from k3serve.cache.pools import KVPools
from k3serve.config import PRESETS
from k3serve.kernels.fused_triton import (
    glu_triton,
    mla_absorb_out_triton,
    mla_absorb_q_triton,
    mla_latent_write_triton,
    res_mix_norm_triton,
    rms_norm_triton,
)
from k3serve.kernels.kda.recurrent import kda_decode_fused
from k3serve.kernels.kda.recurrent_triton import kda_decode_fused_triton
from k3serve.kernels.moe import grouped_triton
from k3serve.kernels.moe.route_triton import align_blocks_triton, route_topk_triton
from k3serve.kernels.naive import res_mix_norm_ref, rms_norm, situ_glu
from k3serve.model.batch import make_batch
from k3serve.model.fused_weights import StackedWeights
from k3serve.model.mla import MLAMixer
from k3serve.model.model import K3ForCausalLM

DEV = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _triton_kernels(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("K3SERVE_KERNELS", "triton")
    monkeypatch.delenv("K3SERVE_FUSED_DECODE", raising=False)
    with torch.inference_mode():
        yield


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Within 1e-5 (float32) or 2e-2 (bf16: two roundings, interpreter rounding) of
    ``max(1, max |want|)``."""
    scale = max(1.0, want.double().abs().max().item())
    return maxdiff(got, want) <= (1e-5 if dtype == torch.float32 else 2e-2) * scale


def rn(*s, dtype=torch.float32, scale=1.0):
    return (torch.randn(*s) * scale).to(device=DEV, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nb", [0, 1, 3])
@pytest.mark.parametrize("nd", [0, 1, 2])
def test_res_mix_norm(dtype, nb, nd):
    torch.manual_seed(nb * 3 + nd)
    t, d = 5, 96
    p = rn(t, d, dtype=dtype)
    deltas = tuple(rn(t, d, dtype=dtype) for _ in range(nd))
    blocks = [rn(t, d, dtype=dtype, scale=i + 1.0) for i in range(nb)]
    rw, rq, lw = rn(d, dtype=dtype).abs() + 0.5, rn(1, d, dtype=dtype), rn(d, dtype=dtype)
    got = res_mix_norm_triton(p, deltas, blocks, rw, rq, 1e-5, lw, 1e-6)
    want = res_mix_norm_ref(p, deltas, blocks, rw, rq, 1e-5, lw, 1e-6)
    assert close(got[0], want[0], dtype) and close(got[1], want[1], dtype)
    if nd == 0:
        assert got[0] is p  # no deltas: P is returned as is
    plain = res_mix_norm_triton(p, deltas, [], None, None, 1e-5, lw, 1e-6)  # plain residual
    ref = res_mix_norm_ref(p, deltas, [], None, None, 1e-5, lw, 1e-6)
    assert close(plain[1], ref[1], dtype)


def test_res_mix_norm_rejects():
    p = rn(2, 8)
    with pytest.raises(ValueError, match="deltas"):
        res_mix_norm_triton(p, (p, p, p), [], None, None, 1e-5, None, 1e-5)
    with pytest.raises(ValueError, match="blocks"):
        res_mix_norm_triton(p, (), [p], None, None, 1e-5, None, 1e-5)
    with pytest.raises(ValueError, match="shape"):
        res_mix_norm_triton(p, (rn(3, 8),), [], None, None, 1e-5, None, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lb", [-5.0, None])
def test_kda_decode_fused(dtype, lb):
    torch.manual_seed(1)
    n, h, k, w, r = 3, 2, 16, 4, 8
    hk = h * k
    width = 3 * hk + hk + r + h
    proj = rn(n, width + 3, dtype=dtype)[:, :width]  # strided rows, as a GEMM slice
    fb = rn(n, hk, dtype=dtype)
    cpool, spool = rn(6, w - 1, 3 * hk, dtype=dtype), rn(6, h, k, k)
    cw = rn(3 * hk, w, dtype=dtype, scale=0.5)
    slots = torch.tensor([4, 0, 2], device=DEV)
    a_log, dt_bias, nw = rn(h, scale=0.3), rn(hk), rn(k, dtype=dtype).abs() + 0.5
    args = (slots, a_log, dt_bias, lb, nw, 1e-5, h, 3 * hk, 4 * hk + r)
    c1, s1, c2, s2 = cpool.clone(), spool.clone(), cpool.clone(), spool.clone()
    got = kda_decode_fused_triton(proj, fb, c1, cw, s1, *args)
    want = kda_decode_fused(proj, fb, c2, cw, s2, *args)
    assert got.shape == (n, hk) and got.dtype == dtype
    assert close(got, want, dtype)
    assert torch.equal(c1, c2)  # the conv state shift copies values exactly
    assert close(s1, s2, dtype)
    untouched = [1, 3, 5]
    assert torch.equal(s1[untouched], spool[untouched]) and torch.equal(c1[untouched], cpool[untouched])


def test_kda_decode_fused_rejects():
    with pytest.raises(ValueError, match="conv_weight"):
        kda_decode_fused_triton(rn(1, 200), rn(1, 32), rn(2, 3, 96), rn(95, 4), rn(2, 2, 16, 16),
                                torch.zeros(1, dtype=torch.long, device=DEV), rn(2), rn(32), -5.0,
                                rn(16), 1e-5, 2, 96, 128)  # fmt: skip


def router_ref(x, weight, bias, k, norm, scale):
    s = torch.sigmoid(F.linear(x.float(), weight.float()))
    idx = torch.topk(s + bias.float(), k, dim=-1)[1]
    w = s.gather(1, idx)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, idx


@pytest.mark.parametrize("e,k,t,d", [(8, 2, 5, 96), (64, 8, 37, 1000), (16, 3, 1, 96),
                                     (24, 4, 17, 2048)])  # d ≥ 128: the K-split partial logits
@pytest.mark.parametrize("norm", [True, False])
def test_route_topk(e, k, t, d, norm):
    torch.manual_seed(e + t)
    x, w = rn(t, d, dtype=torch.bfloat16), rn(e, d, dtype=torch.bfloat16, scale=0.1)
    bias = rn(e, scale=0.1)
    load = torch.full((e,), 3, dtype=torch.int64, device=DEV)
    tw, ids = route_topk_triton(x, w, bias, k, norm, 2.5, load)
    rw, ri = router_ref(x, w, bias, k, norm, 2.5)
    assert torch.equal(ids, ri) and maxdiff(tw, rw) <= 1e-5
    assert torch.equal(load, 3 + torch.bincount(ri.reshape(-1), minlength=e))
    tw2, ids2 = route_topk_triton(x, w, bias, k, norm, 2.5)  # no counters
    assert torch.equal(ids2, ids) and torch.equal(tw2, tw)


def test_route_topk_rejects():
    with pytest.raises(ValueError, match="top_k"):
        route_topk_triton(rn(2, 8), rn(4, 8), rn(4), 5, True, 1.0)
    with pytest.raises(ValueError, match="expert_load"):
        route_topk_triton(rn(2, 8), rn(4, 8), rn(4), 2, True, 1.0, torch.zeros(4, device=DEV))


@pytest.mark.parametrize("e,k,t", [(8, 2, 5), (64, 8, 64), (16, 4, 1), (64, 8, 300)])
@pytest.mark.parametrize("bm", [16, 64])
def test_align_blocks_matches_torch(monkeypatch, e, k, t, bm):
    torch.manual_seed(t)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(DEV)
    monkeypatch.setenv("K3SERVE_FUSED_DECODE", "0")
    ref = grouped_triton.align_blocks(ids, e, bm)
    monkeypatch.setenv("K3SERVE_FUSED_DECODE", "1")
    got = grouped_triton.align_blocks(ids, e, bm)
    assert torch.equal(got.slot_assign, ref.slot_assign)
    assert torch.equal(got.block_expert, ref.block_expert)
    s, b = align_blocks_triton(ids, e, bm, ref.slot_assign.numel())
    assert torch.equal(s, ref.slot_assign) and torch.equal(b, ref.block_expert)


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_glu_on_gemm_slices(act):
    gu = rn(5, 2 * 48 + 7, scale=3.0)
    g, u = gu[:, :48], gu[:, 48:96]
    got = glu_triton(g, u, act)
    want = situ_glu(g, u) if act == "situ" else F.silu(g) * u
    assert maxdiff(got, want) <= 1e-5


def test_rms_norm_round_input():
    r, w = rn(4, 64, scale=3.0), rn(64, dtype=torch.bfloat16)
    got = rms_norm_triton(r, w, 1e-5, out_dtype=torch.bfloat16, round_input=True)
    want = rms_norm(r.to(torch.bfloat16), w, 1e-5)
    assert got.dtype == torch.bfloat16 and close(got, want, torch.bfloat16)


def test_mla_decode_pieces():
    """Latent write, absorbed query, absorbed output + gate against ``MLAMixer``'s torch ops."""
    torch.manual_seed(2)
    cfg = PRESETS["k3-tiny"]
    mla = MLAMixer(cfg).to(DEV)
    with torch.no_grad():
        for p in mla.parameters():
            p.normal_(0, 0.2)
    n, d = 3, cfg.mla_latent_dim
    x = rn(n, cfg.hidden_size)
    ckv = mla.kv_a_proj_with_mqa(x)
    proj = torch.cat([rn(n, 5), ckv, rn(n, 2)], 1)  # [c ; k_pe] at column 5 of a wider row
    pool = torch.zeros(4, 4, d, device=DEV)
    slot_map = torch.tensor([13, 2, 7], device=DEV)
    ncached = torch.tensor([4, 0, 9], device=DEV)
    seq = mla_latent_write_triton(proj, 5, mla.kv_a_layernorm.weight, mla.kv_a_layernorm.eps,
                                  slot_map, pool, ncached)  # fmt: skip
    assert torch.equal(seq, ncached + 1)
    want = torch.zeros_like(pool)
    want.view(-1, d)[slot_map] = mla.latents(x)
    assert maxdiff(pool, want) <= 1e-5
    q = mla.queries(x)
    q_lat = mla_absorb_q_triton(q.reshape(n, -1), mla.kv_b_proj.weight, mla.num_heads,
                                cfg.qk_nope_head_dim, torch.float32)  # fmt: skip
    assert maxdiff(q_lat, mla.absorbed_query(q)) <= 1e-4
    o_lat = rn(n, mla.num_heads, cfg.kv_lora_rank)
    gate = rn(n, mla.num_heads * cfg.v_head_dim)
    o = mla_absorb_out_triton(o_lat, mla.kv_b_proj.weight, cfg.qk_nope_head_dim, gate,
                              torch.float32)  # fmt: skip
    ref = mla.absorbed_output(o_lat).reshape(n, -1) * torch.sigmoid(gate)
    assert maxdiff(o, ref) <= 1e-4


@torch.inference_mode(False)
def test_stacked_weights_views_and_rebuild():
    lin_a, lin_b = torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(4, 2, bias=False)
    owner = torch.nn.ModuleDict({"a": lin_a, "b": lin_b})
    sw = StackedWeights(["a.weight", "b.weight"])
    want = torch.cat([lin_a.weight, lin_b.weight]).clone()
    st = sw.get(owner)
    assert torch.equal(st, want) and sw.valid(owner) and sw.get(owner) is st
    with torch.inference_mode(False), torch.no_grad():
        lin_b.weight.copy_(torch.ones(2, 4))  # an in-place load reaches the stack
    assert torch.equal(st[3:], torch.ones(2, 4))
    twin = copy.deepcopy(owner)  # a deep copy stacks its own parameters, not the original's
    with torch.inference_mode(False), torch.no_grad():
        twin["a"].weight.fill_(7.0)
    assert torch.equal(sw.get(twin)[:3], torch.full((3, 4), 7.0))
    assert torch.equal(sw.get(owner)[:3], want[:3])
    lin_a.weight = torch.nn.Parameter(torch.zeros(3, 4))  # reassignment: rebuilt
    assert not sw.valid(owner) and torch.equal(sw.get(owner)[:3], torch.zeros(3, 4))
    with pytest.raises(ValueError, match="trailing"):
        StackedWeights(["a.weight", "w"]).get(torch.nn.ModuleDict({"a": lin_a}).register_parameter(
            "w", None) or _with_param(lin_a))


def _with_param(lin):
    m = torch.nn.Module()
    m.a = lin
    m.w = torch.nn.Parameter(torch.zeros(2, 5))
    return m


def tiny(dtype):
    cfg = dataclasses.replace(
        PRESETS["k3-tiny"], num_layers=4, mla_layers=(3,), attn_res_block_layers=2
    )
    torch.manual_seed(0)
    with torch.inference_mode(False):
        model = K3ForCausalLM(cfg, dtype=dtype).to(DEV).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_res_proj.weight"):  # non-uniform AttnRes mixes
                    p.normal_(0, 0.5)
    return cfg, model


def decode_step(cfg, model, dtype, batch, fused, monkeypatch, around=None):
    monkeypatch.setenv("K3SERVE_FUSED_DECODE", "1" if fused else "0")
    gen = torch.Generator().manual_seed(1)
    bs = 4
    pools = KVPools(cfg, num_slots=batch + 1, num_pages=batch * 2 + 2, block_size=bs, dtype=dtype,
                    device=DEV)  # fmt: skip
    for t in (pools.kda_state, pools.conv_state, pools.mla_latent):
        t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
    ids = torch.randint(0, cfg.vocab_size, (batch,), generator=gen).to(DEV)
    step = make_batch([1] * batch, [5] * batch, list(range(1, batch + 1)),
                      [[2 * i, 2 * i + 1] for i in range(batch)], bs, device=DEV)  # fmt: skip
    if around is None:
        return model(ids, step, pools), pools
    with around:
        return model(ids, step, pools), pools


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_decode_step_fused_equals_unfused(dtype, monkeypatch):
    cfg, model = tiny(dtype)
    a, pa = decode_step(cfg, model, dtype, 3, False, monkeypatch)
    b, pb = decode_step(cfg, model, dtype, 3, True, monkeypatch)
    rel = maxdiff(a, b) / a.abs().max().item()
    assert rel <= (1e-4 if dtype == torch.float32 else 3e-2), rel
    for x, y in ((pa.kda_state, pb.kda_state), (pa.conv_state, pb.conv_state),
                 (pa.mla_latent, pb.mla_latent)):  # fmt: skip
        assert maxdiff(x, y) <= (1e-4 if dtype == torch.float32 else 2e-2) * max(
            1.0, y.double().abs().max().item()
        )
    assert torch.equal(pa.kda_state[:, 0], pb.kda_state[:, 0])  # slot 0 is not in the batch


def test_fused_decode_step_launches(monkeypatch):
    """The fused k3-tiny step (4 layers) dispatches a small, fixed number of kernels: Triton
    launches + torch ops that launch kernels (views and allocations excluded)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    free = {"view", "_unsafe_view", "reshape", "unbind", "split", "select", "slice", "t",
            "transpose", "unsqueeze", "squeeze", "expand", "as_strided", "alias", "detach",
            "empty", "empty_like", "empty_strided", "lift_fresh", "split_with_sizes"}  # fmt: skip

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ not in free and not launching[0]:
                Count.n += 1
            return out

    launching = [0]
    runs = []
    if HAS_CUDA:
        pytest.skip("counts Triton launches through the interpreter (CPU)")
    import triton.runtime.interpreter as interp

    orig = interp.InterpretedFunction.run

    def run(self, *a, **k):
        Count.n += 1
        launching[0] += 1
        try:
            return orig(self, *a, **k)
        finally:
            launching[0] -= 1

    monkeypatch.setattr(interp.InterpretedFunction, "run", run)
    cfg, model = tiny(torch.bfloat16)
    for fused in (True, False):
        decode_step(cfg, model, torch.bfloat16, 2, fused, monkeypatch)  # stacks built
        Count.n = 0
        decode_step(cfg, model, torch.bfloat16, 2, fused, monkeypatch, around=Count())
        runs.append(Count.n)
    # k3-tiny, 4 layers (3 KDA + 1 MLA, 1 dense + 3 MoE), batch 2: 74 fused, 479 unfused
    assert runs[0] <= 80 and runs[1] > 400, runs
