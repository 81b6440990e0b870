"""Where k3-mini prefill time goes on one GPU, and what the prefill kernels change.

For each variant (``base``: the torch references for the KDA conv and AttnRes mix and the
two-launch Triton MoE at every size; ``fused``: this tree's prefill path —
``k3serve/kernels/prefill_triton.py`` conv + AttnRes kernels and ``routed_experts_large_m``
from ``LARGE_M_ROWS_PER_EXPERT`` rows per expert) and each ``batch × prompt``:

* wall time of one prefill forward (``ModelRunner.forward``, fresh prompts; median of 3 after
  a warm-up), against the matmul-FLOP roofline of ``benchmarks/gpu_e2e.py``;
* GPU time per sublayer part (CUDA events around labelled calls: KDA mixer / conv / l2norm /
  gate / chunk kernel, MLA mixer / attention, MoE router / routed experts, MLPs, AttnRes mixes,
  every ``nn.Linear``), from one extra forward;
* one forward under ``torch.profiler``: kernels grouped by name (count, GPU µs), GPU busy share
  of the wall time, and the host syncs (``cudaStreamSynchronize`` / ``aten::_local_scalar_dense``
  / ``aten::item``) with their labels.

Micro-benchmarks (``triton.testing.do_bench`` medians): routed experts of one k3-mini MoE layer
at 4k / 16k / 64k assignments — Triton MXFP4, Triton bf16, ``routed_experts_large_m``; MLA
prefill attention ``[1, 16, 8192, 192 | 128]`` through each SDPA backend.

Usage: ``python benchmarks/gpu_prefill_profile.py --out DIR [--shapes 1x8192,8x8192]``;
writes ``prefill_profile.json``. Exits 0 without CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def log(*a):
    print(*a, flush=True)


class Labels:
    """CUDA events around labelled calls (nested labels form a path)."""

    def __init__(self):
        self.stack: list[str] = []
        self.marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.on = False

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def inner(*a, **k):
            if not self.on:
                with torch.profiler.record_function(name):
                    return fn(*a, **k)
            self.stack.append(name)
            path = "/".join(self.stack)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            try:
                with torch.profiler.record_function(name):
                    return fn(*a, **k)
            finally:
                e1.record()
                self.marks.append((path, e0, e1))
                self.stack.pop()

        return inner

    def table(self):
        torch.cuda.synchronize()
        by = defaultdict(lambda: [0, 0.0])
        for path, e0, e1 in self.marks:
            by[path][0] += 1
            by[path][1] += e0.elapsed_time(e1) * 1e3
        self.marks.clear()
        return {p: {"calls": c, "us": us} for p, (c, us) in sorted(by.items(), key=lambda x: -x[1][1])}


LABEL_NAMES = ("kda", "mla", "moe", "router", "mlp", "rmsnorm", "gated_norm", "linear", "conv",
               "l2norm", "gate", "chunk_kda", "routed_experts", "mla_prefill_paged",
               "attn_res_mix_prefill", "attn_res_mix", "forward")  # fmt: skip
"""The labels (also GPU-side annotation ranges in the profiler's CUDA events: not kernels)."""


def install_labels(lab: Labels):
    from torch import nn

    from k3serve.kernels import dispatch
    from k3serve.model import kda, layers, mla, model, moe

    kda.KDAMixer.forward = lab.wrap("kda", kda.KDAMixer.forward)
    mla.MLAMixer.forward = lab.wrap("mla", mla.MLAMixer.forward)
    moe.MoE.forward = lab.wrap("moe", moe.MoE.forward)
    moe.Router.forward = lab.wrap("router", moe.Router.forward)
    layers.MLP.forward = lab.wrap("mlp", layers.MLP.forward)
    layers.RMSNorm.forward = lab.wrap("rmsnorm", layers.RMSNorm.forward)
    layers.GatedRMSNorm.forward = lab.wrap("gated_norm", layers.GatedRMSNorm.forward)
    nn.Linear.forward = lab.wrap("linear", nn.Linear.forward)
    dispatch.conv_varlen = lab.wrap("conv", dispatch.conv_varlen)
    kda.l2norm = lab.wrap("l2norm", kda.l2norm)
    kda.kda_gate = lab.wrap("gate", kda.kda_gate)
    for name in ("chunk_kda", "routed_experts", "mla_prefill_paged", "attn_res_mix_prefill"):
        setattr(dispatch, name, lab.wrap(name, getattr(dispatch, name)))
    model._attn_res_mix = lab.wrap("attn_res_mix", model._attn_res_mix)
    model.K3ForCausalLM.forward = lab.wrap("forward", model.K3ForCausalLM.forward)


def set_variant(name, saved):
    """``base``: references for conv / AttnRes, no large-M MoE path; ``fused``: this tree."""
    from k3serve.kernels import dispatch
    from k3serve.kernels.moe import grouped_triton as gt
    from k3serve.model import model

    if not saved:
        saved.update(conv=dispatch.conv_varlen, mix=dispatch.attn_res_mix_prefill,
                     lm=gt.LARGE_M_ROWS_PER_EXPERT)  # fmt: skip
    if name == "base":
        dispatch.conv_varlen = lambda *a, **k: None
        dispatch.attn_res_mix_prefill = model._attn_res_mix  # the (labelled) reference
        gt.LARGE_M_ROWS_PER_EXPERT = 1 << 62
    else:
        dispatch.conv_varlen = saved["conv"]
        dispatch.attn_res_mix_prefill = saved["mix"]
        gt.LARGE_M_ROWS_PER_EXPERT = saved["lm"]


def profile_forward(fn):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ev = prof.events()
    names = set(LABEL_NAMES)
    kern = [e for e in ev if e.device_type.name == "CUDA" and e.name not in names]
    busy = sum(e.device_time for e in kern)
    by = defaultdict(lambda: [0, 0.0])
    for e in kern:
        by[e.name[:90]][0] += 1
        by[e.name[:90]][1] += e.device_time
    syncs = defaultdict(int)
    for e in ev:
        if e.device_type.name != "CPU":
            continue
        if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense",
                      "aten::item", "cudaMemcpyAsync"):  # fmt: skip
            par, path = e.cpu_parent, []
            while par is not None:
                if not par.name.startswith(("aten::", "cuda")):
                    path.append(par.name)
                par = par.cpu_parent
            syncs[f"{e.name} <- {'/'.join(reversed(path[:3]))}"] += 1
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:25]
    top_n = sorted(by.items(), key=lambda kv: -kv[1][0])[:25]
    # GPU busy as the union of the kernels' intervals (the sum above double-counts overlaps)
    spans = sorted((e.time_range.start, e.time_range.end) for e in kern)
    union, cur = 0.0, None
    for a, b in spans:
        if cur is None or a > cur[1]:
            if cur is not None:
                union += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    if cur is not None:
        union += cur[1] - cur[0]
    first_last = (spans[-1][1] - spans[0][0]) if spans else 0.0
    return {"wall_us": wall * 1e6, "gpu_busy_us": busy, "gpu_union_us": union,
            "gpu_first_to_last_us": first_last, "kernels": len(kern),
            "top": [{"name": n, "count": c, "us": t} for n, (c, t) in top],
            "top_by_count": [{"name": n, "count": c, "us": t} for n, (c, t) in top_n],
            "syncs": dict(sorted(syncs.items(), key=lambda kv: -kv[1]))}  # fmt: skip


