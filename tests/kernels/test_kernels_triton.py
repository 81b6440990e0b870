"""Triton kernels against the torch references.

On CPU every kernel runs under ``TRITON_INTERPRET=1`` on tiny shapes (set below, before the
kernels are defined). On a CUDA machine the same tiny tests run compiled, and the ``gpu`` tests
add full sizes (K = V = 128, thousands of tokens, hundreds of sequences). Experiment variants
(non-default ``KNOBS``) run once each under the interpreter and in every combination compiled
(``variant_cases``); the defaults run in every case on both. fla-core is the
second oracle in ``benchmarks/gpu_kernels.py`` (its autotuning is too slow for a test).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the @triton.jit definitions

triton = pytest.importorskip("triton")

from k3serve.kernels import dispatch
from k3serve.kernels.kda import chunk_kda, kda_gate, naive_recurrent_kda
from k3serve.kernels.kda.chunk_triton import chunk_kda_triton
from k3serve.kernels.kda.recurrent import fused_recurrent_kda_step
from k3serve.kernels.kda.recurrent_triton import (
    causal_conv_step_triton,
    fused_recurrent_kda_step_triton,
)
from k3serve.kernels.mla.decode_triton import mla_decode_absorbed_paged_triton
from k3serve.kernels.mla.naive import mla_decode_absorbed_paged

DEV = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def variant_cases(full: list, interpreted: list) -> list:
    """Experiment variants of a kernel (non-default ``KNOBS``): compiled on a GPU every
    combination runs (``full``); under the interpreter each variant runs once
    (``interpreted``: the default path in every case, each other variant in one case)."""
    return full if HAS_CUDA else interpreted


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-2) -> float:
    """max |a − b| / max(max |b|, floor), in float64."""
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all(), "non-finite output"
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()


def kda_inputs(B, T, H, K, V, N=None, dtype=torch.float32, seed=0, gate=-5.0, a_log=0.0):
    """q, k (L2-normalised), v, f (raw gate input), A_log, dt_bias, beta, h0 — on DEV."""
    gen = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=gen)

    q = F.normalize(rn(B, T, H, K), dim=-1)
    k = F.normalize(rn(B, T, H, K), dim=-1)
    v = rn(B, T, H, V)
    f = rn(B, T, H, K)
    A_log = torch.full((H,), a_log) + 0.3 * rn(H)
    dt_bias = rn(H * K)
    beta = torch.rand(B, T, H, generator=gen)
    h0 = rn(N or B, H, K, V)
    g = kda_gate(f, A_log, dt_bias, gate)
    cast = [x.to(DEV, dtype) for x in (q, k, v)]
    return (*cast, g.to(DEV), beta.to(DEV, dtype), h0.to(DEV), f.to(DEV), A_log.to(DEV), dt_bias.to(DEV))


def ref_kda(q, k, v, g, beta, h0, cu=None):
    """float64 recurrence on CPU."""
    c = [x.double().cpu() for x in (q, k, v, g, beta)]
    return naive_recurrent_kda(
        *c, initial_state=h0.double().cpu(), output_final_state=True,
        cu_seqlens=None if cu is None else cu.cpu(),
    )  # fmt: skip


# ---------------------------------------------------------------- chunked prefill (tiny)

TINY = [(2, 100, 1, 16, 32), (1, 64, 1, 32, 16), (1, 20, 2, 16, 16)]


@pytest.mark.parametrize("B,T,H,K,V", TINY, ids=[f"B{b}-T{t}-H{h}-K{k}-V{v}" for b, t, h, k, v in TINY])
def test_chunk_triton_tiny(B, T, H, K, V):
    q, k, v, g, beta, h0, *_ = kda_inputs(B, T, H, K, V, seed=T)
    o_ref, s_ref = ref_kda(q, k, v, g, beta, h0)
    o, s = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4
    o2, s2 = chunk_kda_triton(q, k, v, g, beta)  # no states in or out
    o2_ref, _ = naive_recurrent_kda(*(x.double().cpu() for x in (q, k, v, g, beta)))
    assert s2 is None and rel_err(o2, o2_ref) < 1e-4


@pytest.mark.parametrize("cu", [[0, 5, 70, 70, 140], [0, 64, 65, 129]], ids=["N4-T140-empty", "N3-T129"])
def test_chunk_triton_varlen(cu):
    N, T = len(cu) - 1, cu[-1]
    q, k, v, g, beta, h0, *_ = kda_inputs(1, T, 2, 16, 16, N=N, seed=N)
    cu_t = torch.tensor(cu, device=DEV)
    o_ref, s_ref = ref_kda(q, k, v, g, beta, h0, cu_t)
    o, s = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_t)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4


@pytest.mark.parametrize("lb,a_log", [(-5.0, 0.0), (None, -1.0)], ids=["k3-bounded", "kimi-softplus"])
def test_chunk_triton_fused_gate(lb, a_log):
    q, k, v, g, beta, h0, f, A_log, dt_bias = kda_inputs(1, 70, 1, 16, 16, seed=7, gate=lb, a_log=a_log)
    o_ref, s_ref = ref_kda(q, k, v, g, beta, h0)
    o, s = chunk_kda_triton(
        q, k, v, f, beta, initial_state=h0, output_final_state=True,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lb,
    )  # fmt: skip
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4


KNOB_SETS = [
    {"a_cols": 1},  # Aqk / Akk by 64-row products
    {"fuse_gate": 0},  # the gate + cumsum as their own launch
    {"a_cols": 1, "intra_bk": 16, "intra_bw": 16},
    # T joined in registers, diagonal inverses one block at a time, strips against needed columns
    {"t_regs": 1, "inv_x4": 0, "a_tri": 1},
    {"intra_split": 1, "wy_bw": 16},  # W, Ũ, Kd in _wy_kernel
    {"intra_split": 1, "wy_split": 2, "a_tri": 1},  # … W/Kd and Ũ in separate programs
    {"a_tri": 0, "a_cols": 0},  # strips against all 64 columns (_a_by_rows)
]


@pytest.mark.parametrize(
    "knobs", KNOB_SETS, ids=["a-cols", "gate-apart", "a-cols-bk16", "t-regs", "split", "split2",
                              "full-strips"]
)
def test_chunk_triton_knobs(knobs, monkeypatch):
    """Every intra-kernel code path behind ``KNOBS``: varlen with a partial chunk and K3's gate."""
    from k3serve.kernels.kda import chunk_triton as ct

    for key, val in knobs.items():
        monkeypatch.setitem(ct.KNOBS, key, val)
    cu = [0, 3, 67, 150]
    q, k, v, g, beta, h0, f, A_log, dt_bias = kda_inputs(1, 150, 2, 32, 32, N=3, seed=11)
    cu_t = torch.tensor(cu, device=DEV)
    o_ref, s_ref = ref_kda(q, k, v, g, beta, h0, cu_t)
    kw = {"initial_state": h0, "output_final_state": True, "cu_seqlens": cu_t}
    o, s = chunk_kda_triton(q, k, v, g, beta, **kw)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4
    o, s = chunk_kda_triton(q, k, v, f, beta, **kw, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4


K3_SETS = [
    {},  # the committed defaults (16-row strips, plain mode's register cap and K steps)
    {"k3_diag32": 1, "k3_bk": 16},  # 32-row Aqk / β·Akk blocks, 16 K columns per step
    {"k3_diag32": 1, "k3_bk": None, "k3_fuse_gate": 0},  # … intra_bk's K steps, the gate apart
    {"k3_diag32": 0, "k3_bk": None, "k3_maxnreg": 0},  # the 16-row strips (a_tri) in K3 mode
    {"k3_diag32": 2, "k3_bk": None},  # 32-row blocks in one pass over K, shared factors
    {"k3_diag32": 2, "k3_bk": 16},
]


K3_IDS = ["defaults", "diag32", "diag32-bk-gate-apart", "strips", "shared", "shared-bk16"]
SATS = {"gate-spread": 1.0, "gate-at-bound": 40.0}
# under the interpreter: the defaults at both gate scales; the 32-row-block variants where their
# factors are largest (at the bound), the others with the gate spread
K3_ONCE = {"defaults": ("gate-spread", "gate-at-bound"), "diag32": ("gate-at-bound",),
           "diag32-bk-gate-apart": ("gate-at-bound",), "strips": ("gate-spread",),
           "shared": ("gate-at-bound",), "shared-bk16": ("gate-spread",)}
K3_CASES = variant_cases(
    [pytest.param(kn, SATS[s], id=f"{s}-{i}") for s in SATS for kn, i in zip(K3_SETS, K3_IDS)],
    [pytest.param(kn, SATS[s], id=f"{s}-{i}") for kn, i in zip(K3_SETS, K3_IDS)
     for s in K3_ONCE[i]],
)
_K3_PLAIN: dict[float, tuple] = {}  # sat → inputs and the plain-mode outputs at the defaults


def _k3_plain(sat: float) -> tuple:
    """Varlen inputs with partial chunks (gate input ``f`` × ``sat``) and the plain mode's
    (g given) outputs at the default KNOBS, computed once per ``sat``."""
    if sat not in _K3_PLAIN:
        cu = [0, 3, 67, 150, 230, 270]  # last chunks of 3, 64, 19, 16 and 40 rows
        q, k, v, _g, beta, h0, f, A_log, dt_bias = kda_inputs(1, 270, 2, 32, 32, N=5, seed=13)
        f = f * sat
        g = kda_gate(f.cpu(), A_log.cpu(), dt_bias.cpu(), -5.0).to(DEV)
        cu_t = torch.tensor(cu, device=DEV)
        kw = {"initial_state": h0, "output_final_state": True, "cu_seqlens": cu_t}
        _K3_PLAIN[sat] = (q, k, v, g, beta, h0, f, A_log, dt_bias, cu_t, kw,
                          chunk_kda_triton(q, k, v, g, beta, **kw))
    return _K3_PLAIN[sat]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("knobs, sat", K3_CASES)
def test_chunk_triton_k3_knobs(knobs, sat, monkeypatch):
    """K3-gate mode's code paths (``k3_*`` KNOBS), varlen with partial chunks: the gate spread
    over (−5, 0), and saturated at the bound (``f`` × 40: every step ≈ −5, so the 32-row
    diagonal blocks' factors reach e^±80, the most K3's bound allows) — vs the fp64 recurrence.
    Plain mode (g given) must not see the k3 knobs: same output as with the defaults."""
    from k3serve.kernels.kda import chunk_triton as ct

    q, k, v, g, beta, h0, f, A_log, dt_bias, cu_t, kw, (o_p0, s_p0) = _k3_plain(sat)
    for key, val in knobs.items():
        monkeypatch.setitem(ct.KNOBS, key, val)
    o_ref, s_ref = ref_kda(q, k, v, g, beta, h0, cu_t)
    o, s = chunk_kda_triton(q, k, v, f, beta, **kw, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4
    o_p, s_p = chunk_kda_triton(q, k, v, g, beta, **kw)
    assert torch.equal(o_p, o_p0) and torch.equal(s_p, s_p0)


def test_knobs_from_env():
    from k3serve.kernels.kda.chunk_triton import _knobs_from_env

    assert _knobs_from_env("k3_diag32=0, k3_maxnreg=None,") == {"k3_diag32": 0, "k3_maxnreg": None}
    assert _knobs_from_env("") == {} and _knobs_from_env(None) == {}
    with pytest.raises(ValueError, match="unknown knob"):
        _knobs_from_env("no_such_knob=1")


STATE_SETS = [
    {"state_seg": 1},  # every chunk its own segment: affine maps, scan, then the segments
    {"state_seg": 3, "fuse_out": 1},  # uneven segments, output fused into the state pass
    {"fuse_out": 1, "state_seg": -1},  # whole sequences, output fused
    {"state_split_below": 1000, "state_progs": 64, "seg_min": 1, "seg_count_min": 2},  # auto
    # pipelined pieces across sequence boundaries (side stream on a GPU), the split intra kernel
    {"pipe": 2, "pipe_pieces": 3, "pipe_min_chunks": 1, "intra_split": 1},
    {"pipe": 1, "pipe_pieces": 4, "pipe_min_chunks": 1, "pipe_min_nch": 1, "fuse_out": 1},  # fused
]
STATE_IDS = ["seg1", "seg3-fused", "fused", "auto", "pipe3", "pipe4-fused"]
# under the interpreter each variant in one layout: pieces and uneven segments across sequence
# boundaries (varlen: an empty sequence, sequences shorter than a segment), the others fixed
STATE_ONCE = {"seg1": "B2-T300", "seg3-fused": "varlen", "fused": "B2-T300", "auto": "B2-T300",
              "pipe3": "varlen", "pipe4-fused": "varlen"}
STATE_CASES = variant_cases(
    [pytest.param(kn, lay, id=f"{lay}-{i}") for lay in ("B2-T300", "varlen")
     for kn, i in zip(STATE_SETS, STATE_IDS)],
    [pytest.param(kn, STATE_ONCE[i], id=f"{STATE_ONCE[i]}-{i}")
     for kn, i in zip(STATE_SETS, STATE_IDS)],
)


@pytest.mark.parametrize("knobs, layout", STATE_CASES)
def test_chunk_triton_state_segments(knobs, layout, monkeypatch):
    """The state pass split into segments (``_seg_scan_kernel``) and the fused output pass:
    with and without initial / final states, fixed-length and varlen (an empty sequence and
    sequences shorter than a segment), g given and K3's gate fused."""
    from k3serve.kernels.kda import chunk_triton as ct

    for key, val in knobs.items():
        monkeypatch.setitem(ct.KNOBS, key, val)
    if layout == "varlen":
        cu = [0, 3, 3, 260, 330]
        q, k, v, g, beta, h0, f, A_log, dt_bias = kda_inputs(1, 330, 2, 16, 32, N=4, seed=5)
        cu_t = torch.tensor(cu, device=DEV)
    else:
        q, k, v, g, beta, h0, f, A_log, dt_bias = kda_inputs(2, 300, 1, 32, 16, seed=6)
        cu_t = None
    o_ref, s_ref = ref_kda(q, k, v, g, beta, h0, cu_t)
    kw = {"initial_state": h0, "output_final_state": True, "cu_seqlens": cu_t}
    o, s = chunk_kda_triton(q, k, v, g, beta, **kw)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4
    o, s = chunk_kda_triton(q, k, v, f, beta, **kw, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4
    o2, s2 = chunk_kda_triton(q, k, v, g, beta, cu_seqlens=cu_t)  # no states in or out
    o2_ref, _ = ref_kda(q, k, v, g, beta, torch.zeros_like(h0), cu_t)
    assert s2 is None and rel_err(o2, o2_ref) < 1e-4


CARRY_CASES = variant_cases(
    [pytest.param(kn, ("B2-T300", "varlen"), id=i)
     for kn, i in zip([{"state_seg": -1}, *STATE_SETS], ["whole", *STATE_IDS])],
    [pytest.param({"state_seg": -1}, ("B2-T300", "varlen"), id="whole")]
    + [pytest.param(kn, (STATE_ONCE[i],), id=f"{STATE_ONCE[i]}-{i}")
       for kn, i in zip(STATE_SETS, STATE_IDS)],
)


@pytest.mark.parametrize("knobs, layouts", CARRY_CASES)
def test_chunk_triton_state_carry(knobs, layouts, monkeypatch):
    """Weak decay (g ∈ (−0.02, 0]), so the state carries across chunks and segments: the gates
    of ``kda_inputs`` forget a chunk's state within ~64 steps (e^-15 and less), which would hide
    a wrong inter-chunk / inter-segment state. Fixed-length (B 2) and varlen."""
    from k3serve.kernels.kda import chunk_triton as ct

    for key, val in knobs.items():
        monkeypatch.setitem(ct.KNOBS, key, val)
    gen = torch.Generator().manual_seed(21)
    for name, B, T, cu in (("B2-T300", 2, 300, None), ("varlen", 1, 330, [0, 3, 3, 260, 330])):
        N = B if cu is None else len(cu) - 1
        q = F.normalize(torch.randn(B, T, 1, 32, generator=gen), dim=-1).to(DEV)
        k = F.normalize(torch.randn(B, T, 1, 32, generator=gen), dim=-1).to(DEV)
        v = torch.randn(B, T, 1, 16, generator=gen).to(DEV)
        g = (-0.02 * torch.rand(B, T, 1, 32, generator=gen)).to(DEV)
        beta = torch.rand(B, T, 1, generator=gen).to(DEV)
        h0 = torch.randn(N, 1, 32, 16, generator=gen).to(DEV)
        cu_t = None if cu is None else torch.tensor(cu, device=DEV)
        o_ref, s_ref = ref_kda(q, k, v, g, beta, h0, cu_t)
        o_0, _ = ref_kda(q, k, v, g, beta, torch.zeros_like(h0), cu_t)
        assert rel_err(o_0, o_ref) > 0.05  # the initial state still shows in the outputs
        if name not in layouts:  # inputs drawn all the same: each layout's are fixed
            continue
        o, s = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_t)
        assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_chunk_triton_plan_cache():
    """Chunk tables are built once per layout: per cu_seqlens tensor (rebuilt after an in-place
    change), per (B, T) for fixed-length batches."""
    from k3serve.kernels.kda import chunk_triton as ct

    cu = torch.tensor([0, 5, 70], device=DEV)
    p1 = ct._plan(cu, 1, 70, torch.device(DEV))
    assert ct._plan(cu, 1, 70, torch.device(DEV)) is p1 and p1.nts == [1, 2] and p1.nch == 3
    assert ct._plan(torch.tensor([0, 5, 70], device=DEV), 1, 70, torch.device(DEV)) is not p1
    cu[1] = 64
    p2 = ct._plan(cu, 1, 70, torch.device(DEV))
    assert p2 is not p1 and p2.nts == [1, 1] and p2.cidx.tolist() == [[0, 0], [1, 0]]
    p3 = ct._plan(None, 2, 130, torch.device(DEV))
    assert ct._plan(None, 2, 130, torch.device(DEV)) is p3 and p3.coff.tolist() == [0, 3, 6]
    seg, soff, ns = p3.segs(2)
    assert ns == 4 and soff.tolist() == [0, 2, 4]
    assert seg.tolist() == [[0, 0, 2, 0], [0, 2, 1, 1], [1, 0, 2, 0], [1, 2, 1, 1]]
    assert p3.segs(3) is None  # one segment per sequence


def test_chunk_triton_plan_lives_with_its_cu_seqlens():
    """A varlen layout's chunk tables stay allocated for as long as its ``cu_seqlens`` tensor
    lives, however many other layouts run in between (a captured CUDA graph — the speculative
    verify step's — replays launches that read them at their capture-time addresses; freeing
    them was an illegal memory access on the device), and are freed with the tensor."""
    import gc
    import weakref

    from k3serve.kernels.kda import chunk_triton as ct

    dev = torch.device(DEV)
    with torch.inference_mode():  # as the engine's static verify buffers are made
        static = (torch.arange(17, device=DEV) * 5)[:9]  # a view, as a shape's cu_seqlens is
    p = ct._plan(static, 1, 40, dev)
    tables = [weakref.ref(p.cidx), weakref.ref(p.coff)]
    assert p.cidx[:, 0].tolist() == list(range(8)) and p.coff.tolist() == list(range(9))
    others = []
    for i in range(40):  # eager forwards: a new cu_seqlens each, most freed right away
        cu = torch.tensor([0, i + 1, i + 70], device=DEV)
        ct._plan(cu, 1, i + 70, dev)
        if i % 10 == 0:
            others.append(weakref.ref(ct._plan(cu, 1, i + 70, dev).cidx))
    gc.collect()
    assert ct._plan(static, 1, 40, dev) is p  # never evicted, never rebuilt
    assert all(t() is not None for t in tables)
    assert all(t() is None for t in others)  # a freed cu_seqlens took its tables with it
    del static, p
    gc.collect()
    assert all(t() is None for t in tables)
    # the plan reads the caller's int64 cu_seqlens itself (and holds no reference to it)
    cu = torch.tensor([0, 3, 9], device=DEV)
    assert ct._plan(cu, 1, 9, dev).cu is None
    cu32 = torch.tensor([0, 3, 9], device=DEV, dtype=torch.int32)
    assert ct._plan(cu32, 1, 9, dev).cu.dtype == torch.int64


def test_chunk_triton_verify_layout_after_other_layouts():
    """A verify-shaped varlen batch (4 rows of k + 1 = 5 tokens through a static
    ``cu_seqlens``, as the speculative step's graphs feed them) matches the float64 reference,
    and again after more other layouts than any bounded cache held, from the same plan."""
    from k3serve.kernels.kda import chunk_triton as ct

    torch.manual_seed(3)
    H, K, T = 2, 16, 20
    with torch.inference_mode():
        cu = torch.arange(5, device=DEV) * 5
    q = F.normalize(torch.randn(1, T, H, K, device=DEV), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, device=DEV), dim=-1)
    v = torch.randn(1, T, H, K, device=DEV)
    g = -torch.rand(1, T, H, K, device=DEV)
    beta = torch.rand(1, T, H, device=DEV)
    h0 = torch.randn(4, H, K, K, device=DEV)
    o_ref, _ = ref_kda(q, k, v, g, beta, h0, cu)
    o, s = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    assert s is None and rel_err(o, o_ref) < 1e-5
    p = ct._plan(cu, 1, T, torch.device(DEV))
    assert p.nts == [1, 1, 1, 1] and p.cidx.tolist() == [[i, 0] for i in range(4)]
    others = [torch.tensor([0, 1 + i, 2 * T], device=DEV) for i in range(3 * T)]
    for x in others:
        ct._plan(x, 1, 2 * T, torch.device(DEV))
    assert ct._plan(cu, 1, T, torch.device(DEV)) is p
    o, _ = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    assert rel_err(o, o_ref) < 1e-5


@pytest.mark.skipif(
    not HAS_CUDA, reason="triton's interpreter multiplies bf16 tl.dot operands as raw bits (3.9)"
)
def test_chunk_triton_bf16():
    q, k, v, g, beta, h0, *_ = kda_inputs(1, 70, 2, 16, 16, dtype=torch.bfloat16, seed=3)
    o_ref, s_ref = ref_kda(q, k, v, g, beta, h0)
    o, s = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_err(o, o_ref) < 3e-2 and rel_err(s, s_ref) < 3e-2


def test_chunk_triton_rejects():
    q, k, v, g, beta, *_ = kda_inputs(1, 8, 1, 16, 16)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda_triton(q, k, v, g, beta, chunk_size=32)
    q2, k2, g2 = (torch.zeros(1, 8, 1, 24, device=DEV) for _ in range(3))
    with pytest.raises(ValueError, match="power of two"):
        chunk_kda_triton(q2, k2, v, g2, beta)


# ---------------------------------------------------------------- decode step + conv step (tiny)


@pytest.mark.parametrize("flat,evict", [(True, False), (False, True)], ids=["flat", "3d-evict"])
def test_decode_step_triton_pool_view(flat, evict):
    N, H, K, V, S = 5, 2, 16, 32, 11
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta, *_ = kda_inputs(N, 1, H, K, V, seed=5)
    q, k, v, g, beta = (x[:, 0] for x in (q, k, v, g, beta))
    big = torch.randn(3, S, H, K, V, generator=gen).to(DEV)  # [L_kda, S, H, K, V]
    slots = torch.randperm(S, generator=gen)[:N].to(DEV)
    pool_ref = big[1].clone()
    o_ref = fused_recurrent_kda_step(q, k, v, g, beta, pool_ref, slots)
    before = big.clone()
    o = fused_recurrent_kda_step_triton(q, k, v, g, beta, big[1], slots, block_v=16, flat_grid=flat,
                                        evict_first=evict)  # fmt: skip
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(big[1], pool_ref) < 1e-5
    assert torch.equal(big[0], before[0]) and torch.equal(big[2], before[2])


def conv_step_ref(x, hist, weight):
    ext = torch.cat([hist, x[:, None]], 1).double()  # [N, W, C]
    y = (ext * weight.double().t()[None]).sum(1)
    return F.silu(y), ext[:, 1:]


def test_conv_step_triton(monkeypatch):
    N, W, C, S = 3, 4, 48, 6
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(N, C, generator=gen).to(DEV)
    weight = torch.randn(C, W, generator=gen).to(DEV)
    big = torch.randn(2, S, W - 1, C, generator=gen).to(DEV)
    slots = torch.tensor([4, 0, 2], device=DEV)
    y_ref, hist_ref = conv_step_ref(x.cpu(), big[1, slots].cpu(), weight.cpu())
    before = big.clone()
    y = causal_conv_step_triton(x, big[1], weight, slots)
    assert rel_err(y, y_ref) < 1e-5
    assert torch.equal(big[1, slots].cpu().double(), hist_ref)
    others = [i for i in range(S) if i not in (4, 0, 2)]
    assert torch.equal(big[1, others], before[1, others]) and torch.equal(big[0], before[0])
    # the dispatcher's torch path (k3serve.kernels.kda.recurrent.causal_conv_step) agrees
    big2 = before.clone()
    monkeypatch.setenv("K3SERVE_KERNELS", "torch")
    y2 = dispatch.causal_conv_step(x, big2[1], weight, slots)
    assert rel_err(y2, y_ref) < 1e-5 and torch.equal(big2[1], big[1])


# ---------------------------------------------------------------- MLA decode (tiny)


def mla_inputs(N, H, kv_lora, rope, page, lens, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    D = kv_lora + rope
    nblk = [-(-n // page) for n in lens]
    P = sum(nblk) + 3
    pool = torch.randn(P, page, D, generator=gen).to(DEV, dtype)
    perm = torch.randperm(P, generator=gen)
    bt = torch.full((N, max(nblk)), -1, dtype=torch.int64)
    i = 0
    for n, m in enumerate(nblk):
        bt[n, :m] = perm[i : i + m]
        i += m
    q = torch.randn(N, H, D, generator=gen).to(DEV, dtype)
    return q, pool, bt.to(DEV), torch.tensor(lens, device=DEV)


@pytest.mark.parametrize("splits,bn", [(1, 16), (3, 16), (3, 32), (1, 32)], ids=lambda s: str(s))
def test_mla_decode_triton_tiny(splits, bn):
    # pages of 16: BN 16 reads the page table once per block, BN 32 spans two pages; 1 split
    # normalises in the one launch (no merge)
    lens = [1, 37, 100]
    q, pool, bt, sl = mla_inputs(3, 4, 64, 16, 16, lens)
    scale = 48**-0.5
    ref = mla_decode_absorbed_paged(q.cpu().double(), pool.cpu().double(), bt.cpu(), sl.cpu(), 64, scale)
    out = mla_decode_absorbed_paged_triton(q, pool, bt, sl, 64, scale, num_splits=splits, block_n=bn,
                                           num_warps=4, num_stages=2)  # fmt: skip
    assert out.shape == (3, 4, 64) and out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-4


def test_mla_decode_config_table():
    from k3serve.kernels.mla.decode_triton import DEFAULT_KNOBS, TUNED, mla_decode_config

    for (p0, l0), cfg in TUNED.items():
        assert mla_decode_config(p0, 1, l0) == cfg  # the measured shapes get their own entry
    s, *knobs = mla_decode_config(4, 1, 100)  # far from the table: the heuristic
    assert s >= 1 and tuple(knobs) == DEFAULT_KNOBS
    (p0, l0), (s0, *_) = next(iter(TUNED.items()))
    assert mla_decode_config(p0 * 2, 1, l0)[0] == max(1, round(s0 / 2))  # twice the programs
    with pytest.raises(ValueError, match="block_n"):
        q, pool, bt, sl = mla_inputs(1, 4, 64, 16, 16, [5])
        mla_decode_absorbed_paged_triton(q, pool, bt, sl, 64, 0.1, num_splits=1, block_n=24)


# ---------------------------------------------------------------- dispatch


def test_dispatch_switch(monkeypatch):
    monkeypatch.setenv("K3SERVE_KERNELS", "torch")
    assert not dispatch.use_triton("cuda") and not dispatch.use_triton("cpu")
    monkeypatch.setenv("K3SERVE_KERNELS", "bogus")
    with pytest.raises(ValueError, match="K3SERVE_KERNELS"):
        dispatch.kernel_backend()
    monkeypatch.delenv("K3SERVE_KERNELS")
    assert dispatch.use_triton("cuda") and not dispatch.use_triton("cpu")
    monkeypatch.setenv("K3SERVE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.use_triton("cpu")


def test_dispatch_chunk_grad_goes_to_torch(monkeypatch):
    monkeypatch.setenv("K3SERVE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v, g, beta, h0, *_ = kda_inputs(1, 20, 1, 16, 16, seed=1)
    qg = q.clone().requires_grad_(True)
    o, _ = dispatch.chunk_kda(qg, k, v, g, beta, initial_state=h0)
    assert o.grad_fn is not None  # torch path (Triton has no backward)
    with torch.no_grad():
        o2, _ = dispatch.chunk_kda(q, k, v, g, beta, initial_state=h0)
    assert rel_err(o2, o.detach()) < 1e-4


# ---------------------------------------------------------------- full size on the GPU


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(8192, 16), (4096, 32)], ids=["T8k-H16", "T4k-H32"])
def test_gpu_chunk_full(T, H):
    K = V = 128
    q, k, v, g, beta, h0, f, A_log, dt_bias = kda_inputs(1, T, H, K, V, dtype=torch.bfloat16, seed=T)
    o_ref, s_ref = chunk_kda(q.float(), k.float(), v.float(), g, beta.float(), initial_state=h0,
                             output_final_state=True)  # fmt: skip
    o, s = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref) < 3e-2 and rel_err(s, s_ref) < 3e-2
    o2, s2 = chunk_kda_triton(q, k, v, f, beta, initial_state=h0, output_final_state=True,
                              A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)  # fmt: skip
    assert rel_err(o2, o_ref) < 3e-2 and rel_err(s2, s_ref) < 3e-2


@gpu
@pytest.mark.gpu
def test_gpu_chunk_state_carry_full():
    """T 32k H 12 (the state pass in segments by default) with weak decay, so the state carries
    across chunks and segments (``kda_inputs``' gates forget within a chunk)."""
    T, H, K, V = 32768, 12, 128, 128
    q, k, v, _g, beta, h0, *_ = kda_inputs(1, T, H, K, V, dtype=torch.bfloat16, seed=5)
    g = -0.02 * torch.rand(1, T, H, K, device=DEV, generator=torch.Generator(DEV).manual_seed(5))
    o_ref, s_ref = chunk_kda(q.float(), k.float(), v.float(), g, beta.float(), initial_state=h0,
                             output_final_state=True)  # fmt: skip
    o, s = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref) < 3e-2 and rel_err(s, s_ref) < 3e-2


@gpu
@pytest.mark.gpu
def test_gpu_chunk_varlen_full():
    cu = [0, 1, 700, 4096, 4160, 9000]
    N, T, H = len(cu) - 1, cu[-1], 16
    q, k, v, g, beta, h0, *_ = kda_inputs(1, T, H, 128, 128, N=N, dtype=torch.bfloat16, seed=2)
    cu_t = torch.tensor(cu, device=DEV)
    o_ref, s_ref = chunk_kda(q.float(), k.float(), v.float(), g, beta.float(), initial_state=h0,
                             output_final_state=True, cu_seqlens=cu_t)  # fmt: skip
    o, s = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_t)
    assert rel_err(o, o_ref) < 3e-2 and rel_err(s, s_ref) < 3e-2


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("N", [64, 256])
def test_gpu_decode_full(N):
    H, K, V = 32, 128, 128
    q, k, v, g, beta, *_ = kda_inputs(N, 1, H, K, V, seed=N)
    q, k, v, g, beta = (x[:, 0].bfloat16() if i < 3 else x[:, 0] for i, x in enumerate((q, k, v, g, beta)))
    pool = torch.randn(N + 17, H, K, V, device=DEV)
    slots = torch.randperm(N + 17, device=DEV)[:N]
    ref_pool = pool.clone()
    o_ref = fused_recurrent_kda_step(q, k, v, g, beta, ref_pool, slots)
    o = fused_recurrent_kda_step_triton(q, k, v, g, beta, pool, slots)
    assert rel_err(o, o_ref) < 1e-2 and rel_err(pool, ref_pool) < 1e-5


@gpu
@pytest.mark.gpu
def test_gpu_mla_decode_full():
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 4096, (64,), generator=gen).tolist()
    lens[0], lens[1] = 1, 4096
    q, pool, bt, sl = mla_inputs(64, 16, 512, 64, 64, lens, dtype=torch.bfloat16)
    scale = 192**-0.5
    ref = mla_decode_absorbed_paged(q.float(), pool.float(), bt, sl, 512, scale)
    out = mla_decode_absorbed_paged_triton(q, pool, bt, sl, 512, scale)
    assert rel_err(out, ref) < 2e-2
