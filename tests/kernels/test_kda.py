"""KDA kernels (plain torch): chunked form, decode step and gate against the float64 recurrence.

The recurrence ``naive_recurrent_kda`` is the spec (DESIGN.md §2). When fla-core is installed
its reference (``fla/ops/kda/naive.py``, loaded by path so fla's package import — which pulls
every Triton op — is skipped) is checked against ours too.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from k3serve.kernels.kda import (
    chunk_kda,
    fused_recurrent_kda,
    fused_recurrent_kda_step,
    kda_gate,
    naive_recurrent_kda,
)
from k3serve.kernels.kda.recurrent import causal_conv_step

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-2) -> float:
    """max |a − b| / max(max |b|, floor)."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()


def make_inputs(B, T, H, K, V, dtype, seed=0, lower_bound=-5.0, a_log=0.0, N=None):
    """Model-like inputs: L2-normalised q/k, gate from kda_gate, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    q = F.normalize(rn(B, T, H, K), dim=-1)
    k = F.normalize(rn(B, T, H, K), dim=-1)
    v = rn(B, T, H, V)
    g = kda_gate(rn(B, T, H, K), torch.full((H,), a_log, dtype=torch.float64), rn(H * K), lower_bound)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    h0 = rn(N if N is not None else B, H, K, V)
    return [x.to(dtype) for x in (q, k, v, g, beta, h0)]


# ---------------------------------------------------------------- chunked == recurrence

CHUNK_CASES = [
    # (B, T, H, K, V, chunk_size)
    (2, 130, 3, 16, 8, 64),
    (1, 64, 2, 32, 32, 64),
    (3, 77, 2, 16, 16, 32),
    (1, 150, 1, 64, 32, 64),
    (2, 41, 2, 8, 8, 20),  # chunk size not a multiple of 16: single sub-chunk path
    (1, 5, 2, 8, 8, 64),  # shorter than a chunk
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize(
    "B,T,H,K,V,C", CHUNK_CASES, ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-V{c[4]}-C{c[5]}" for c in CHUNK_CASES]
)
def test_chunk_matches_recurrence(B, T, H, K, V, C, dtype):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, dtype, seed=T)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C)
    assert o.dtype == dtype and s.dtype == dtype
    assert rel_err(o, o_ref) <= TOL[dtype]
    assert rel_err(s, s_ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_chunk_unbounded_gate_no_overflow(dtype):
    """Kimi Linear's softplus gate with a large rate: g down to ≈ −100 per step. A chunked form
    that exponentiated −cumsum would overflow here; differences must stay finite and exact."""
    q, k, v, g, beta, h0 = make_inputs(1, 100, 2, 16, 16, dtype, seed=3, lower_bound=None, a_log=3.0)
    assert g.min() < -60
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) <= TOL[dtype] and rel_err(s, s_ref) <= TOL[dtype]


def test_chunk_no_initial_state_and_scale():
    q, k, v, g, beta, _ = make_inputs(2, 70, 2, 16, 8, torch.float64, seed=5)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, scale=0.3, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, scale=0.3, output_final_state=True)
    assert rel_err(o, o_ref) <= 1e-10 and rel_err(s, s_ref) <= 1e-10
    o2, s2 = chunk_kda(q, k, v, g, beta, scale=0.3)
    assert s2 is None and torch.equal(o2, o)


def test_bf16_inputs_fp32_state():
    q, k, v, g, beta, h0 = make_inputs(1, 70, 2, 16, 16, torch.float64, seed=9)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    lo = [x.bfloat16() for x in (q, k, v, g, beta)]
    o, s = chunk_kda(*lo, initial_state=h0.float(), output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_err(o, o_ref) < 5e-2 and rel_err(s, s_ref) < 5e-2


# ---------------------------------------------------------------- varlen

VARLEN_CASES = [
    [0, 5, 70, 200, 260],
    [0, 64, 65, 65, 130],  # a chunk-multiple, a 1-token and an empty sequence
    [0, 1, 2, 3],
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("cu", VARLEN_CASES, ids=["N4-T260", "N4-T130-empty", "N3-T3"])
def test_varlen(cu, dtype):
    T, N, H, K, V = cu[-1], len(cu) - 1, 2, 16, 8
    q, k, v, g, beta, h0 = make_inputs(1, T, H, K, V, dtype, seed=N + T, N=N)
    cu_t = torch.tensor(cu)
    o_ref, s_ref = naive_recurrent_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_t
    )
    # the varlen reference is itself per-sequence independent
    n = 2 if N > 2 else 0
    o_one, s_one = naive_recurrent_kda(
        *(x[:, cu[n] : cu[n + 1]] for x in (q, k, v, g, beta)),
        initial_state=h0[n : n + 1],
        output_final_state=True,
    )
    assert torch.equal(o_one, o_ref[:, cu[n] : cu[n + 1]]) and torch.equal(s_one, s_ref[n : n + 1])
    for fn in (chunk_kda, fused_recurrent_kda):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_t)
        assert rel_err(o, o_ref) <= TOL[dtype], fn.__name__
        assert rel_err(s, s_ref) <= TOL[dtype], fn.__name__


def test_chunk_terms_do_not_depend_on_the_batch():
    """A one-chunk sequence's output is the same, bit for bit, alone or packed with sequences
    of other lengths (a chunk's width depends on the chunk alone: 5, 9, 40 or 64 tokens);
    longer sequences and final states, which go through the batched chunk-to-chunk carry,
    agree to float32 rounding."""
    lens = [5, 40, 64, 9, 130]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v, g, beta, h0 = make_inputs(1, cu[-1], 2, 16, 8, torch.float32, seed=3, N=len(lens))
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                     cu_seqlens=torch.tensor(cu))
    for n, length in enumerate(lens):
        o1, s1 = chunk_kda(*(x[:, cu[n] : cu[n + 1]] for x in (q, k, v, g, beta)),
                           initial_state=h0[n : n + 1], output_final_state=True)
        if length <= 64:
            assert torch.equal(o1, o[:, cu[n] : cu[n + 1]]), n
        assert rel_err(o1, o[:, cu[n] : cu[n + 1]]) <= 1e-6, n
        assert rel_err(s1, s[n : n + 1]) <= 1e-6, n


def test_varlen_contract_errors():
    q, k, v, g, beta, h0 = make_inputs(2, 10, 1, 8, 8, torch.float64)
    with pytest.raises(ValueError, match="batch size must be 1"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 10]))
    q, k, v, g, beta, h0 = make_inputs(1, 10, 1, 8, 8, torch.float64, N=3)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 9]))


# ---------------------------------------------------------------- state carry

@pytest.mark.parametrize("split", [1, 37, 64, 100], ids=lambda s: f"split{s}")
def test_split_and_carry_equals_one_pass(split):
    q, k, v, g, beta, h0 = make_inputs(2, 130, 2, 16, 8, torch.float64, seed=11)
    o_all, s_all = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    a = [x[:, :split] for x in (q, k, v, g, beta)]
    b = [x[:, split:] for x in (q, k, v, g, beta)]
    o1, s1 = chunk_kda(*a, initial_state=h0, output_final_state=True)
    o2, s2 = chunk_kda(*b, initial_state=s1, output_final_state=True)
    assert rel_err(torch.cat([o1, o2], 1), o_all) <= 1e-10
    assert rel_err(s2, s_all) <= 1e-10


# ---------------------------------------------------------------- decode step over a pool

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_decode_step_pool_shuffled_slots(dtype):
    N, H, K, V, S, steps = 4, 2, 16, 8, 9, 3
    q, k, v, g, beta, h0 = make_inputs(N, steps, H, K, V, torch.float64, seed=21)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(S, H, K, V, generator=gen, dtype=torch.float64).to(dtype)
    slots = torch.randperm(S, generator=gen)[:N]
    pool[slots] = h0.to(dtype)
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots] = False
    before = pool[untouched].clone()
    for t in range(steps):
        o = fused_recurrent_kda_step(
            *(x[:, t].to(dtype) for x in (q, k, v, g, beta)), pool, slots
        )
        assert o.shape == (N, H, V) and o.dtype == dtype
        assert rel_err(o, o_ref[:, t]) <= TOL[dtype]
    assert rel_err(pool[slots], s_ref) <= TOL[dtype]
    assert torch.equal(pool[untouched], before)


def test_decode_step_strided_pool_view():
    """The pool is one layer's slice of ``kda_state [L, S, H, K, V]`` (a view)."""
    N, H, K, V = 3, 2, 8, 8
    q, k, v, g, beta, h0 = make_inputs(N, 1, H, K, V, torch.float32, seed=4)
    big = torch.zeros(2, 5, H, K, V)
    slots = torch.tensor([4, 0, 2])
    big[1, slots] = h0
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o = fused_recurrent_kda_step(*(x[:, 0] for x in (q, k, v, g, beta)), big[1], slots)
    assert rel_err(o, o_ref[:, 0]) <= 1e-5 and rel_err(big[1, slots], s_ref) <= 1e-5
    assert big[0].abs().sum() == 0



def test_conv_step_equals_varlen_conv_one_token():
    """The torch decode conv step == the model's packed conv with one new token per sequence,
    on one layer's slice of ``conv_state [L, S, W-1, C]`` with shuffled slots."""
    from k3serve.kernels.kda.naive import causal_conv_varlen

    N, W, C, S = 3, 4, 12, 6
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(N, C, generator=gen, dtype=torch.float64)
    weight = torch.randn(C, W, generator=gen, dtype=torch.float64)
    big = torch.randn(2, S, W - 1, C, generator=gen, dtype=torch.float64)
    slots = torch.tensor([5, 0, 3])
    y_ref, hist_ref = causal_conv_varlen(x, weight, torch.arange(N + 1), big[1, slots].clone())
    before = big.clone()
    y = causal_conv_step(x, big[1], weight, slots)
    assert y.dtype == x.dtype and rel_err(y, y_ref) <= 1e-6  # both accumulate in float32
    assert torch.equal(big[1, slots], hist_ref)
    others = [i for i in range(S) if i not in slots.tolist()]
    assert torch.equal(big[1, others], before[1, others]) and torch.equal(big[0], before[0])
    with pytest.raises(ValueError, match="conv_pool"):
        causal_conv_step(x, big[1, :, :2], weight, slots)

# ---------------------------------------------------------------- gradients

def test_grad_chunk_matches_recurrence():
    B, T, H, K, V = 1, 40, 2, 8, 8
    ins = make_inputs(B, T, H, K, V, torch.float64, seed=31)
    gen = torch.Generator().manual_seed(2)
    wo = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    ws = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)

    def grads(fn, **kw):
        xs = [x.clone().requires_grad_(True) for x in ins]
        o, s = fn(*xs[:5], initial_state=xs[5], output_final_state=True, **kw)
        ((o * wo).sum() + (s * ws).sum()).backward()
        return [x.grad for x in xs]

    g_ref = grads(naive_recurrent_kda)
    g_chk = grads(chunk_kda, chunk_size=16)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], g_chk, g_ref):
        assert a is not None and torch.isfinite(a).all(), name
        assert rel_err(a, b) <= 1e-9, name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("C", [16, 64], ids=["C16", "C64-sub16"])
