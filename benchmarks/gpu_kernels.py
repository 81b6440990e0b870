"""GPU kernel benchmark: our Triton KDA / MLA kernels vs fla-core vs the roofline.

Rows:
* prefill — chunked KDA forward, B=1, T ∈ {8k, 32k}, H ∈ {12, 16, 32}, and varlen 64 sequences
  × 512 tokens (H 16, 32), K = V = 128, bf16, with an initial state and the final state out. ``ours`` takes a precomputed g; ``ours-k3`` fuses K3's
  bounded gate. fla: ``chunk_kda`` (g given) and its K3 mode (``use_gate_in_kernel``,
  ``safe_gate``, ``lower_bound=-5``).
* decode — one KDA step for N ∈ {64, 256} sequences over a state pool (H=32, K=V=128),
  in place by slots; fla: ``fused_recurrent_kda_fwd`` with ``ssm_state_indices`` (in place).
* mla — absorbed MLA decode, N ∈ {64, 256} × context ∈ {4k, 32k}, 16 heads, D = 512 + 64, pages of 64.

Roofline: ``max(bytes / copy_bw, flops / mm_rate)`` with the copy bandwidth (read + write bytes
of a 2 GiB device copy) and the bf16 matmul rate (8192³) measured here. Bytes are the minimum
each op must move (inputs once, outputs once); decode counts state read + write; MLA counts
latents once per head block. ``bw%`` = bytes / time / copy_bw.

Timing: every implementation, ours and fla's, is warmed up the same way
(``K3SERVE_BENCH_WARMUP`` = 5 untimed calls: JIT compile and fla's autotuning happen there) and
timed ``K3SERVE_BENCH_REP`` = 30 times, each run alone between CUDA events after an L2 flush;
prefill rows alternate ours / fla in two rounds and report the median of all 60 runs of each.

Usage: ``python benchmarks/gpu_kernels.py [--out DIR] [--quick] [--no-fla] [--only decode,mla,prefill]
[--prefill-shapes 32768x12,512x16x64] [--knobs state_warps=8]`` (decode and MLA rows first, then
prefill rows until ``K3SERVE_BENCH_BUDGET_S``, skipping a row whose new head count would cost
fla's autotuning past it; prints one table last; on a machine without CUDA it says so and exits
0). MLA rows time the tuned table's pick (``mla_decode_config``) and neighbours of it. The aims: prefill ≥ 1.0× fla
``chunk_kda`` at every shape (plain, K3 gate, varlen); MLA decode ≥ 0.85 of copy bandwidth at
256×32k and ≥ 0.75 at 64×4k; KDA decode step ≥ 0.9 at 256 sequences.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

T0 = time.time()
BUDGET_S = float(os.environ.get("K3SERVE_BENCH_BUDGET_S", "240"))  # no new prefill rows after this
# seconds a head count new to fla costs (its autotuning; ~90 s when its kernels are not compiled
# yet, less after a prewarm of Triton's disk cache as scripts/gpu/kda_prefill_vs_fla.sh does)
NEW_H_S = float(os.environ.get("K3SERVE_BENCH_NEW_H_S", "120"))


def log(*a):
    print(*a, flush=True)


N_WARMUP = int(os.environ.get("K3SERVE_BENCH_WARMUP", "5"))
N_REP = int(os.environ.get("K3SERVE_BENCH_REP", "30"))
_FLUSH: list = []
REF_CHECK = True  # without fla: prefill rows check ours against the torch chunk_kda instead


def bench(fn, *args, **kwargs) -> float:
    """Median milliseconds of ``fn(*args, **kwargs)`` over ``N_REP`` (≥ 20) timed runs.

    Every implementation (ours and fla's) is treated the same: ``N_WARMUP`` untimed calls first
    (Triton JIT compilation and fla's autotuning happen there), then ``N_REP`` runs, each timed
    alone with CUDA events after a 256 MB L2 flush (as ``triton.testing.do_bench`` does); the
    median of those runs is returned and the sorted runs are kept in ``RUNS``.
    """
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.int8, device="cuda"))
    for _ in range(N_WARMUP):
        fn(*args, **kwargs)
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(N_REP)]  # fmt: skip
    for a, b in ev:
        _FLUSH[0].zero_()
        a.record()
        fn(*args, **kwargs)
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in ev)
    RUNS[:] = ts
    return ts[len(ts) // 2]


RUNS: list = []  # the last bench's timed runs (ms, sorted)


def _median(xs: list) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def ceilings() -> tuple[float, float]:
    n = 1 << 30  # 1 GiB bf16 each way
    x = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = bench(y.copy_, x)
    bw = 2 * n / (ms * 1e-3)
    del x, y
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench(torch.matmul, a, b)
    rate = 2 * 8192**3 / (ms * 1e-3)
    return bw, rate


def kda_prefill_inputs(T, H, K=128, V=128, seed=0):
    g_ = torch.Generator(device="cuda").manual_seed(seed)
    def rn(*s):
        return torch.randn(*s, device="cuda", generator=g_)
    from k3serve.kernels.kda import kda_gate

    q = torch.nn.functional.normalize(rn(1, T, H, K), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(rn(1, T, H, K), dim=-1).bfloat16()
    v = rn(1, T, H, V).bfloat16()
    f = rn(1, T, H, K).bfloat16()
    A_log = 0.3 * rn(H)
    dt_bias = rn(H * K)
    g = kda_gate(f, A_log, dt_bias, -5.0)  # fp32
    beta = torch.rand(1, T, H, device="cuda", generator=g_).bfloat16()
    h0 = rn(1, H, K, V)
    return q, k, v, g, f, A_log, dt_bias, beta, h0


def kda_decode_inputs(N, H=32, K=128, V=128):
    """One KDA decode step's CUDA inputs for ``N`` sequences (seeded by ``N``): q, k
    ``[N, H, K]`` bf16 (L2-normalised), v ``[N, H, V]`` bf16, g ``[N, H, K]`` fp32 (≤ 0),
    beta ``[N, H]`` bf16, a fp32 state pool ``[2N + 7, H, K, V]`` and ``N`` distinct slots;
    plus the bytes the step must move (each state read and written, fp32)."""
    S = 2 * N + 7
    gen = torch.Generator(device="cuda").manual_seed(N)

    def rn(*s):
        return torch.randn(*s, device="cuda", generator=gen)

    q = torch.nn.functional.normalize(rn(N, H, K), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(rn(N, H, K), dim=-1).bfloat16()
    v = rn(N, H, V).bfloat16()
    g = -torch.rand(N, H, K, device="cuda", generator=gen) * 0.1
    beta = torch.rand(N, H, device="cuda", generator=gen).bfloat16()
    pool = rn(S, H, K, V) * 0.1
    slots = torch.randperm(S, device="cuda", generator=gen)[:N]
    return q, k, v, g, beta, pool, slots, 2 * N * H * K * V * 4


def kernel_ms(fn, n: int = 5, top: int = 8, width: int = 48) -> dict:
    """Device milliseconds per call of each CUDA kernel ``fn()`` launches (torch profiler over
    ``n`` calls after one untimed call), the ``top`` largest, names cut to ``width``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        if e.device_type is not None and "cuda" in str(e.device_type).lower() and e.count:
            us = getattr(e, "device_time_total", None)
            us = e.cuda_time_total if us is None else us
            per[e.key[:width]] = round(us / n / 1e3, 4)
    return dict(sorted(per.items(), key=lambda kv: -kv[1])[:top])


def bench_pair(fa, fb, rounds: int = 2) -> tuple[float, float]:
    """Median ms of two callables measured in alternating rounds (A B A B …), each round a
    :func:`bench` (warm-up + ``N_REP`` timed runs): the median of all ``rounds · N_REP`` runs of
    each, so that neither gets a warmer card or cache. ``fb`` None → NaN."""
    ra: list = []
    rb: list = []
    for _ in range(rounds):
        bench(fa)
        ra += RUNS
        if fb is not None:
            bench(fb)
            rb += RUNS
    return _median(ra), _median(rb)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def parse_shapes(spec: str) -> list[tuple[int, int, int]]:
    """``"8192x12,512x16x64"`` → ``[(T, H, N)]`` (N sequences of T tokens; N defaults to 1)."""
    out = []
    for part in spec.split(","):
        f = [int(x) for x in part.strip().split("x")]
        out.append((f[0], f[1], f[2] if len(f) > 2 else 1))
    return out


def prefill_rows(rows, bw, rate, fla, quick, shapes=None):
    from k3serve.kernels.kda.chunk_triton import chunk_kda_triton

    Ts = [8192] if quick else [8192, 32768]
    Hs = [16] if quick else [12, 16, 32]
    if shapes is None:
        shapes = [(T, H, 1) for T in Ts for H in Hs]
        shapes += [(512, H, 64) for H in ([16] if quick else [16, 32])]
    seen_h: set = set()
    for T, H, N in shapes:
        # a head count fla has not seen costs its autotuning (~90 s) on top of the row
        need = 30 if H in seen_h or fla is None else NEW_H_S
        if time.time() - T0 > BUDGET_S - need:
            log(f"prefill T={T} H={H} N={N}: skipped (time budget)")
            continue
        seen_h.add(H)
        K = V = 128
        TT = T * N
        q, k, v, g, f, A_log, dt_bias, beta, h0 = kda_prefill_inputs(TT, H)
        cu = None
        if N > 1:
            cu = torch.arange(0, TT + 1, T, device="cuda", dtype=torch.long)
            h0 = torch.randn(N, H, K, V, device="cuda") * 0.1
        C = 64
        flops = TT * H * (4 * C * K + 2 * C * (K + V) + 6 * K * V + 2 * C * V)
        io = TT * H * (2 * K * 2 + 2 * V * 2 + 2) + 2 * N * H * K * V * 4  # q,k,v,o bf16 + β + states
        b_g = io + TT * H * K * 4  # g in fp32
        b_f = io + TT * H * K * 2  # raw f in bf16 (gate fused)
        roof_g = max(b_g / bw, flops / rate) * 1e3
        roof_f = max(b_f / bw, flops / rate) * 1e3
        kw = {"initial_state": h0, "output_final_state": True, "cu_seqlens": cu}
        k3 = {"A_log": A_log, "dt_bias": dt_bias, "lower_bound": -5.0}
        with torch.inference_mode():
            ours = partial(chunk_kda_triton, q, k, v, g, beta, **kw)
            ours_k3 = partial(chunk_kda_triton, q, k, v, f, beta, **kw, **k3)
            o, _ = ours()
            o3, _ = ours_k3()
            err = err3 = float("nan")
            fla_p = fla_k3 = None
            if fla is None and REF_CHECK:  # no fla: check against the torch chunk_kda (fp32)
                from k3serve.kernels.kda import chunk_kda

                o_ref, _ = chunk_kda(q.float(), k.float(), v.float(), g, beta.float(), **kw)
                err, err3 = _rel(o, o_ref), _rel(o3, o_ref)
                del o_ref
            if fla is not None:
                fla_p = partial(fla.chunk_kda, q, k, v, g, beta, **kw)
                fla_k3 = partial(fla.chunk_kda, q, k, v, f, beta, **kw, use_gate_in_kernel=True,
                                 safe_gate=True, **k3)
                try:
                    err = _rel(o, fla_p()[0])
                    err3 = _rel(o3, fla_k3()[0])
                except Exception as e:  # noqa: BLE001  (report, keep going)
                    log(f"fla prefill T={T} H={H} N={N} failed: {e!r}")
                    fla_p = fla_k3 = None
            t_ours, t_fla = bench_pair(ours, fla_p)
            t_k3, t_fla_k3 = bench_pair(ours_k3, fla_k3)
        shape = f"T={T // 1024}k H={H}" if N == 1 else f"{N}x{T} H={H} (varlen)"
        vs = "err_vs_fla" if fla is not None else "err_vs_torch"
        rows.append(("prefill", shape, "ours", t_ours, t_fla, roof_g, b_g / (t_ours * 1e-3) / bw,
                     f"fla/ours={t_fla / t_ours:.2f} {vs}={err:.1e}"))  # fmt: skip
        rows.append(("prefill", shape, "ours-k3", t_k3, t_fla_k3, roof_f, b_f / (t_k3 * 1e-3) / bw,
                     f"fla/ours={t_fla_k3 / t_k3:.2f} (fla K3 mode) {vs}={err3:.1e}"))  # fmt: skip
        log(rows[-2], rows[-1])
        del ours, ours_k3, fla_p, fla_k3
        torch.cuda.empty_cache()


def decode_rows(rows, bw, fla, quick):
    from k3serve.kernels.kda.recurrent_triton import (
        causal_conv_step_triton,
        fused_recurrent_kda_step_triton,
    )

    H, K, V = 32, 128, 128
    for N in [64, 256]:
        q, k, v, g, beta, pool, slots, nbytes = kda_decode_inputs(N, H, K, V)
        best = None
        for bv, nw, flat in [(64, 4, True), (64, 4, False), (32, 2, True), (128, 4, True), (64, 8, True)]:
            t = bench(fused_recurrent_kda_step_triton, q, k, v, g, beta, pool, slots, block_v=bv,
                      num_warps=nw, flat_grid=flat)  # fmt: skip
            log(f"decode N={N} BV={bv} warps={nw} flat={flat}: {t * 1e3:.1f} us")
            if best is None or t < best[0]:
                best = (t, bv, nw, flat)
        t_fla = float("nan")
        if fla is not None:
            try:
                cu = torch.arange(N + 1, device="cuda", dtype=torch.long)
                t_fla = bench(
                    fla.fused_recurrent_kda_fwd, q[None], k[None], v[None], g[None], beta[None],
                    initial_state=pool, inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=slots)  # fmt: skip
            except Exception as e:  # noqa: BLE001
                log(f"fla decode failed: {e!r}")
        t, bv, nw, flat = best
        rows.append(("decode", f"N={N} H={H}", "ours", t, t_fla, nbytes / bw * 1e3, nbytes / (t * 1e-3) / bw,
                     f"BV={bv} warps={nw} {'flat' if flat else '3-D'} grid fla/ours={t_fla / t:.2f}"))  # fmt: skip
        log(rows[-1])
        # adjacent conv step (channels q|k|v, kernel 4)
        Cc, W = 3 * H * K, 4
        gen = torch.Generator(device="cuda").manual_seed(N + 1)
        x = torch.randn(N, Cc, device="cuda", generator=gen).bfloat16()
        cpool = torch.randn(pool.shape[0], W - 1, Cc, device="cuda", generator=gen).bfloat16()
        wgt = torch.randn(Cc, W, device="cuda", generator=gen).bfloat16()
        t_c = bench(causal_conv_step_triton, x, cpool, wgt, slots)
        cb = N * Cc * 2 * (1 + 1 + 2 * (W - 1))
        rows.append(("conv", f"N={N} C={Cc}", "ours", t_c, float("nan"), cb / bw * 1e3, cb / (t_c * 1e-3) / bw, ""))
        log(rows[-1])


def mla_rows(rows, bw, quick):
    from k3serve.kernels.mla.decode_triton import (
        mla_decode_absorbed_paged_triton,
        mla_decode_config,
    )
    from k3serve.kernels.mla.naive import mla_decode_absorbed_paged

    H, DC, DR, PAGE = 16, 512, 64, 64
    D = DC + DR
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for N in [64, 256]:
        for L in [4096, 32768]:
            if quick and L > 4096:
                continue
            nblk = L // PAGE
            P = N * nblk
            gen = torch.Generator(device="cuda").manual_seed(L + N)
            pool = torch.randn(P, PAGE, D, device="cuda", generator=gen).bfloat16()
            bt = torch.randperm(P, device="cuda", generator=gen).view(N, nblk)
            lens = torch.full((N,), L, device="cuda", dtype=torch.int64)
            lens[0] = L - 37  # a ragged tail
            q = torch.randn(N, H, D, device="cuda", generator=gen).bfloat16()
            nbytes = int(lens.sum()) * D * 2
            ref = mla_decode_absorbed_paged(q[:3].float(), pool, bt[:3], lens[:3], DC, 192**-0.5)
            best = None
            auto = mla_decode_config(N, 1, L, sms)  # the tuned table's pick
            cands = {auto}
            cands |= {(ns, *auto[1:]) for ns in ([2, 3, 4, 5, 6, 8] if N <= 64 else [1, 2, 3])}
            cands |= {(auto[0], 32, 4, 2), (auto[0], 128, 4, 2), (auto[0], 64, 4, 3)}
            for ns, bn, nw, st in sorted(cands):
                args = (q, pool, bt, lens, DC, 192**-0.5)
                kw = {"num_splits": ns, "block_n": bn, "num_warps": nw, "num_stages": st}
                try:
                    out = mla_decode_absorbed_paged_triton(*args, **kw)
                    err = ((out[:3] - ref).abs().max() / ref.abs().max()).item()
                    t = bench(mla_decode_absorbed_paged_triton, *args, **kw)
                except Exception as e:  # noqa: BLE001
                    log(f"mla BN={bn} warps={nw} stages={st} failed: {e!r}")
                    continue
                log(f"mla N={N} L={L} splits={ns} BN={bn} warps={nw} stages={st}: {t * 1e3:.1f} us err={err:.1e}")
                if best is None or t < best[0]:
                    best = (t, ns, bn, nw, st, err)
            t, ns, bn, nw, st, err = best
            rows.append(("mla", f"N={N} L={L // 1024}k", "ours", t, float("nan"), nbytes / bw * 1e3,
                         nbytes / (t * 1e-3) / bw,
                         f"splits={ns} BN={bn} warps={nw} stages={st} (table: {auto}) err={err:.1e}"))  # fmt: skip
            log(rows[-1])
            torch.cuda.empty_cache()


def write_table(head: str, rows: list, out: str | None, final: bool) -> None:
    lines = [head, "", "| op | shape | impl | ms | fla ms | roofline ms | bw frac | notes |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for op, shape, impl, t, tf, roof, frac, note in rows:
        lines.append(f"| {op} | {shape} | {impl} | {t:.3f} | {tf:.3f} | {roof:.3f} | {frac:.2f} | {note} |")
    table = "\n".join(lines)
    if out:
        with open(os.path.join(out, "table.md"), "w") as fh:
            fh.write(table + "\n")
        with open(os.path.join(out, "table.json"), "w") as fh:
            keys = ("op", "shape", "impl", "ms", "fla_ms", "roofline_ms", "bw_frac", "notes")
            json.dump({"head": head, "rows": [dict(zip(keys, r, strict=True)) for r in rows]}, fh, indent=1)
    if final:
        print("\n" + table, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="prefill,decode,mla")
    ap.add_argument("--knobs", default="",
                    help="chunk_triton.KNOBS overrides, e.g. state_bv=64,state_warps=8")
    ap.add_argument("--no-fla", action="store_true",
                    help="time ours only (fla-core's autotuning costs ~90 s per head count)")
    ap.add_argument("--prefill-shapes", default=None,
                    help="prefill rows to run, e.g. 32768x12,512x16x64 (T x H [x N seqs])")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device here; nothing to measure (run it on the H200).")
        return 0
    try:
        if args.no_fla:
            raise ImportError("--no-fla")
        import fla.ops.kda as fla_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        fla_kda.fused_recurrent_kda_fwd = fused_recurrent_kda_fwd
        fla = fla_kda
    except Exception as e:  # noqa: BLE001
        log(f"fla-core not importable: {e!r}")
        fla = None
    import triton

    shapes = parse_shapes(args.prefill_shapes) if args.prefill_shapes else None
    if args.knobs:
        from k3serve.kernels.kda import chunk_triton

        for kv in args.knobs.split(","):
            key, val = kv.split("=")
            if key not in chunk_triton.KNOBS:
                raise SystemExit(f"--knobs: unknown knob {key!r} (known: {sorted(chunk_triton.KNOBS)})")
            chunk_triton.KNOBS[key] = None if val == "None" else int(val)
    bw, rate = ceilings()
    card = torch.cuda.get_device_name()
    fla_v = getattr(sys.modules.get("fla"), "__version__", "–")
    head = (f"card={card} torch={torch.__version__} triton={triton.__version__} fla={fla_v} "
            f"copy_bw={bw / 1e12:.2f} TB/s bf16_mm={rate / 1e12:.0f} TFLOP/s "
            f"K3SERVE_KDA_KNOBS={os.environ.get('K3SERVE_KDA_KNOBS', '')!r}")  # fmt: skip
    log(head)
    rows: list = []
    parts = args.only.split(",")
    try:
        # the cheap parts first; prefill rows stop at the time budget
        for name, fn in (("decode", lambda: decode_rows(rows, bw, fla, args.quick)),
                         ("mla", lambda: mla_rows(rows, bw, args.quick)),
                         ("prefill", lambda: prefill_rows(rows, bw, rate, fla, args.quick, shapes))):  # fmt: skip
            if name in parts:
                try:
                    fn()
                except Exception:  # noqa: BLE001
                    log(traceback.format_exc())
                write_table(head, rows, args.out, final=False)
    finally:
        write_table(head, rows, args.out, final=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
