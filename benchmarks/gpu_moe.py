"""GPU benchmark + full-size check of the latent-MoE fast path (k3-mini MoE layer, one H200).

Paths (the whole MoE layer: router, latent down-projection, routed experts, RMSNorm,
up-projection, shared expert; bf16 activations):
* ``loop``      — per-expert Python loop with a ``.tolist()`` host sync (the reference);
* ``torch-gmm`` — sort by expert + ``torch._grouped_mm`` (``K3SERVE_KERNELS=torch``);
* ``tri-bf16``  — sort + two Triton grouped-GEMM launches, bf16 experts;
* ``tri-mxfp4`` — the same kernels reading MXFP4 experts (dequantised in registers; even/odd
  K split), ``tri-mxfp4-join`` the same with the nibbles re-interleaved in registers;
* ``tri-bf16-nofuse`` — ``tri-bf16`` with the torch RMSNorm / GLU instead of the fused kernels;
* ``routed …`` — the routed experts alone (sort + grouped GEMMs + k-sum), from a CUDA graph;
* ``…+graph``   — the grouped paths replayed from a CUDA graph (they are sync-free; the loop
  cannot be captured).

Tokens T ∈ {1, 64, 256} (decode) and 8192 (prefill). Expert weights are random bf16 values
ROUNDED TO THE MXFP4 GRID (packed, then the dense weights set to the dequantised bytes), so
bf16 and MXFP4 paths multiply the same numbers. Correctness at full size: every path against
a float32 loop (bf16 tolerance), MXFP4 routed output against bf16-expert routed output.

Roofline per row: ``max(bytes / copy_bw, flops / mm_rate)`` with the copy bandwidth and bf16
matmul rate measured in this run. Bytes: the touched experts at their stored size (bf16 2 B,
MXFP4 0.53125 B per parameter), the layer's other weights in bf16, ``x`` in and ``y`` out.
FLOPs: ``2·T·(router + down + up + shared) + 2·T·k·3·W·I``. Timings are medians of
``triton.testing.do_bench`` (25 ms warm-up, 100 ms of repetitions) after one untimed call.

Usage: ``python benchmarks/gpu_moe.py [--out DIR]``; writes ``DIR/gpu_moe.md`` and
``DIR/gpu_moe.json`` (DIR defaults to the current folder). Exits 0 on a machine without CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from k3serve.config import PRESETS
from k3serve.kernels import dispatch
from k3serve.kernels.moe import grouped_triton
from k3serve.kernels.mxfp4 import pack_mxfp4, unpack_mxfp4
from k3serve.model.moe import MoE

FUSED = (dispatch.rms_norm, dispatch.glu)
TOKENS = (1, 64, 256, 8192)
PATHS = ("loop", "torch-gmm", "tri-bf16-nofuse", "tri-bf16", "tri-mxfp4", "tri-mxfp4-join")
MX_BPP = 0.5 + 1 / 32


def log(*a):
    print(*a, flush=True)


def bench(fn, graph=False):
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    if graph:
        return tt.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median")


def ceilings():
    n = 1 << 30
    x = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    bw = 2 * n / (ms * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    return bw, 2 * 8192**3 / (ms * 1e-3)


def build(cfg):
    torch.manual_seed(0)
    m = MoE(cfg, torch.bfloat16).cuda().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.1)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
        for e in m.experts:
            for lin in (e.w1, e.w2, e.w3):
                packed, scales = pack_mxfp4(lin.weight)
                lin.weight.copy_(unpack_mxfp4(packed, scales, torch.bfloat16))
                lin.register_buffer("weight_packed", packed, persistent=False)
                lin.register_buffer("weight_scale", scales, persistent=False)
    m.stacked_experts()
    return m


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".", help="folder for the JSON result and the Markdown table")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to measure")
        return 0
    import triton

    t0 = time.time()
    cfg = dataclasses.replace(PRESETS["k3-mini"], expert_quant="mxfp4")
    d, w_lat, inter = cfg.hidden_size, cfg.moe_latent_size, cfg.moe_intermediate_size
    e_n, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    bw, rate = ceilings()
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
        f"copy_bw={bw / 1e12:.2f} TB/s bf16_mm={rate / 1e12:.0f} TFLOP/s")  # fmt: skip
    m = build(cfg)
    ref32 = MoE(cfg, torch.float32).cuda().eval()
    ref32.load_state_dict({n: p.float() for n, p in m.state_dict().items()})
    ref32.expert_impl = "loop"
    log(f"built in {time.time() - t0:.1f}s")

    other = d * e_n + d * w_lat + w_lat * d + 3 * d * cfg.n_shared_experts * inter + w_lat
    expert_params = 3 * w_lat * inter

    fused = FUSED

    def unfused_norm(x, weight, eps, gate=None):
        os.environ["K3SERVE_KERNELS"] = "torch"
        try:
            return fused[0](x, weight, eps, gate)
        finally:
            os.environ["K3SERVE_KERNELS"] = "triton"

    def unfused_glu(*a):
        os.environ["K3SERVE_KERNELS"] = "torch"
        try:
            return fused[1](*a)
        finally:
            os.environ["K3SERVE_KERNELS"] = "triton"

    def set_path(name):
        os.environ["K3SERVE_KERNELS"] = "torch" if name in ("loop", "torch-gmm") else "triton"
        m.expert_impl = "loop" if name == "loop" else "grouped"
        m.prefer_packed = name.startswith("tri-mxfp4")
        grouped_triton.MX_SPLIT = name != "tri-mxfp4-join"
        nofuse = name.endswith("-nofuse")
        dispatch.rms_norm, dispatch.glu = (unfused_norm, unfused_glu) if nofuse else fused

    rows, checks = [], []
    for t in TOKENS:
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            want = ref32(x.float())
            outs = {}
            for name in PATHS:
                set_path(name)
                outs[name] = m(x)
                checks.append({"T": t, "path": name, "rel_err_vs_fp32_loop": rel(outs[name], want)})
            # routed part alone: MXFP4 bytes vs the same values as bf16 experts
            w, ids = m.gate(x)
            z = m.routed_expert_down_proj(x)
            st = m.stacked_experts()
            os.environ["K3SERVE_KERNELS"] = "triton"
            r_bf = dispatch.routed_experts(z, st.w13, st.w2, ids, w, cfg.hidden_act)
            for split in (True, False):
                grouped_triton.MX_SPLIT = split
                r_mx = dispatch.routed_experts(z, st.w13, st.w2, ids, w, cfg.hidden_act,
                                               packed=st.packed)  # fmt: skip
                checks.append({"T": t, "path": f"routed mxfp4 ({'split' if split else 'join'}) "
                               "vs bf16 experts", "rel_err": rel(r_mx, r_bf),
                               "max_abs": float((r_mx - r_bf).abs().max())})  # fmt: skip
            touched = int(torch.unique(ids).numel())
        # the routed experts alone (sort + 2 Triton launches + k-sum, or torch grouped_mm)
        e_bytes = {"bf16": touched * expert_params * 2, "mx": touched * expert_params * MX_BPP}
        e_flops = 2 * t * k * expert_params
        for name, kw, env, split in (
            ("routed torch-gmm", {}, "torch", True),
            ("routed tri-bf16", {}, "triton", True),
            ("routed tri-mxfp4", {"packed": st.packed}, "triton", True),
            ("routed tri-mxfp4-join", {"packed": st.packed}, "triton", False),
        ):
            os.environ["K3SERVE_KERNELS"] = env
            grouped_triton.MX_SPLIT = split

            def rstep(z=z, ids=ids, w=w, kw=kw, st=st):
                with torch.inference_mode():
                    dispatch.routed_experts(z, st.w13, st.w2, ids, w, cfg.hidden_act, **kw)

            try:
                ms = bench(rstep, graph=True)
            except Exception as exc:  # noqa: BLE001
                log(f"T={t} {name}: {type(exc).__name__}: {exc}")
                continue
            nbytes = e_bytes["mx" if "mxfp4" in name else "bf16"]
            roof = max(nbytes / bw, e_flops / rate) * 1e3
            row = {"T": t, "path": name + "+graph", "ms": ms, "roofline_ms": roof,
                   "x_roofline": ms / roof, "experts_touched": touched, "MB": nbytes / 1e6,
                   "GFLOP": e_flops / 1e9, "TFLOP/s": e_flops / (ms * 1e-3) / 1e12}  # fmt: skip
            rows.append(row)
            log(json.dumps(row))
        flops = 2 * t * other + 2 * t * k * expert_params
        for name in PATHS:
            for graph in (False, True):
                if graph and name == "loop":
                    continue
                set_path(name)

                def step(x=x):
                    with torch.inference_mode():
                        m(x)

                try:
                    ms = bench(step, graph=graph)
                except Exception as exc:  # noqa: BLE001 — a benchmark row, not a crash
                    log(f"T={t} {name} graph={graph}: {type(exc).__name__}: {exc}")
                    continue
                bpp = MX_BPP if name.startswith("tri-mxfp4") else 2.0
                nbytes = touched * expert_params * bpp + other * 2 + 2 * t * d * 2
                roof = max(nbytes / bw, flops / rate) * 1e3
                row = {"T": t, "path": name + ("+graph" if graph else ""), "ms": ms,
                       "roofline_ms": roof, "x_roofline": ms / roof, "experts_touched": touched,
                       "MB": nbytes / 1e6, "GFLOP": flops / 1e9,
                       "TFLOP/s": flops / (ms * 1e-3) / 1e12}  # fmt: skip
                rows.append(row)
                log(json.dumps(row))
    for c in checks:
        log(json.dumps(c))
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "copy_bw_TBps": bw / 1e12, "bf16_mm_TFLOPs": rate / 1e12,
            "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    with open(os.path.join(args.out, "gpu_moe.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "checks": checks}, f, indent=1)
    lines = [
        "# k3-mini MoE layer on one GPU: per-expert loop vs grouped GEMM (bf16 / MXFP4 experts)",
        "",
        (
            f"{meta['date']}, {meta['device']}, torch {meta['torch']}, triton {meta['triton']}; "
            f"ceilings measured in the run: copy {meta['copy_bw_TBps']:.2f} TB/s, bf16 matmul "
            f"{meta['bf16_mm_TFLOPs']:.0f} TFLOP/s. `python benchmarks/gpu_moe.py`. Medians of "
            "`triton.testing.do_bench` after warm-up; `+graph` = `do_bench_cudagraph`."
        ),
        "",
        "| T | path | ms | roofline ms | × roofline | experts touched | MB read | TFLOP/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['T']} | {r['path']} | {r['ms']:.3f} | {r['roofline_ms']:.4f} | "
                     f"{r['x_roofline']:.1f} | {r['experts_touched']} | {r['MB']:.1f} | "
                     f"{r['TFLOP/s']:.1f} |")  # fmt: skip
    lines += ["", "Correctness at full size (max |a − b| / max |b|):", "",
              "| T | path | rel err |", "|---|---|---|"]  # fmt: skip
    for c in checks:
        err = c.get("rel_err_vs_fp32_loop", c.get("rel_err"))
        lines.append(f"| {c['T']} | {c['path']} | {err:.2e} |")
    with open(os.path.join(args.out, "gpu_moe.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    log("\n".join(lines))
    try:
        extra = model_check()
    except Exception as exc:  # noqa: BLE001 — report, keep the layer results
        extra = [f"whole-model check failed: {type(exc).__name__}: {exc}"]
    with open(os.path.join(args.out, "gpu_moe.md"), "a") as f:
        f.write("\n".join(extra) + "\n")
    log("\n".join(extra))
    log(f"total {time.time() - t0:.0f}s")
    return 0


def model_check(b=2, t=512):
    """Whole k3-mini ``forward_train`` (random init, bf16) on ``[b, t]`` tokens: Triton kernels +
    grouped MoE vs the all-torch path with the per-expert loop, both against float32 torch."""
    from k3serve.model.model import K3ForCausalLM

    dispatch.rms_norm, dispatch.glu = FUSED  # undo any ``-nofuse`` patch
    cfg = PRESETS["k3-mini"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg, torch.bfloat16).eval()
    moes = [mod for mod in model.modules() if isinstance(mod, MoE)]
    # the init's router (N(0, 0.02²)) gives near-tied sigmoid scores, so bf16 rounding flips the
    # top-k everywhere and no bf16 path tracks float32 (seen 2026-12-01: 100 % relative error for
    # the torch path as well); spread the scores as a trained router does
    with torch.no_grad():
        for mod in moes:
            mod.gate.weight.normal_(0.0, cfg.hidden_size**-0.5)
    ids = torch.randint(0, cfg.vocab_size, (b, t), device="cuda")

    def run(kernels, impl):
        os.environ["K3SERVE_KERNELS"] = kernels
        for mod in moes:
            mod.expert_impl = impl
        with torch.inference_mode():
            return model.forward_train(ids)

    fast = run("triton", "grouped")
    ref = run("torch", "loop")
    t_fast = bench(lambda: run("triton", "grouped"))
    t_ref = bench(lambda: run("torch", "loop"))
    model.float()
    truth = run("torch", "loop")
    out = [
        "",
        f"Whole k3-mini `forward_train` ({b} × {t} tokens, random init, bf16), logits:",
        "",
        "| path | max abs err vs fp32 torch | rel err | ms |",
        "|---|---|---|---|",
    ]
    for name, y, ms in (("Triton + grouped MoE", fast, t_fast), ("torch + per-expert loop", ref,
                                                                  t_ref)):  # fmt: skip
        out.append(f"| {name} | {float((y - truth).abs().max()):.3e} | {rel(y, truth):.2e} | "
                   f"{ms:.1f} |")  # fmt: skip
    out.append(f"| Triton vs torch (bf16 both) | {float((fast - ref).abs().max()):.3e} | "
               f"{rel(fast, ref):.2e} | |")  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