def moe_bench(model, cfg, out):
    import triton.testing as tt

    from k3serve.kernels.moe.grouped_triton import (
        TritonExperts,
        routed_experts_large_m,
        routed_experts_triton,
    )
    from k3serve.model.moe import MoE

    m = next(x for x in model.modules() if isinstance(x, MoE))
    st = m.stacked_experts()
    w13, w2 = st.w13, st.w2
    mx = TritonExperts(st.packed[0], st.packed[2], st.packed[1], st.packed[3])
    bf = TritonExperts(w13, w2)
    k = cfg.num_experts_per_tok
    flop_per_assign = 2 * 3 * w2.shape[1] * w2.shape[2]
    g = torch.Generator(device="cuda").manual_seed(11)
    for t in (512, 2048, 8192):
        z = torch.randn(t, w13.shape[2], device="cuda", dtype=torch.bfloat16, generator=g)
        with torch.no_grad():
            tw, ids = m.gate(torch.randn(t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16,
                                         generator=g))  # fmt: skip
        ref = routed_experts_triton(z.float(), TritonExperts(w13.float(), w2.float()), ids, tw,
                                    "situ")  # fmt: skip
        a_ = (z, ids, tw)
        for name, fn in (
            ("triton_mxfp4", lambda a_=a_: routed_experts_triton(a_[0], mx, a_[1], a_[2], "situ")),
            ("triton_bf16", lambda a_=a_: routed_experts_triton(a_[0], bf, a_[1], a_[2], "situ")),
            ("grouped_mm", lambda a_=a_: routed_experts_large_m(a_[0], w13, w2, a_[1], a_[2],
                                                                "situ")),
        ):  # fmt: skip
            try:
                err = float((fn() - ref).norm() / ref.norm())
                ms = tt.do_bench(fn, warmup=10, rep=40, return_mode="median")
            except Exception as e:  # noqa: BLE001 — report and go on
                log(f"moe {name} T={t}: {type(e).__name__}: {e}")
                continue
            tf = t * k * flop_per_assign / (ms * 1e-3) / 1e12
            out.append({"tokens": t, "assignments": t * k, "impl": name, "ms": ms,
                        "tflops": tf, "rel_err_vs_fp32": err})  # fmt: skip
            log(f"moe T={t:5d} (M={t * k:6d}) {name:13s} {ms:8.3f} ms {tf:6.0f} TFLOP/s "
                f"rel {err:.1e}")


