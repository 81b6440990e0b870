"""Issue 11, must-show 1 on the device: the whole k3-mini forward through the fast path (Triton
kernels, grouped MoE, MXFP4 experts; MLA prefill naive and SDPA) equals the plain-torch
reference path within bf16 tolerance — ragged prefill (two chunks, the second continuing cached
prefixes), then ragged decode steps — and MXFP4 experts equal the dequantised-bf16 experts.

How "equal within bf16 tolerance" is made testable at k3-mini scale: at random init the 24-layer
model turns bf16 rounding alone into a ~95 % logit difference when run free (every bf16 path, the
torch reference included, against float32: ``docs/results/gpu_e2e.md``), so a free-running
comparison cannot bound kernel error. Here every sublayer (each layer's mixer — KDA or MLA — and
its FFN — dense or MoE) of the path under test is fed the *reference's* input for that call
(forward pre-hooks, in call order), so each sublayer is compared on identical inputs, its own
cache (KDA state, MLA latents it wrote) included, while the residual stream and the AttnRes mixes
are the path's own sums of its sublayer outputs: errors add up over the 48 sublayers instead of
compounding. A float32 copy of the model, forced the same way, is the exact function: each
sublayer of the fast path must be no further from it than ``2 × (bf16 reference's distance) +
1e-2`` and within 5e-2 of the bf16 reference (relative L2); the logits of every forward within
5e-2 of the reference's. MXFP4 vs dequantised-bf16 experts (the same numbers: the experts are
stored on the MXFP4 grid): every MoE sublayer and the logits within 1e-2. The free-running error
is reported, not asserted.

Run: ``pytest -m gpu tests/gpu`` on a CUDA machine (skipped on CPU; the CPU suite runs the
forcing harness on k3-tiny). ``K3SERVE_GPU_REPORT=PATH``
writes the per-check maxima as JSON.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

BS = 64
CHUNK1 = [(0, 300), (0, 1000), (0, 77)]  # (cached, new) per row: ragged fresh prompts
CHUNK2 = [(300, 129), (1000, 24), (77, 500)]  # continuing the cached prefixes
DECODE_STEPS = 3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class Forcing:
    """Forward hooks on every ``layer.self_attn`` / ``layer.mlp``: record each call's first
    input and output (``inputs=None``) or replace the first input with ``inputs[name][k]`` (the
    k-th call of that sublayer) and record the output."""

    def __init__(self, model, inputs: dict[str, list[torch.Tensor]] | None = None) -> None:
        self.inputs = inputs
        self.seen: dict[str, list[torch.Tensor]] = {}
        self.outs: dict[str, list[torch.Tensor]] = {}
        self.kind: dict[str, str] = {}
        self._h = []
        for layer in model.model.layers:
            for part in ("self_attn", "mlp"):
                mod = getattr(layer, part)
                name = f"{layer.idx}.{part}"
                self.kind[name] = (("mla" if layer.is_mla else "kda") if part == "self_attn"
                                   else type(mod).__name__.lower())  # fmt: skip
                self._h.append(mod.register_forward_pre_hook(self._pre(name)))
                self._h.append(mod.register_forward_hook(self._post(name)))

    def _pre(self, name):
        def hook(mod, args):
            calls = self.seen.setdefault(name, [])
            if self.inputs is None:
                calls.append(args[0].detach().clone())
                return None
            x = self.inputs[name][len(calls)].to(args[0].dtype)
            calls.append(x)
            return (x, *args[1:])

        return hook

    def _post(self, name):
        def hook(mod, args, out):
            self.outs.setdefault(name, []).append(out.detach().clone())

        return hook

    def close(self) -> None:
        for h in self._h:
            h.remove()


@pytest.fixture(scope="module")
def k3mini():
    from benchmarks.gpu_e2e import build

    model, cfg, moes = build(on_gpu=True)  # MXFP4-grid experts, router spread (see there)
    return model, cfg, moes


def _run(net, cfg, monkeypatch, *, kernels, impl, packed, dtype, mla_prefill="naive",
         inputs=None, device="cuda"):  # fmt: skip
    from k3serve.cache.pools import KVPools
    from k3serve.engine.runner import ModelRunner, Row
    from k3serve.model.moe import MoE

    monkeypatch.setenv("K3SERVE_KERNELS", kernels)
    monkeypatch.setenv("K3SERVE_MLA_PREFILL", mla_prefill)
    for m in net.modules():
        if isinstance(m, MoE):
            m.expert_impl, m.prefer_packed = impl, packed
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, cfg.vocab_size, (a + b,), generator=gen).tolist()
               for a, b in CHUNK2]  # fmt: skip
    tables, nxt = [], 0
    for a, b in CHUNK2:
        n = -(-(a + b + DECODE_STEPS + 1) // BS)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    pools = KVPools(cfg, len(CHUNK2) + 1, nxt + 1, BS, 0, dtype, device)
    runner = ModelRunner(net, pools, device)
    f = Forcing(net, inputs)
    logits = []
    try:
        with torch.inference_mode():
            for chunk in (CHUNK1, CHUNK2):
                rows = [Row(tuple(prompts[i][c : c + n]), c, i, tuple(tables[i]))
                        for i, (c, n) in enumerate(chunk)]  # fmt: skip
                logits.append(runner.forward(rows))
            for step in range(DECODE_STEPS):  # fixed tokens: the same inputs on every path
                rows = [Row((7 + 13 * i + step,), a + b + step, i, tuple(tables[i]))
                        for i, (a, b) in enumerate(CHUNK2)]  # fmt: skip
                logits.append(runner.forward(rows))
    finally:
        f.close()
    del pools, runner
    return f, logits


FORWARDS = ["prefill 1", "prefill 2 (cached prefix)"] + [f"decode {i + 1}" for i in range(3)]


def test_forcing_harness_on_cpu(monkeypatch):
    """The harness itself (CPU, k3-tiny): the reference forced with its own recorded inputs
    reproduces its outputs and logits bit for bit; the grouped MoE path forced the same way
    stays within bf16 tolerance of the per-expert loop, sublayer by sublayer."""
    from k3serve.config import PRESETS
    from k3serve.model.model import K3ForCausalLM

    cfg = PRESETS["k3-tiny"]
    torch.manual_seed(0)
    net = K3ForCausalLM(cfg, dtype=torch.bfloat16).eval()
    kw = {"kernels": "torch", "packed": False, "dtype": torch.bfloat16, "device": "cpu"}
    ref, ref_logits = _run(net, cfg, monkeypatch, impl="loop", **kw)
    assert len(ref.seen) == 2 * cfg.num_layers
    again, again_logits = _run(net, cfg, monkeypatch, impl="loop", inputs=ref.seen, **kw)
    for name, outs in ref.outs.items():
        assert len(outs) == len(FORWARDS)
        assert all(torch.equal(a, b) for a, b in zip(outs, again.outs[name])), name
    assert all(torch.equal(a, b) for a, b in zip(ref_logits, again_logits))
    grouped, _ = _run(net, cfg, monkeypatch, impl="grouped", inputs=ref.seen, **kw)
    worst = max(_rel(y, ref.outs[n][k]) for n, outs in grouped.outs.items()
                for k, y in enumerate(outs))  # fmt: skip
    assert worst < 5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (k3-mini)")
def test_fast_path_equals_reference_and_mxfp4_equals_bf16(k3mini, monkeypatch):
    model, cfg, moes = k3mini
    ref, ref_logits = _run(model, cfg, monkeypatch, kernels="torch", impl="loop", packed=False,
                           dtype=torch.bfloat16)  # fmt: skip
    f32 = copy.deepcopy(model).float()
    from k3serve.model.moe import MoE

    for m in f32.modules():
        if isinstance(m, MoE):
            m.invalidate_stacked()
    truth, truth_logits = _run(f32, cfg, monkeypatch, kernels="torch", impl="loop", packed=False,
                               dtype=torch.float32, inputs=ref.seen)  # fmt: skip
    del f32
    torch.cuda.empty_cache()
    for m in moes:
        m.invalidate_stacked()
    paths = {
        "fast mxfp4": {"packed": True},
        "fast bf16 experts": {"packed": False},
        "fast mxfp4 + sdpa prefill": {"packed": True, "mla_prefill": "sdpa"},
    }
    got = {name: _run(model, cfg, monkeypatch, kernels="triton", impl="grouped",
                      dtype=torch.bfloat16, inputs=ref.seen, **kw)
           for name, kw in paths.items()}  # fmt: skip
    _, free = _run(model, cfg, monkeypatch, kernels="triton", impl="grouped", packed=True,
                   dtype=torch.bfloat16)  # fmt: skip

    report: dict = {"sublayers": {}, "logits": {}, "free_running_logits": {}}
    failures: list[str] = []
    for pname, (fp, logits) in got.items():
        worst = {"vs_ref": 0.0, "vs_fp32": 0.0, "ref_vs_fp32": 0.0, "where": ""}
        for name, outs in fp.outs.items():
            for k, y in enumerate(outs):
                r, t = ref.outs[name][k], truth.outs[name][k]
                e_ref, e_t, e_rt = _rel(y, r), _rel(y, t), _rel(r, t)
                if e_ref > worst["vs_ref"]:
                    worst.update(vs_ref=e_ref, vs_fp32=e_t, ref_vs_fp32=e_rt,
                                 where=f"{name} ({fp.kind[name]}) in {FORWARDS[k]}")  # fmt: skip
                if e_ref > 5e-2 or e_t > 2 * e_rt + 1e-2:
                    failures.append(f"{pname}: {name} ({fp.kind[name]}) {FORWARDS[k]}: "
                                    f"vs ref {e_ref:.2e}, vs fp32 {e_t:.2e} "
                                    f"(bf16 ref vs fp32 {e_rt:.2e})")  # fmt: skip
        report["sublayers"][pname] = worst
        report["logits"][pname] = {
            fw: {"vs_ref": _rel(y, r), "ref_vs_fp32": _rel(r, t),
                 "argmax_agree": float((y.argmax(-1) == r.argmax(-1)).float().mean())}
            for fw, y, r, t in zip(FORWARDS, logits, ref_logits, truth_logits)
        }  # fmt: skip
        for fw, v in report["logits"][pname].items():
            if v["vs_ref"] > 5e-2:
                failures.append(f"{pname}: logits of {fw} {v['vs_ref']:.2e} from the reference")
    # MXFP4 vs dequantised-bf16 experts, sublayer by sublayer (MoE) and logits
    mx, bf = got["fast mxfp4"], got["fast bf16 experts"]
    worst_mx = 0.0
    for name, outs in mx[0].outs.items():
        if mx[0].kind[name] != "moe":
            continue
        for k, y in enumerate(outs):
            e = _rel(y, bf[0].outs[name][k])
            worst_mx = max(worst_mx, e)
            if e > 1e-2:
                failures.append(f"MXFP4 vs bf16 experts: {name} {FORWARDS[k]}: {e:.2e}")
    lg = [_rel(a, b) for a, b in zip(mx[1], bf[1])]
    report["mxfp4_vs_bf16"] = {"moe_sublayer_max": worst_mx, "logits_max": max(lg)}
    if max(lg) > 1e-2:
        failures.append(f"MXFP4 vs bf16 experts: logits {max(lg):.2e}")
    report["free_running_logits"] = {fw: _rel(y, r) for fw, y, r in zip(FORWARDS, free,
                                                                         ref_logits)}  # fmt: skip
    report["device"] = torch.cuda.get_device_name()
    report["torch"] = torch.__version__
    out = os.environ.get("K3SERVE_GPU_REPORT")
    if out:
        with open(out, "w") as fh:
            json.dump({**report, "failures": failures}, fh, indent=1)
    print(json.dumps(report, indent=1))
    assert not failures, "\n".join(failures[:20])