def test_grad_chunk_large_decays(C, dtype):
    """Kimi Linear's softplus gate with a large rate (g down to about −70 per step): in a chunk
    the decay differences reach e^±1000s. The masked-out (i > t) entries' exponents are
    positive; exponentiating them and masking afterwards gives a finite output but inf · 0 =
    NaN gradients. Gradients of every input must stay finite and match the recurrence's."""
    B, T, H, K, V = 1, 70, 2, 8, 8
    ins = make_inputs(B, T, H, K, V, torch.float64, seed=17, lower_bound=None, a_log=3.0)
    assert ins[3].min() < -60
    gen = torch.Generator().manual_seed(4)
    wo = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    ws = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)

    def grads(fn, dt, **kw):
        xs = [x.to(dt).detach().requires_grad_(True) for x in ins]
        o, s = fn(*xs[:5], initial_state=xs[5], output_final_state=True, **kw)
        ((o * wo.to(dt)).sum() + (s * ws.to(dt)).sum()).backward()
        return [x.grad for x in xs]

    g_ref = grads(naive_recurrent_kda, torch.float64)
    g_chk = grads(chunk_kda, dtype, chunk_size=C)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], g_chk, g_ref):
        assert a is not None and torch.isfinite(a).all(), name
        assert rel_err(a, b) <= TOL[dtype], name