def sdpa_bench(out):
    import torch.nn.functional as F
    import triton.testing as tt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h, t = 16, 8192
    g = torch.Generator(device="cuda").manual_seed(12)
    q = torch.randn(1, h, t, 192, device="cuda", dtype=torch.bfloat16, generator=g)
    kk = torch.randn(1, h, t, 192, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, h, t, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    vpad = F.pad(v, (0, 64))
    flops = 2 * h * t * t * (192 + 128) / 2
    ref = F.scaled_dot_product_attention(q, kk, v, is_causal=True)
    cases = [("default", None, v), ("efficient", SDPBackend.EFFICIENT_ATTENTION, v),
             ("cudnn", SDPBackend.CUDNN_ATTENTION, v), ("flash_vpad192", SDPBackend.FLASH_ATTENTION,
                                                         vpad)]  # fmt: skip
    for name, be, vv in cases:

        def fn(vv=vv, be=be):  # a fresh context per call (sdpa_kernel is a one-shot generator)
            with sdpa_kernel([be]) if be is not None else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)

        try:
            o = fn()[..., :128]
            err = float((o.float() - ref.float()).norm() / ref.float().norm())
            ms = tt.do_bench(fn, warmup=5, rep=30, return_mode="median")
        except Exception as e:  # noqa: BLE001
            log(f"sdpa {name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        out.append({"impl": name, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "rel_vs_default": err})
        log(f"sdpa {name:14s} {ms:7.3f} ms {flops / (ms * 1e-3) / 1e12:5.0f} TFLOP/s rel {err:.1e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", default="1x8192,8x8192")
    ap.add_argument("--variants", default="base,fused")
    ap.add_argument("--big-variants", default="fused",
                    help="variants timed for shapes over 16k tokens")
    ap.add_argument("--profile-shapes", default="1x8192", help="shapes profiled in detail")
    ap.add_argument("--skip-micro", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to measure")
        return 0
    from gpu_e2e import build, prefill_flops, prefill_rows, time_steps

    t0 = time.time()
    import triton.testing as tt

    a8 = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = 2 * 8192**3 / (tt.do_bench(lambda x=a8: x @ x, warmup=25, rep=100,
                                    return_mode="median") * 1e-3)  # fmt: skip
    a8 = None
    model, cfg, _ = build(on_gpu=True)
    log(f"bf16 mm {mm / 1e12:.0f} TFLOP/s; built k3-mini in {time.time() - t0:.0f}s")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "bf16_flop_per_s": mm, "prefill": [], "moe": [], "sdpa": []}  # fmt: skip
    lab = Labels()
    install_labels(lab)
    saved: dict = {}
    shapes = [tuple(int(v) for v in x.split("x")) for x in a.shapes.split(",")]
    prof_shapes = {tuple(int(v) for v in x.split("x")) for x in a.profile_shapes.split(",") if x}
    outp = os.path.join(a.out, "prefill_profile.json")
    for b, n in shapes:
        r, rows = prefill_rows(model, cfg, b, n)
        fl = prefill_flops(cfg, model, [n] * b)
        outs = {}
        big = b * n > 16384
        for var in (a.big_variants if big else a.variants).split(","):
            set_variant(var, saved)
            with torch.inference_mode():
                t = time_steps(lambda r=r, rows=rows: r.forward(rows), 3)
                outs[var] = r.forward(rows)
                row = {"variant": var, "batch": b, "prompt": n, "seconds": t,
                       "roofline_s": fl / mm, "roofline_share": fl / mm / t}  # fmt: skip
                lab.on = True
                r.forward(rows)
                lab.on = False
                row["labels"] = lab.table()
                if (b, n) in prof_shapes:
                    row["profile"] = profile_forward(lambda r=r, rows=rows: r.forward(rows))
            res["prefill"].append(row)
            log(f"prefill {var:5s} {b} × {n}: {t:.3f} s = {100 * fl / mm / t:.1f} % of roofline "
                f"({fl / mm:.3f} s)")
            for p, d in list(row["labels"].items())[:28]:
                log(f"    {d['us'] / 1e3:9.2f} ms {d['calls']:5d}×  {p}")
            if "profile" in row:
                pr = row["profile"]
                log(f"  profile: wall {pr['wall_us'] / 1e3:.1f} ms, GPU busy "
                    f"{pr['gpu_busy_us'] / 1e3:.1f} ms, {pr['kernels']} kernels; syncs {pr['syncs']}")
                for k_ in pr["top"][:18]:
                    log(f"    {k_['us'] / 1e3:9.2f} ms {k_['count']:5d}×  {k_['name']}")
            with open(outp, "w") as f:
                json.dump(res, f, indent=1)
        if len(outs) > 1:
            vs = list(outs.values())
            rel = float((vs[1] - vs[0]).norm() / vs[0].norm())
            agree = float((vs[1].argmax(-1) == vs[0].argmax(-1)).float().mean())
            res.setdefault("variant_logits", []).append({"batch": b, "prompt": n, "rel": rel,
                                                         "argmax_agree": agree})  # fmt: skip
            log(f"  logits fused vs base: rel {rel:.2e}, argmax agree {agree:.2f}")
        r = None
        torch.cuda.empty_cache()
    set_variant("fused", saved)
    if not a.skip_micro:
        with torch.inference_mode():
            moe_bench(model, cfg, res["moe"])
            sdpa_bench(res["sdpa"])
    with open(outp, "w") as f:
        json.dump(res, f, indent=1)
    log(f"total {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
