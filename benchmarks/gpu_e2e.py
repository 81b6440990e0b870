"""k3-mini end to end on one GPU: prefill tokens/s vs the matmul-FLOP roofline, decode step time
vs the bytes-read roofline (with and without CUDA graphs, MXFP4 vs bf16 experts), correctness of
the fast path against the reference, and a calibration JSON for the simulator.

Model: ``k3-mini`` random init in bf16, router weights spread to ``N(0, 1/d)`` and correction
bias ``N(0, 0.1²)`` (the default init's router scores nearly tie, so bf16 rounding alone flips
the top-k and no comparison means anything; a trained router spreads them). Expert weights are
rounded to the MXFP4 grid (packed, dense set to the dequantised bytes) so the bf16 and MXFP4
expert paths multiply the same numbers.

Checks (printed and in the JSON under ``checks``):
* whole forward, ragged prefill (chunks continuing cached prefixes) then 3 ragged decode steps:
  fast path (Triton kernels, grouped MoE, MXFP4 experts) and bf16 reference (torch kernels,
  per-expert loop) both against a float32 reference — relative L2 error of the logits and
  greedy-token agreement;
* MXFP4 experts vs the dequantised-bf16 experts (decode logits);
* CUDA-graph replay vs eager for decode at batch 1 / 64 / 256 (logits and KDA states).

Decode step (``--context`` cached tokens per sequence, default 2048): ``eager`` = the
``ModelRunner.forward`` (host batch build + eager launches), ``graph`` =
``CUDAGraphRunner.execute`` (host prep + one H2D copy + replay + logits copy), ``replay`` = the
graph replay alone; ``--fused 0,1`` times each with ``K3SERVE_FUSED_DECODE`` = 0 (the unfused
kernels) and 1 (the fused decode kernels), rows tagged ``"fused"``, and profiles one replay per
batch (kernel count, GPU time, top 25 kernels: JSON ``replay_profile``). Medians over
``--iters`` steps timed with CUDA events. Bytes-read roofline
of a step: routed experts touched in that step (counted from ``MoE.expert_load``) at their stored
size (MXFP4 0.53125 B/param, bf16 2), every other weight in bf16 (the embedding: B rows), KDA
states read + written (fp32) and conv states read + written, MLA latents read
(``B · context · L_mla · D · 2``); time = bytes / the copy bandwidth measured here (read +
written bytes per second of a device copy).

Prefill (fresh prompts, one forward per batch): ``1 × 2048``, ``1 × 8192``, ``8 × 8192``.
FLOP roofline: ``2 · T · (active params − embedding)`` + causal MLA attention
``L_mla · H · (T_i² ) · (dqk + dv)`` (``2·T_i²/2`` multiply-adds each for scores and values)
+ KDA chunk work ``≈ L_kda · T · H · (4·K·V + 2·64·(K+V))·2``; time = FLOPs / the bf16 matmul
rate measured here (8192³ product).

Calibration JSON (``gpu_e2e.json``), schema 1::

    {"schema": 1, "date": str, "device": str, "torch": str, "triton": str,
     "model": "k3-mini", "dtype": "bfloat16",
     "ceilings": {"copy_bytes_per_s": float, "bf16_flop_per_s": float},
     "prefill": [{"batch": int, "prompt": int, "uncached_tokens": int, "seconds": float,
                  "tokens_per_s": float, "roofline_s": float, "roofline_share": float}],
     "decode": [{"batch": int, "context": int, "experts": "mxfp4" | "bf16",
                 "mode": "eager" | "graph" | "replay", "seconds": float,
                 "roofline_s": float, "roofline_bytes": int, "ratio": float, "fused": "0" | "1"}],
     "fit": {"prefill_seconds_per_token": float, "prefill_seconds_base": float,
             "decode_seconds_per_seq": float, "decode_seconds_base": float,
             "decode_mode": "graph", "decode_experts": "mxfp4"},
     "transfer_bytes_per_s": null,
     "checks": [{"name": str, "rel_err": float, "argmax_agree": float | null}]}

``fit``: least-squares lines ``seconds = base + per_token · uncached_tokens`` over the prefill
rows and ``seconds = base + per_seq · batch`` over the graph / MXFP4 decode rows — what the
simulator reads. ``transfer_bytes_per_s`` is null here (the disaggregated HTTP run is another
benchmark's).

Usage: ``python benchmarks/gpu_e2e.py [--out DIR] [--context 2048] [--iters 20]``; writes
``DIR/gpu_e2e.json`` and ``DIR/gpu_e2e.md`` (tables; DIR defaults to the current folder).
Exits 0 without CUDA.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from k3serve.cache.pools import KVPools
from k3serve.config import PRESETS
from k3serve.engine.cuda_graphs import CUDAGraphRunner
from k3serve.engine.runner import ModelRunner, Row, RunBatch
from k3serve.kernels.mxfp4 import pack_mxfp4, unpack_mxfp4
from k3serve.model.checkpoint import load_model
from k3serve.model.moe import MoE

MX_BPP = 0.5 + 1 / 32
BS = 64


def log(*a):
    print(*a, flush=True)


def ceilings():
    import triton.testing as tt

    n = 1 << 30
    x = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = tt.do_bench(lambda: y.copy_(x), warmup=25, rep=100, return_mode="median")
    bw = 2 * n / (ms * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = tt.do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    return bw, 2 * 8192**3 / (ms * 1e-3)


def build(on_gpu: bool = False):
    """k3-mini as described in the module docstring; ``on_gpu`` draws the init on the GPU
    (seconds instead of minutes; other numbers than the CPU init of the same seed)."""
    cfg = dataclasses.replace(PRESETS["k3-mini"], expert_quant="mxfp4")
    if on_gpu:
        from k3serve.model.model import K3ForCausalLM

        with torch.random.fork_rng(devices=[torch.device("cuda")]), torch.device("cuda"):
            torch.manual_seed(0)
            model = K3ForCausalLM(PRESETS["k3-mini"], dtype=torch.bfloat16)
    else:
        model, _, _ = load_model(PRESETS["k3-mini"], "cuda", torch.bfloat16, seed=0,
                                 random_init=True)
    model.eval()
    g = torch.Generator(device="cuda").manual_seed(1)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    with torch.no_grad():
        for m in moes:
            m.cfg = cfg
            m.gate.weight.normal_(0.0, cfg.hidden_size**-0.5, generator=g)
            m.gate.e_score_correction_bias.normal_(0.0, 0.1, generator=g)
            for name in ("w1", "w2", "w3"):  # one pack per projection per layer (fast)
                lins = [getattr(e, name) for e in m.experts]
                w = torch.stack([lin.weight for lin in lins])
                packed, scales = pack_mxfp4(w.reshape(-1, w.shape[-1]))
                deq = unpack_mxfp4(packed, scales, torch.bfloat16).view_as(w)
                packed = packed.view(w.shape[0], w.shape[1], -1)
                scales = scales.view(w.shape[0], w.shape[1], -1)
                for i, lin in enumerate(lins):
                    lin.weight.copy_(deq[i])
                    lin.register_buffer("weight_packed", packed[i].clone(), persistent=False)
                    lin.register_buffer("weight_scale", scales[i].clone(), persistent=False)
            m.stacked_experts()
    return model, cfg, moes


def set_mode(moes, kernels, impl, packed):
    os.environ["K3SERVE_KERNELS"] = kernels
    for m in moes:
        m.expert_impl, m.prefer_packed = impl, packed


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def new_pools(cfg, slots, pages, dtype):
    p = KVPools(cfg, slots, pages, BS, 0, dtype, "cuda")
    return p


def correctness(model, cfg, moes):
    """Ragged prefill (two chunks) + 3 decode steps: fast / bf16 reference vs fp32 reference."""
    out = []
    lens = [(0, 300), (0, 1000), (0, 77)]  # first chunk
    lens2 = [(300, 129), (1000, 24), (77, 500)]  # continuation chunk over cached prefixes
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, cfg.vocab_size, (a + b,), generator=gen).tolist()
               for a, b in lens2]  # fmt: skip
    pages_per = [-(-(a + b + 8) // BS) for a, b in lens2]
    tables, nxt = [], 0
    for n in pages_per:
        tables.append(list(range(nxt, nxt + n)))
        nxt += n

    def run(net, kernels, impl, packed, dtype):
        set_mode(moes_of(net), kernels, impl, packed)
        pools = new_pools(cfg, 4, nxt + 1, dtype)
        r = ModelRunner(net, pools, "cuda")
        logs = []
        with torch.inference_mode():
            for chunk in (lens, lens2):
                rows = [Row(tuple(prompts[i][c : c + n]), c, i, tuple(tables[i]))
                        for i, (c, n) in enumerate(chunk)]  # fmt: skip
                logs.append(r.forward(rows))
            for step in range(3):  # the same fixed tokens for every path: same inputs
                rows = [Row((7 + 13 * i + step,), a + b + step, i, tuple(tables[i]))
                        for i, (a, b) in enumerate(lens2)]  # fmt: skip
                logs.append(r.forward(rows))
        return logs

    def moes_of(net):
        return [m for m in net.modules() if isinstance(m, MoE)]

    fast = run(model, "triton", "grouped", True, torch.bfloat16)
    fast_bf = run(model, "triton", "grouped", False, torch.bfloat16)
    ref = run(model, "torch", "loop", False, torch.bfloat16)
    f32 = copy.deepcopy(model).float()
    for m in moes_of(f32):
        m.invalidate_stacked()
    truth = run(f32, "torch", "loop", False, torch.float32)
    try:
        f32_fast = run(f32, "triton", "grouped", True, torch.float32)
        f32_fast_bf = run(f32, "triton", "grouped", False, torch.float32)
    except (RuntimeError, ValueError) as e:  # report and go on: the timings do not need it
        log(f"fp32 fast path failed: {type(e).__name__}: {e}")
        f32_fast = f32_fast_bf = truth
    del f32
    torch.cuda.empty_cache()
    names = ["prefill chunk 1", "prefill chunk 2 (cached prefix)", "decode 1", "decode 2",
             "decode 3"]  # fmt: skip
    for i, nm in enumerate(names):
        for label, y in (("fast (Triton, grouped, MXFP4)", fast[i]),
                         ("bf16 reference (torch, loop)", ref[i])):  # fmt: skip
            agree = float((y.argmax(-1) == truth[i].argmax(-1)).float().mean())
            out.append({"name": f"{nm}: {label} vs fp32", "rel_err": rel(y, truth[i]),
                        "argmax_agree": agree})  # fmt: skip
        for label, y in (("fp32 fast (Triton, grouped, MXFP4)", f32_fast[i]),
                         ("fp32 fast (Triton, grouped, bf16-dense experts)", f32_fast_bf[i])):
            agree = float((y.argmax(-1) == truth[i].argmax(-1)).float().mean())
            out.append({"name": f"{nm}: {label} vs fp32 reference", "rel_err": rel(y, truth[i]),
                        "argmax_agree": agree})  # fmt: skip
        out.append({"name": f"{nm}: bf16 fast vs bf16 reference", "rel_err": rel(fast[i], ref[i]),
                    "argmax_agree": float((fast[i].argmax(-1) == ref[i].argmax(-1))
                                          .float().mean())})  # fmt: skip
        out.append({"name": f"{nm}: MXFP4 vs dequantised-bf16 experts (fast path)",
                    "rel_err": rel(fast[i], fast_bf[i]),
                    "argmax_agree": float((fast[i].argmax(-1) == fast_bf[i].argmax(-1))
                                          .float().mean())})  # fmt: skip
    set_mode(moes, "triton", "grouped", True)
    return out


def weight_bytes(model, moes, touched_experts, bpp, batch):
    """Bytes of weights one decode step reads."""
    cfg = model.cfg
    routed = sum(p.numel() for m in moes for p in m.experts.parameters())
    per_expert = 3 * cfg.moe_intermediate_size * (cfg.moe_latent_size or cfg.hidden_size)
    emb = model.model.embed_tokens.weight.numel()
    other = model.num_params() - routed - emb
    return int(touched_experts * per_expert * bpp + other * 2 + batch * cfg.hidden_size * 2)


def state_bytes(cfg, batch, context):
    lk, h, k = cfg.num_kda_layers, cfg.kda_num_heads, cfg.kda_head_dim
    kda = 2 * batch * lk * (h * k * k * 4 + (cfg.kda_conv_kernel - 1) * cfg.kda_conv_dim * 2)
    mla = batch * context * cfg.num_mla_layers * cfg.mla_latent_dim * 2
    return kda, mla


def time_steps(fn, iters):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(ts)


rows_out_prof: list = []


def profile_replay(g, b, sink):
    """Kernels of one graph replay (count, GPU time, the top 25 by time)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    tot = sum(e.device_time for e in ev)
    by: dict = {}
    for e in ev:
        k = by.setdefault(e.name[:70], [0, 0.0])
        k[0] += 1
        k[1] += e.device_time
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:25]
    sink.append({"batch": b, "kernels": len(ev), "gpu_us": tot,
                 "top": [{"name": n, "count": c, "us": t} for n, (c, t) in top]})  # fmt: skip
    log(f"replay B={b}: {len(ev)} kernels, {tot:.0f} us GPU time")
    for n, (c, t) in top:
        log(f"   {t:8.0f} us  {c:5d}×  {n}")