# ---------------------------------------------------------------- gate

def test_gate_forms():
    H, K = 3, 4
    gen = torch.Generator().manual_seed(0)
    f = torch.randn(2, 5, H, K, generator=gen, dtype=torch.float64)
    A_log = torch.randn(H, generator=gen, dtype=torch.float64)
    dt_bias = torch.randn(H * K, generator=gen, dtype=torch.float64)
    x = f + dt_bias.view(H, K)
    g = kda_gate(f, A_log, dt_bias, -5.0)
    assert torch.allclose(g, -5.0 * torch.sigmoid(A_log.exp().view(H, 1) * x))
    assert (g < 0).all() and (g > -5).all()
    g2 = kda_gate(f, A_log, dt_bias, None)
    assert torch.allclose(g2, -A_log.exp().view(H, 1) * F.softplus(x))
    assert kda_gate(f.bfloat16(), A_log.float(), None, -5.0).dtype == torch.float32
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(f, A_log[:2], dt_bias)


# ---------------------------------------------------------------- fla-core oracle

def _fla_naive():
    """fla-core's ``naive.py`` module (torch + einops only), or None when not installed."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = next(iter(spec.submodule_search_locations))
    path = os.path.join(root, "ops", "kda", "naive.py")
    if not os.path.exists(path) or importlib.util.find_spec("einops") is None:
        return None
    m = importlib.util.module_from_spec(importlib.util.spec_from_file_location("_fla_kda_naive", path))
    m.__spec__.loader.exec_module(m)
    return m


@pytest.mark.skipif(_fla_naive() is None, reason="fla-core (and einops) not installed")
@pytest.mark.parametrize("B,T,H,K,V", [(2, 37, 2, 16, 8), (1, 70, 3, 32, 16)], ids=["B2-T37-H2", "B1-T70-H3"])
def test_matches_fla_naive(B, T, H, K, V):
    fla = _fla_naive()
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, torch.float64, seed=B * T)
    o_ref, s_ref = fla.naive_recurrent_kda(
        q, k, v, g, beta, initial_state=h0.float(), output_final_state=True
    )  # fla computes in float32
    o, s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5
    o2, s2 = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_err(o2, o_ref) <= 1e-5 and rel_err(s2, s_ref) <= 1e-5
