"""Tuning sweep for the Triton kernels: the numbers behind the tables in the kernels.

Parts (``--only``, comma-separated):

* ``mla`` — absorbed paged MLA decode, the four shapes of ``gpu_kernels.py`` (N ∈ {64, 256} ×
  context ∈ {4k, 32k}, 16 heads, D = 512 + 64, pages of 64): splits × BLOCK_N × num_warps ×
  num_stages. A coarse pass (``K3SERVE_BENCH_REP`` = 10 by default here) ranks every
  configuration; the best 4 of each shape are re-timed with 30 runs. Prints the ``TUNED`` table.
* ``decode`` — the KDA decode step at N ∈ {64, 256}, H 32: BV × warps × grid order × eviction.
* ``prefill`` — our chunked KDA prefill only (no fla: its autotuning is ~90 s per head count):
  a per-kernel profile at the default knobs, then a coordinate sweep of ``chunk_triton.KNOBS``
  (state kernel, output kernel, intra kernel) on T 32k H 12 and varlen 64 × 512 H 16, ranked by
  the sum of the two medians.

Timing is ``gpu_kernels.bench`` (warm-up calls, then runs each alone after an L2 flush,
median). Writes ``sweep.json`` and prints the picks. Usage:
``python benchmarks/gpu_kernels_sweep.py [--out DIR] [--only mla,decode,prefill] [--budget-s 420]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("K3SERVE_BENCH_REP", "10")
os.environ.setdefault("K3SERVE_BENCH_WARMUP", "2")

import gpu_kernels as gk

T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def bench_n(n_rep: int, fn, *a, **kw) -> float:
    old = gk.N_REP, gk.N_WARMUP
    gk.N_REP, gk.N_WARMUP = n_rep, 3
    try:
        return gk.bench(fn, *a, **kw)
    finally:
        gk.N_REP, gk.N_WARMUP = old


def mla_sweep(res: dict, bw: float, deadline: float) -> None:
    from k3serve.kernels.mla.decode_triton import mla_decode_absorbed_paged_triton as mla
    from k3serve.kernels.mla.naive import mla_decode_absorbed_paged

    H, DC, DR, PAGE = 16, 512, 64, 64
    D = DC + DR
    knobs = [(bn, nw, st) for bn in (32, 64, 128) for nw in (4, 8) for st in (2, 3, 4)]
    splits_of = {64: [1, 4, 6, 8, 9, 12, 16, 24, 32, 48, 64], 256: [1, 2, 3, 4, 5, 6, 8, 12, 16]}
    out = res.setdefault("mla", {})
    shapes = [(64, 4096), (256, 32768), (64, 32768), (256, 4096)]  # the two with marks first
    for i, (N, L) in enumerate(shapes):
        if time.time() > deadline:
            log(f"mla N={N} L={L}: skipped (budget)")
            continue
        shape_deadline = time.time() + (deadline - time.time()) / (len(shapes) - i)
        nblk = L // PAGE
        P = N * nblk
        gen = torch.Generator(device="cuda").manual_seed(L + N)
        pool = torch.randn(P, PAGE, D, device="cuda", generator=gen).bfloat16()
        bt = torch.randperm(P, device="cuda", generator=gen).view(N, nblk)
        lens = torch.full((N,), L, device="cuda", dtype=torch.int64)
        lens[0] = L - 37
        q = torch.randn(N, H, D, device="cuda", generator=gen).bfloat16()
        nbytes = int(lens.sum()) * D * 2
        ref = mla_decode_absorbed_paged(q[:3].float(), pool, bt[:3], lens[:3], DC, 192**-0.5)
        args = (q, pool, bt, lens, DC, 192**-0.5)
        rows = []
        for bn, nw, st in knobs:
            if time.time() > shape_deadline:
                log(f"mla N={N} L={L}: knob sweep cut at {(bn, nw, st)} (budget)")
                break
            for ns in splits_of[N]:
                if ns > 1 and triton_cdiv(L, ns) < bn:
                    continue
                kw = {"num_splits": ns, "block_n": bn, "num_warps": nw, "num_stages": st}
                try:
                    o = mla(*args, **kw)
                    err = ((o[:3] - ref).abs().max() / ref.abs().max()).item()
                    t = bench_n(10, mla, *args, **kw)
                except Exception as e:  # noqa: BLE001  (a config that does not compile)
                    log(f"mla N={N} L={L} {kw}: failed {type(e).__name__}: {str(e)[:120]}")
                    break
                rows.append((t, ns, bn, nw, st, err))
        rows.sort()
        log(f"mla N={N} L={L}: coarse top: " + "; ".join(
            f"{t * 1e3:.1f}us s={ns} bn={bn} w={nw} st={st}" for t, ns, bn, nw, st, _ in rows[:6]))
        fine = []
        for t0, ns, bn, nw, st, err in rows[:4]:
            kw = {"num_splits": ns, "block_n": bn, "num_warps": nw, "num_stages": st}
            fine.append((bench_n(30, mla, *args, **kw), ns, bn, nw, st, err))
        fine.sort()
        t, ns, bn, nw, st, err = fine[0]
        frac = nbytes / (t * 1e-3) / bw
        log(f"mla N={N} L={L}: best {t * 1e3:.1f}us splits={ns} BN={bn} warps={nw} stages={st} "
            f"bw={frac:.3f} err={err:.1e}")
        # best per BLOCK_N, for the record
        per_bn = {}
        for r in rows:
            per_bn.setdefault(r[2], r)
        out[f"{N}x{L}"] = {
            "best": {"ms": t, "splits": ns, "block_n": bn, "warps": nw, "stages": st, "bw_frac": frac,
                     "err": err},
            "fine": [list(r) for r in fine],
            "best_per_block_n": {str(k): list(v) for k, v in per_bn.items()},
            "n_configs": len(rows),
        }
        del pool
        torch.cuda.empty_cache()
    log("TUNED = {" + ", ".join(
        f"({k.split('x')[0]}, {k.split('x')[1]}): ({v['best']['splits']}, {v['best']['block_n']}, "
        f"{v['best']['warps']}, {v['best']['stages']})" for k, v in out.items()) + "}")


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_sweep(res: dict, bw: float, deadline: float) -> None:
    from k3serve.kernels.kda.recurrent import fused_recurrent_kda_step
    from k3serve.kernels.kda.recurrent_triton import fused_recurrent_kda_step_triton as step

    H, K, V = 32, 128, 128
    out = res.setdefault("decode", {})
    for N in (64, 256):
        q, k, v, g, beta, pool, slots, nbytes = gk.kda_decode_inputs(N, H, K, V)
        rows = []
        for bv in (16, 32, 64, 128):
            for nw in (1, 2, 4, 8):
                if K * bv / (32 * nw) > 128 or K * bv / (32 * nw) < 8:
                    continue
                for flat in (True, False):
                    for ev in (False, True):
                        if time.time() > deadline:
                            break
                        kw = {"block_v": bv, "num_warps": nw, "flat_grid": flat, "evict_first": ev}
                        p_ref, p_new = pool.clone(), pool.clone()
                        o_ref = fused_recurrent_kda_step(q, k, v, g, beta, p_ref, slots)
                        o = step(q, k, v, g, beta, p_new, slots, **kw)
                        err = max(gk._rel(o, o_ref), gk._rel(p_new, p_ref))
                        t = bench_n(30, step, q, k, v, g, beta, pool, slots, **kw)
                        rows.append((t, bv, nw, flat, ev, err))
        rows.sort()
        for r in rows[:8]:
            log(f"decode N={N}: {r[0] * 1e3:.1f}us BV={r[1]} warps={r[2]} flat={r[3]} evict={r[4]} "
                f"bw={nbytes / (r[0] * 1e-3) / bw:.3f} err={r[5]:.1e}")
        # re-time the best 3 with 60 runs
        fine = sorted((bench_n(60, step, q, k, v, g, beta, pool, slots, block_v=bv, num_warps=nw,
                               flat_grid=fl, evict_first=ev), bv, nw, fl, ev, err)
                      for _, bv, nw, fl, ev, err in rows[:3])  # fmt: skip
        t, bv, nw, fl, ev, err = fine[0]
        log(f"decode N={N}: best {t * 1e3:.1f}us BV={bv} warps={nw} flat={fl} evict={ev} "
            f"bw={nbytes / (t * 1e-3) / bw:.3f}")
        out[str(N)] = {"best": list(fine[0]), "bw_frac": nbytes / (t * 1e-3) / bw, "all": [list(r) for r in rows]}


def prefill_sweep(res: dict, bw: float, deadline: float) -> None:
    from k3serve.kernels.kda import chunk_triton as ct

    out = res.setdefault("prefill", {})
    shapes = [(32768, 12, 1), (512, 16, 64)]
    calls = []
    for T, H, N in shapes:
        TT = T * N
        q, k, v, g, _f, _a, _b, beta, h0 = gk.kda_prefill_inputs(TT, H)
        cu = None
        if N > 1:
            cu = torch.arange(0, TT + 1, T, device="cuda", dtype=torch.long)
            h0 = torch.randn(N, H, 128, 128, device="cuda") * 0.1
        kw = {"initial_state": h0, "output_final_state": True, "cu_seqlens": cu}
        calls.append((f"{N}x{T} H={H}", q, k, v, g, beta, kw))

    def run_all(n_rep=12):
        ts = []
        for name, q, k, v, g, beta, kw in calls:
            with torch.inference_mode():
                ts.append(bench_n(n_rep, ct.chunk_kda_triton, q, k, v, g, beta, **kw))
        return ts

    # reference outputs at the default knobs (to check every variant against)
    base_knobs = dict(ct.KNOBS)
    with torch.inference_mode():
        refs = [ct.chunk_kda_triton(q, k, v, g, beta, **kw) for _, q, k, v, g, beta, kw in calls]
    # per-kernel profile at the default knobs
    prof_out = {}
    for (name, q, k, v, g, beta, kw) in calls:
        with torch.inference_mode():
            prof_out[name] = gk.kernel_ms(
                lambda q=q, k=k, v=v, g=g, beta=beta, kw=kw: ct.chunk_kda_triton(
                    q, k, v, g, beta, **kw), n=5, top=10, width=60)
        log(f"prefill profile {name} (ms per call): " + ", ".join(f"{k}={v:.3f}" for k, v in prof_out[name].items()))
    out["profile_default"] = prof_out
    t_base = run_all(30)
    log(f"prefill default knobs {base_knobs}: " + ", ".join(f"{c[0]}={t:.3f}ms" for c, t in zip(calls, t_base)))
    out["default"] = {"knobs": base_knobs, "ms": t_base}
    groups = [
        ("state", [{"state_bv": bv, "state_warps": nw, "state_stages": st}
                   for bv in (16, 32, 64) for nw in (2, 4, 8) for st in (1, 2, 3)
                   if not (bv == 64 and nw == 2) and not (bv == 16 and nw == 8)]),
        # the output kernel has no loop and the intra kernel only the 16-step substitution:
        # num_stages does not matter there
        ("out", [{"out_bv": bv, "out_warps": nw} for bv in (32, 64, 128) for nw in (4, 8)]),
        ("intra", [{"intra_warps": nw} for nw in (2, 8)]),
    ]  # fmt: skip
    best_knobs = dict(base_knobs)
    best_sum = sum(t_base)
    tried = []
    for gname, variants in groups:
        for var in variants:
            if time.time() > deadline:
                log(f"prefill sweep {gname}: stopped (budget)")
                break
            ct.KNOBS.clear()
            ct.KNOBS.update(best_knobs)
            ct.KNOBS.update(var)
            try:
                with torch.inference_mode():
                    errs = []
                    for (name, q, k, v, g, beta, kw), (o_r, s_r) in zip(calls, refs):
                        o, s = ct.chunk_kda_triton(q, k, v, g, beta, **kw)
                        errs.append(max(gk._rel(o, o_r), gk._rel(s, s_r)))
                ts = run_all()
            except Exception as e:  # noqa: BLE001
                log(f"prefill {var}: failed {type(e).__name__}: {str(e)[:120]}")
                continue
            tried.append((sum(ts), dict(ct.KNOBS), ts, max(errs)))
            log(f"prefill {var}: " + ", ".join(f"{t:.3f}" for t in ts) + f" ms err_vs_default={max(errs):.1e}")
            if sum(ts) < best_sum and max(errs) < 2e-2:
                best_sum, best_knobs = sum(ts), dict(ct.KNOBS)
    ct.KNOBS.clear()
    ct.KNOBS.update(best_knobs)
    t_best = run_all(30)
    log(f"prefill best knobs {best_knobs}: " + ", ".join(f"{c[0]}={t:.3f}ms" for c, t in zip(calls, t_best)))
    out["best"] = {"knobs": best_knobs, "ms": t_best}
    out["tried"] = [[s, kn, ts, e] for s, kn, ts, e in tried]
    ct.KNOBS.clear()
    ct.KNOBS.update(base_knobs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="mla,decode,prefill")
    ap.add_argument("--budget-s", type=float, default=420.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_kernels_sweep: no CUDA device here; nothing to measure.")
        return 0
    bw, rate = gk.ceilings()
    res: dict = {"card": torch.cuda.get_device_name(), "copy_bw": bw, "mm_rate": rate}
    log(f"copy_bw={bw / 1e12:.2f} TB/s bf16_mm={rate / 1e12:.0f} TFLOP/s")
    parts = args.only.split(",")
    share = {"mla": 0.45, "decode": 0.12, "prefill": 0.43}
    t_end = T0 + args.budget_s
    for name, fn in (("mla", mla_sweep), ("decode", decode_sweep), ("prefill", prefill_sweep)):
        if name not in parts:
            continue
        left = t_end - time.time()
        later = sum(share[p] for p in ("mla", "decode", "prefill") if p in parts and
                    list(share).index(p) > list(share).index(name))  # fmt: skip
        deadline = time.time() + left * share[name] / (share[name] + later)
        try:
            fn(res, bw, deadline)
        except Exception:  # noqa: BLE001
            import traceback

            log(traceback.format_exc())
        if args.out:
            with open(os.path.join(args.out, "sweep.json"), "w") as fh:
                json.dump(res, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
