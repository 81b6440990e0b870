"""Fused elementwise kernels in Triton: RMSNorm (optionally × σ(gate)) and the GLUs, one launch
each instead of the 6–9 the torch expressions dispatch (a decode step is launch-bound).

References (the spec, ``k3serve/model/layers.py``): ``rms_norm`` — ``x · rsqrt(mean(x²) + ε) · w``
in float32, cast back (Zhang & Sennrich 2019); ``GatedRMSNorm`` — that times ``σ(gate)`` (fla
``FusedRMSNormGated``); ``situ_glu`` — ``[β·tanh(g/β)·σ(g)]·[β_l·tanh(u/β_l)]`` (DESIGN.md §2);
``swiglu`` — ``silu(g)·u``. The kernels compute in float32 and round once at the end (the torch
GLU rounds after every op in the input dtype, so bf16 results differ by bf16 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _rms_norm_kernel(x, w, g, y, D, s_x, s_g, s_y, eps,
                     HAS_W: tl.constexpr, HAS_G: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    m = offs < D
    v = tl.load(x + row * s_x + offs, mask=m, other=0.0).to(tl.float32)
    v = v * tl.rsqrt(tl.sum(v * v, 0) / D + eps)
    if HAS_W:
        v = v * tl.load(w + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_G:
        v = v * tl.sigmoid(tl.load(g + row * s_g + offs, mask=m, other=0.0).to(tl.float32))
    tl.store(y + row * s_y + offs, v.to(y.dtype.element_ty), mask=m)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, gate: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """RMSNorm over the last dim (× ``σ(gate)`` when given) in one launch.

    Args:
        x: ``[..., D]`` float; weight: ``[D]`` or None; gate: ``[..., D]`` like ``x`` or None.
        eps: added to the mean square.
        out_dtype: result dtype (``x.dtype`` if None).

    Returns:
        ``[..., D]`` in ``out_dtype``.

    Raises:
        ValueError: ``gate`` shape differs from ``x``, or ``D > 65536``.
    """
    d = x.shape[-1]
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate: shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")
    if d > 65536:
        raise ValueError(f"x: last dim {d} > 65536 is not supported by the fused RMSNorm")
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    g2 = None if gate is None else gate.reshape(-1, d).contiguous()
    y = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)
    if x2.shape[0]:
        bd = triton.next_power_of_2(d)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight if weight is not None else x2, g2 if g2 is not None else x2, y, d,
            x2.stride(0), g2.stride(0) if g2 is not None else 0, y.stride(0), float(eps),
            HAS_W=weight is not None, HAS_G=g2 is not None, BD=bd,
            num_warps=4 if bd <= 2048 else 8,
        )  # fmt: skip
    return y.view(x.shape)


@triton.jit
def _glu_kernel(g, u, y, n, beta, beta_l, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(g + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(u + offs, mask=m, other=0.0).to(tl.float32)
    if ACT == 0:
        out = beta * _tanh(a / beta) * tl.sigmoid(a) * (beta_l * _tanh(b / beta_l))
    else:
        out = a * tl.sigmoid(a) * b
    tl.store(y + offs, out.to(y.dtype.element_ty), mask=m)


def glu_triton(
    gate: torch.Tensor, up: torch.Tensor, act: str, beta: float = 4.0, beta_l: float = 25.0
) -> torch.Tensor:
    """SiTU-GLU (``act="situ"``) or SwiGLU (``"silu"``) of same-shape ``gate``, ``up`` ``[..., I]``
    in one launch; result in ``gate.dtype``.

    Raises:
        ValueError: unknown ``act`` or mismatched shapes.
    """
    if act not in ("situ", "silu"):
        raise ValueError(f"act: {act!r} is not 'situ' or 'silu'")
    if gate.shape != up.shape:
        raise ValueError(f"up: shape {tuple(up.shape)} != gate shape {tuple(gate.shape)}")
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty_like(g)
    n = g.numel()
    if n:
        block = 1024
        _glu_kernel[(triton.cdiv(n, block),)](
            g, u, y, n, float(beta), float(beta_l), ACT=0 if act == "situ" else 1, BLOCK=block
        )
    return y


__all__ = ["glu_triton", "rms_norm_triton"]
