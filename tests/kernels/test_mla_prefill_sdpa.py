"""The SDPA MLA prefill (k3serve/kernels/mla/prefill_sdpa.py) against the naive float32
reference: ragged sequences, cached prefixes (lower-right causal alignment), shuffled pages."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels import dispatch
from k3serve.kernels.mla.naive import mla_prefill_naive_paged
from k3serve.kernels.mla.prefill_sdpa import mla_prefill_sdpa_paged

H, NOPE, ROPE, V, LORA, BS = 4, 16, 8, 12, 32, 16


def _case(seed: int, cached: list[int], new: list[int], dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    n = len(cached)
    need = [-(-(c + t) // BS) for c, t in zip(cached, new, strict=True)]
    pages = sum(need) + 3
    perm = torch.randperm(pages, generator=g)
    bt = torch.full((n, max(need) + 1), -1, dtype=torch.int64)
    at = 0
    for i, k in enumerate(need):
        bt[i, :k] = perm[at:at + k]
        at += k
    pool = torch.randn(pages, BS, LORA + ROPE, generator=g, dtype=dtype)
    q = torch.randn(sum(new), H, NOPE + ROPE, generator=g, dtype=dtype)
    w = torch.randn(H * (NOPE + V), LORA, generator=g, dtype=dtype) * LORA**-0.5
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int64)
    nc = torch.tensor(cached, dtype=torch.int64)
    return q, pool, bt, cu, nc, w


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("seed,cached,new", [
    (0, [0], [37]),                       # a fresh prompt: plain causal
    (1, [0, 21, 64, 5], [9, 1, 40, 33]),  # ragged, cached prefixes, a 1-token chunk
    (2, [100, 0, 3], [17, 64, 0]),        # an empty row in the batch
])  # fmt: skip
def test_sdpa_prefill_equals_naive_fp32(seed, cached, new) -> None:
    args = _case(seed, cached, new)
    scale = (NOPE + ROPE) ** -0.5
    ref = mla_prefill_naive_paged(*args, NOPE, V, scale)
    out = torch.full_like(ref, float("nan"))  # every element must be written
    out[:] = mla_prefill_sdpa_paged(*args, NOPE, V, scale)
    assert out.dtype == torch.float32 and not out.isnan().any()
    assert _rel(out, ref) < 1e-5


def test_sdpa_prefill_bf16_within_bf16_tolerance() -> None:
    q, pool, bt, cu, nc, w = _case(3, [0, 30], [50, 20])
    scale = (NOPE + ROPE) ** -0.5
    ref = mla_prefill_naive_paged(q, pool, bt, cu, nc, w, NOPE, V, scale)
    out = mla_prefill_sdpa_paged(q.bfloat16(), pool.bfloat16(), bt, cu, nc, w.bfloat16(), NOPE,
                                 V, scale)  # fmt: skip
    assert out.dtype == torch.bfloat16
    assert _rel(out.float(), ref) < 2e-2


def test_short_block_table_raises() -> None:
    q, pool, bt, cu, nc, w = _case(4, [10], [10])
    with pytest.raises(ValueError, match="block_table"):
        mla_prefill_sdpa_paged(q, pool, bt[:, :1], cu, nc, w, NOPE, V, 0.2)


def test_dispatch_takes_sdpa_only_where_kernels_run(monkeypatch) -> None:
    """Default on CPU tensors: the naive reference (bit-identical to it), also on the kernel
    path; with K3SERVE_MLA_PREFILL=sdpa the SDPA path where kernels run (as on CUDA), equal to
    float32 rounding; a bad value raises; unset on CUDA: SDPA."""
    args = _case(5, [7, 0], [12, 30])
    scale = (NOPE + ROPE) ** -0.5
    ref = mla_prefill_naive_paged(*args, NOPE, V, scale)
    monkeypatch.delenv("K3SERVE_KERNELS", raising=False)
    monkeypatch.delenv("K3SERVE_MLA_PREFILL", raising=False)
    assert torch.equal(dispatch.mla_prefill_paged(*args, NOPE, V, scale), ref)
    import k3serve.kernels.mla.prefill_sdpa as mod

    calls = []

    def spy(*a, **k):
        calls.append(1)
        return mla_prefill_sdpa_paged(*a, **k)

    monkeypatch.setattr(mod, "mla_prefill_sdpa_paged", spy)
    assert dispatch.mla_prefill_paged(*args, NOPE, V, scale) is not None and not calls
    monkeypatch.setattr(dispatch, "use_triton", lambda device=None: True)
    assert torch.equal(dispatch.mla_prefill_paged(*args, NOPE, V, scale), ref) and not calls
    monkeypatch.setenv("K3SERVE_MLA_PREFILL", "sdpa")
    fast = dispatch.mla_prefill_paged(*args, NOPE, V, scale)
    assert calls == [1]
    assert _rel(fast, ref) < 1e-5
    monkeypatch.setenv("K3SERVE_MLA_PREFILL", "flash")
    with pytest.raises(ValueError, match="K3SERVE_MLA_PREFILL"):
        dispatch.mla_prefill_paged(*args, NOPE, V, scale)
    # unset: SDPA is the default for CUDA tensors only (timed and checked on an H200)
    monkeypatch.delenv("K3SERVE_MLA_PREFILL")
    assert dispatch.mla_prefill_impl("cuda") == dispatch.mla_prefill_impl("cuda:1") == "sdpa"
    assert dispatch.mla_prefill_impl("cpu") == dispatch.mla_prefill_impl() == "naive"
    monkeypatch.setenv("K3SERVE_MLA_PREFILL", "naive")
    assert dispatch.mla_prefill_impl("cuda") == "naive"