def decode_bench(model, cfg, moes, bw, batches, context, iters, checks, formats=("mxfp4", "bf16")):
    rows_out = []
    bmax = max(batches)
    pages_per = -(-(context + 2) // BS)
    slots, pages = bmax + 1, bmax * pages_per + 1
    pools = new_pools(cfg, slots, pages, torch.bfloat16)
    with torch.no_grad():
        pools.kda_state.normal_(0, 0.05)
        pools.conv_state.normal_(0, 0.5)
        pools.mla_latent.normal_(0, 1.0)
    gen = torch.Generator().manual_seed(5)
    runners = {}
    for experts in formats:
        set_mode(moes, "triton", "grouped", experts == "mxfp4")
        t0 = time.time()
        gr = CUDAGraphRunner(model, pools, "cuda", context + 2, buckets=tuple(batches),
                             scratch_slot=bmax, scratch_page=pages - 1)  # fmt: skip
        gr.capture()
        runners[experts] = gr
        log(f"captured {experts} buckets {batches} in {time.time() - t0:.1f}s")
    for b in batches:
        toks = torch.randint(3, cfg.vocab_size, (b,), generator=gen).tolist()
        rows = tuple(Row((toks[i],), context, i, tuple(range(i * pages_per, (i + 1) * pages_per)))
                     for i in range(b))  # fmt: skip
        for experts in formats:
            set_mode(moes, "triton", "grouped", experts == "mxfp4")
            gr = runners[experts]
            # graph == eager (same pool contents before each; KDA states compared after)
            save = (pools.kda_state.clone(), pools.conv_state.clone())
            with torch.inference_mode():
                eager = gr.forward(list(rows))
                st_e = pools.kda_state[:, :b].clone()
                pools.kda_state.copy_(save[0])
                pools.conv_state.copy_(save[1])
                graph = gr.execute(RunBatch(rows))
                st_g = pools.kda_state[:, :b].clone()
            checks.append({"name": f"decode batch {b} {experts}: graph replay vs eager logits",
                           "rel_err": rel(graph, eager),
                           "argmax_agree": float((graph.argmax(-1) == eager.argmax(-1))
                                                 .float().mean())})  # fmt: skip
            checks.append({"name": f"decode batch {b} {experts}: graph vs eager KDA states",
                           "rel_err": rel(st_g, st_e), "argmax_agree": None})  # fmt: skip
            del save, st_e, st_g
            # experts touched by this step
            for m in moes:
                m.expert_load.zero_()
            with torch.inference_mode():
                gr.forward(list(rows))
            touched = sum(int((m.expert_load > 0).sum()) for m in moes)
            bpp = MX_BPP if experts == "mxfp4" else 2.0
            wb = weight_bytes(model, moes, touched, bpp, b)
            kda_b, mla_b = state_bytes(cfg, b, context)
            total = wb + kda_b + mla_b
            roof = total / bw
            with torch.inference_mode():
                t_eager = time_steps(lambda rows=rows, gr=gr: gr.forward(list(rows)), iters)
                t_graph = time_steps(lambda rows=rows, gr=gr: gr.execute(RunBatch(rows)), iters)
                g = gr.graphs[b]
                t_replay = time_steps(g.replay, iters)
            if experts == "mxfp4":
                profile_replay(g, b, rows_out_prof)
            for mode, t in (("eager", t_eager), ("graph", t_graph), ("replay", t_replay)):
                rows_out.append({"batch": b, "context": context, "experts": experts, "mode": mode,
                                 "seconds": t, "roofline_s": roof, "roofline_bytes": total,
                                 "ratio": t / roof, "touched_experts": touched,
                                 "weight_bytes": wb, "kda_bytes": kda_b, "mla_bytes": mla_b})  # fmt: skip
                log(f"decode B={b:4d} {experts:5s} {mode:6s} {t * 1e3:8.3f} ms  roofline "
                    f"{roof * 1e3:.3f} ms ({total / 1e9:.2f} GB)  ×{t / roof:.2f}")
    del runners, pools
    torch.cuda.empty_cache()
    return rows_out


def prefill_flops(cfg, model, lens):
    emb = model.model.embed_tokens.weight.numel()
    t = sum(lens)
    lin = 2 * t * (cfg.num_active_params - emb)
    dqk, dv, h = cfg.qk_head_dim, cfg.v_head_dim, cfg.mla_num_heads
    attn = cfg.num_mla_layers * h * sum(n * n for n in lens) * (dqk + dv)
    hk, kk = cfg.kda_num_heads, cfg.kda_head_dim
    kda = cfg.num_kda_layers * t * hk * (4 * kk * kk + 2 * 64 * 2 * kk) * 2
    return lin + attn + kda


def prefill_rows(model, cfg, b: int, n: int, device: str = "cuda"):
    """A runner over fresh bf16 pools and ``b`` uncached prompts of ``n`` random tokens (seed 7),
    each in its own slot and pages: ``(runner, rows)``."""
    pages_per = -(-n // BS)
    pools = new_pools(cfg, b + 1, b * pages_per + 1, torch.bfloat16)
    r = ModelRunner(model, pools, device)
    gen = torch.Generator().manual_seed(7)
    rows = [Row(tuple(torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist()), 0, i,
                tuple(range(i * pages_per, (i + 1) * pages_per))) for i in range(b)]  # fmt: skip
    return r, rows


def prefill_bench(model, cfg, mm_rate, shapes, profile_shapes=()):
    out = []
    for b, n in shapes:
        r, rows = prefill_rows(model, cfg, b, n)
        with torch.inference_mode():
            t = time_steps(lambda rows=rows, r=r: r.forward(rows), 3)
            prof = None
            if (b, n) in profile_shapes:  # one forward under torch.profiler: syncs, kernels
                from gpu_prefill_profile import profile_forward

                prof = profile_forward(lambda rows=rows, r=r: r.forward(rows))
                log(f"prefill {b} × {n} profiled: {prof['kernels']} kernels, "
                    f"GPU busy {prof['gpu_union_us'] / 1e3:.1f} ms (union; sum "
                    f"{prof['gpu_busy_us'] / 1e3:.1f}) over {prof['gpu_first_to_last_us'] / 1e3:.1f} ms "
                    f"first-to-last kernel, wall {prof['wall_us'] / 1e3:.1f} ms; syncs {prof['syncs']}")
                for k in prof["top"][:12]:
                    log(f"   {k['us'] / 1e3:7.2f} ms {k['count']:5d}×  {k['name']}")
                log("   by count:")
                for k in prof["top_by_count"][:15]:
                    log(f"   {k['us'] / 1e3:7.2f} ms {k['count']:5d}×  {k['name']}")
        fl = prefill_flops(cfg, model, [n] * b)
        roof = fl / mm_rate
        out.append({"batch": b, "prompt": n, "uncached_tokens": b * n, "seconds": t,
                    "tokens_per_s": b * n / t, "roofline_s": roof, "roofline_share": roof / t,
                    "flops": fl, **({"profile": prof} if prof else {})})  # fmt: skip
        log(f"prefill {b} × {n}: {t:.3f} s, {b * n / t:,.0f} tok/s, roofline {roof:.3f} s "
            f"({fl / 1e12:.1f} TFLOP) → {100 * roof / t:.0f} % of roofline")
        del r
        torch.cuda.empty_cache()
    return out


def fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def write_md(path, res):
    c = res["ceilings"]
    L = [(f"# k3-mini end to end on one GPU ({res['date']}, {res['device']}, "
          f"torch {res['torch']}, triton {res['triton']})"), "",
         (f"Ceilings measured in the run: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 "
          f"matmul {c['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s. Produced by "
          "`python benchmarks/gpu_e2e.py` (method in its docstring)."), "",
         "## Correctness", "", "| check | rel L2 err | argmax agree |", "|---|---|---|"]  # fmt: skip
    for c in res["checks"]:
        a = "" if c["argmax_agree"] is None else f"{c['argmax_agree']:.3f}"
        L.append(f"| {c['name']} | {c['rel_err']:.2e} | {a} |")
    kern = {(p["batch"], p.get("fused", "1")): p["kernels"] for p in res.get("replay_profile", [])}
    L += ["", "## Decode step", "",
          "| batch | experts | fused | mode | ms | roofline ms | GB read | × roofline | kernels |",
          "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for d in res["decode"]:
        nk = kern.get((d["batch"], d.get("fused", "1")), "") if d["experts"] == "mxfp4" else ""
        L.append(f"| {d['batch']} | {d['experts']} | {d.get('fused', '1')} | {d['mode']} | "
                 f"{d['seconds'] * 1e3:.3f} | "
                 f"{d['roofline_s'] * 1e3:.3f} | {d['roofline_bytes'] / 1e9:.2f} | "
                 f"{d['ratio']:.2f} | {nk} |")  # fmt: skip
    L += ["", "## Prefill", "",
          "| batch × prompt | MLA prefill | s | tokens/s | roofline s | share of roofline |",
          "|---|---|---|---|---|---|"]  # fmt: skip
    for p in res["prefill"]:
        L.append(f"| {p['batch']} × {p['prompt']} | {p.get('mla_prefill', 'naive')} | "
                 f"{p['seconds']:.3f} | "
                 f"{p['tokens_per_s']:,.0f} | {p['roofline_s']:.3f} | "
                 f"{100 * p['roofline_share']:.0f} % |")  # fmt: skip
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".", help="folder for the JSON result and the Markdown tables")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--fused", default="1",
                    help="K3SERVE_FUSED_DECODE values to time the decode step with, comma "
                         "separated (0: the unfused kernels, 1: the fused decode kernels)")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--gpu-init", action="store_true",
                    help="draw the random init on the GPU (seconds; other numbers than the CPU "
                         "init of the same seed)")
    ap.add_argument("--prefill-shapes", default="1x2048,1x8192,8x8192",
                    help="batch x prompt, comma separated")
    ap.add_argument("--mla-prefill", default="naive,sdpa",
                    help="MLA prefill implementations to time (K3SERVE_MLA_PREFILL values)")
    ap.add_argument("--prefill-profile", default="",
                    help="batch x prompt shapes to profile once (torch.profiler: host syncs, "
                         "kernel count), comma separated")
    ap.add_argument("--experts", default="mxfp4,bf16", help="expert formats of the decode rows")
    ap.add_argument("--moe-tiles", default="",
                    help="JSON from gpu_moe_tiles.py (moe_tiles_best.json): fills "
                         "grouped_triton.TILE_TABLE before timing")
    a = ap.parse_args()
    if a.moe_tiles:
        from k3serve.kernels.moe import grouped_triton as gt

        with open(a.moe_tiles) as f:
            best = json.load(f)
        for fmt, entries in best.items():
            for bound, *tiles in entries:
                gt.TILE_TABLE[(fmt == "mx", int(bound))] = gt.Tiles(*tiles)
        log(f"TILE_TABLE from {a.moe_tiles}: {gt.TILE_TABLE}")
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to measure")
        return 0
    import triton

    t0 = time.time()
    bw, mm = ceilings()
    log(f"copy {bw / 1e12:.2f} TB/s, bf16 mm {mm / 1e12:.0f} TFLOP/s")
    model, cfg, moes = build(on_gpu=a.gpu_init)
    log(f"built k3-mini ({model.num_params() / 1e9:.2f} B params) in {time.time() - t0:.0f}s")
    checks = [] if a.skip_check else correctness(model, cfg, moes)
    for c in checks:
        log(f"check {c['name']}: rel {c['rel_err']:.2e} argmax {c['argmax_agree']}")
    set_mode(moes, "triton", "grouped", True)
    decode = []
    for fz in ([] if a.skip_decode else a.fused.split(",")):
        os.environ["K3SERVE_FUSED_DECODE"] = fz
        n_checks, n_prof = len(checks), len(rows_out_prof)
        rows = decode_bench(model, cfg, moes, bw, a.batches, a.context, a.iters, checks,
                            tuple(a.experts.split(",")))
        decode += [{**r, "fused": fz} for r in rows]
        for c in checks[n_checks:]:
            c["name"] = f"{c['name']} (fused {fz})"
        for r in rows_out_prof[n_prof:]:
            r["fused"] = fz
        torch.cuda.empty_cache()
    os.environ.pop("K3SERVE_FUSED_DECODE", None)
    for c in checks:
        if c["name"].startswith("decode batch"):
            log(f"check {c['name']}: rel {c['rel_err']:.2e} argmax {c['argmax_agree']}")
    prefill = []
    for impl in ([] if a.skip_prefill else a.mla_prefill.split(",")):
        os.environ["K3SERVE_MLA_PREFILL"] = impl
        try:
            shapes = [tuple(int(v) for v in x.split("x")) for x in a.prefill_shapes.split(",")]
            profs = [tuple(int(v) for v in x.split("x")) for x in a.prefill_profile.split(",") if x]
            rows = prefill_bench(model, cfg, mm, shapes, profs)
        except (RuntimeError, ValueError) as e:  # keep the decode figures if a shape fails
            log(f"prefill ({impl}) failed: {type(e).__name__}: {e}")
            rows = []
        prefill += [{**r, "mla_prefill": impl} for r in rows]
    os.environ.pop("K3SERVE_MLA_PREFILL", None)
    g = [d for d in decode if d["mode"] == "graph" and d["experts"] == "mxfp4"]
    last = a.mla_prefill.split(",")[-1]  # the calibration fit uses the last implementation
    pf = [p for p in prefill if p["mla_prefill"] == last]
    pb, ps = fit([p["uncached_tokens"] for p in pf], [p["seconds"] for p in pf]) \
        if len(pf) > 1 else (0.0, 0.0)  # fmt: skip
    db, ds = fit([d["batch"] for d in g], [d["seconds"] for d in g]) if len(g) > 1 else (0.0, 0.0)
    res = {"schema": 1, "date": datetime.date.today().isoformat(),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "model": "k3-mini", "dtype": "bfloat16",
           "ceilings": {"copy_bytes_per_s": bw, "bf16_flop_per_s": mm},
           "prefill": prefill, "decode": decode,
           "fit": {"prefill_seconds_per_token": ps, "prefill_seconds_base": pb,
                   "decode_seconds_per_seq": ds, "decode_seconds_base": db,
                   "decode_mode": "graph", "decode_experts": "mxfp4"},
           "transfer_bytes_per_s": None, "checks": checks,
           "replay_profile": rows_out_prof}  # fmt: skip
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gpu_e2e.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_md(os.path.join(a.out, "gpu_e2e.md"), res)
    log(f"total {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
