"""Speculative decoding: tokens/s and inter-token latency with and without speculation in the
same run, at batch 1 / 8 / 64, on a code-editing and a chat workload; acceptance figures; and
(optionally) the cost of one verify step against a plain decode step.

Workloads (deterministic):

* ``code`` — code editing built from this repository's own sources: the prompt is a file of
  ``k3serve/`` (its first ``--file-tokens`` tokens), an instruction to restate it with a
  change, and the first lines of the restated file (with the change applied), so the answer
  continues restating it — what coding agents do when they quote and edit files;
* ``chat`` — short conversational prompts (``User: … Assistant:``) with no text to copy.

For each workload and batch size ``b``, ``b`` requests (greedy, ``ignore_eos``, ``--max-tokens``
each) run together through one engine without speculation and one with it (same model
weights, same process). Reported per run: generated tokens / wall seconds of the whole batch
(prefill included), the mean inter-token latency of the requests (their decode time divided
by their tokens after the first), and for the speculative run the proposed / accepted tokens,
the acceptance rate, the mean emitted tokens per sequence-step, and whether the outputs equal
the plain run's token for token (greedy: they must).

``--step-model`` (CUDA; e.g. ``k3-mini``, random weights) also times, at batch 1 with
``--context`` cached tokens, one plain decode step (the runner's ``execute``: CUDA graph when
enabled) against one verify step of ``k + 1`` tokens (``verify`` + ``replay`` of all of them;
the verify replays its captured graph when CUDA graphs are on, as in an engine that
speculates), medians over ``--iters``.

Usage::

    .venv/bin/python benchmarks/speculative.py --batch-sizes 1 8 --max-tokens 32 --json out.json
    .venv/bin/python benchmarks/speculative.py --device cuda --dtype bfloat16 \\
        --step-model k3-mini --json spec_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.runner import Row, RunBatch
from k3serve.engine.spec import SpecConfig
from k3serve.model.checkpoint import load_model
from k3serve.sampling import SamplingParams
from k3serve.tokenizer import get_tokenizer

CHAT = [
    "What is the capital of France, and why is it famous?",
    "Explain how a hash table works to a new programmer.",
    "Write a short poem about the sea at night.",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
    "Summarise the plot of a detective story in two sentences.",
    "How do I make a good cup of tea?",
    "What are the pros and cons of working from home?",
]
CHANGES = [("self", "this"), ("return", "yield"), ("def ", "async def "), ("None", "NULL")]


def code_prompts(tok, n: int, file_tokens: int, offset: int = 0) -> list[list[int]]:
    """``n`` code-editing prompts (module docstring) from ``k3serve/*.py``."""
    files = sorted(p for p in (ROOT / "k3serve").rglob("*.py") if p.stat().st_size > 3000)
    out = []
    for i in range(offset, offset + n):
        f = files[(i * 7) % len(files)]
        body = tok.decode(tok.encode(f.read_text())[:file_tokens])
        old, new = CHANGES[i % len(CHANGES)]
        head = "\n".join(body.splitlines()[:3]).replace(old, new)
        text = (f"# file: {f.relative_to(ROOT)}\n{body}\n\n# Task: replace `{old}` with "
                f"`{new}` everywhere and restate the whole file.\n# Updated file:\n{head}\n")
        out.append(tok.encode(text))
    return out


def chat_prompts(tok, n: int, offset: int = 0) -> list[list[int]]:
    return [tok.encode(f"User: {CHAT[i % len(CHAT)]}\nAssistant:" + " " * (offset > 0))
            for i in range(n)]


def run_batch(engine: LLMEngine, prompts, max_tokens: int) -> dict:
    """Run ``prompts`` together; tokens/s, ITL, outputs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    final = {}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    while len(final) < len(prompts):
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.outputs[0].token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
            if o.finished:
                final[o.request_id] = o
    sync()
    wall = time.perf_counter() - t0
    toks = [final[f"b{i}"].outputs[0].token_ids for i in range(len(prompts))]
    itl = [(last[r] - first[r]) / max(1, len(final[r].outputs[0].token_ids) - 1) for r in final]
    return {"tokens": sum(map(len, toks)), "seconds": wall,
            "tokens_per_s": sum(map(len, toks)) / wall, "itl_ms": 1e3 * statistics.mean(itl),
            "outputs": toks}


def make_engine(net, cfg, tok, args, batch: int, spec: SpecConfig | None) -> LLMEngine:
    c = EngineConfig(num_slots=max(batch, 1), max_num_seqs=max(batch, 1),
                     num_pages=args.num_pages, block_size=args.block_size,
                     max_num_batched_tokens=args.max_batched_tokens, num_snapshots=8,
                     cuda_graphs=args.cuda_graphs, speculative=spec)  # fmt: skip
    return LLMEngine(net, cfg, tok, c, device=args.device, dtype=args.torch_dtype)


def measured(ctx, spec: SpecConfig | None) -> tuple[dict, LLMEngine]:
    """One engine: a warm-up batch on other prompts of the same shape (kernels, graphs; no
    cache hits), then the measured batch."""
    net, cfg, tok, args, b, prompts, warm = ctx
    eng = make_engine(net, cfg, tok, args, b, spec)
    run_batch(eng, warm, args.warmup_tokens)
    if eng.spec is not None:
        eng.spec.stats = type(eng.spec.stats)()
    return run_batch(eng, prompts, args.max_tokens), eng


def spec_config(args, method: str) -> SpecConfig:
    return SpecConfig(method, args.k, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                      draft_model=args.draft_model, max_batch_size=args.max_spec_batch,
                      cost_per_token=args.cost_per_token)  # fmt: skip


def step_cost(args) -> dict:
    """Plain decode step vs one verify step of k + 1 tokens at batch 1 (module docstring)."""
    net, cfg, _ = load_model(args.step_model, args.device, args.torch_dtype, random_init=True)
    # speculation on (n-gram, batch 1): the runner captures the (1, k) verify graph that the
    # engine replays, as it does in the throughput runs
    c = EngineConfig(num_slots=2, max_num_seqs=1, num_pages=-(-(args.context + 64) // 64) + 2,
                     block_size=64, max_num_batched_tokens=args.context + 64,
                     num_snapshots=0, cuda_graphs=args.cuda_graphs,
                     speculative=SpecConfig("ngram", args.k, max_batch_size=1))  # fmt: skip
    eng = LLMEngine(net, cfg, None, c, device=args.device, dtype=args.torch_dtype)
    prompt = [(i * 31) % cfg.vocab_size for i in range(args.context)]
    eng.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()  # prefill
    seq = eng.requests["s"].seqs[0]
    sid, slot = seq.seq_id, eng.cm.slot(seq.seq_id)
    eng.cm.allocate(sid, args.k + 1)
    table = eng.cm.block_table(sid)
    n = seq.num_computed
    plain = RunBatch((Row([seq.token_ids[-1]], n, slot, table),))
    verify = RunBatch((Row([seq.token_ids[-1]] + [7] * args.k, n, slot, table),))
    saved = (eng.pools.kda_state[:, slot].clone(), eng.pools.conv_state[:, slot].clone())

    def timed(fn) -> float:
        ts = []
        for i in range(args.iters + 3):
            eng.pools.kda_state[:, slot].copy_(saved[0])
            eng.pools.conv_state[:, slot].copy_(saved[1])
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i >= 3:
                ts.append(time.perf_counter() - t)
        return 1e3 * statistics.median(ts)

    def do_verify():
        _, cap = eng.runner.verify(verify)
        eng.runner.replay(cap, [0], [slot], [0], [args.k + 1])

    p_ms = timed(lambda: eng.runner.execute(plain))
    v_ms = timed(do_verify)
    replays = getattr(eng.runner, "num_verify_replays", 0)
    return {"model": args.step_model, "context": args.context, "k": args.k,
            "decode_step_ms": p_ms, "verify_step_ms": v_ms, "ratio": v_ms / p_ms,
            "verify_replayed": replays > 0}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k3-tiny", help="target model (preset / folder)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) / bfloat16 (CUDA)")
    ap.add_argument("--methods", nargs="+", default=["ngram"], choices=["ngram", "draft"])
    ap.add_argument("--draft-model", default="k3-tiny", help="draft model for --methods draft")
    ap.add_argument("--workloads", nargs="+", default=["code", "chat"], choices=["code", "chat"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=8)
    ap.add_argument("--max-spec-batch", type=int, default=32,
                    help="SpecConfig.max_batch_size (the policy's batch limit)")
    ap.add_argument("--cost-per-token", type=float, default=1 / 64,
                    help="SpecConfig.cost_per_token (the policy's cost model)")
    ap.add_argument("--max-tokens", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--file-tokens", type=int, default=384, help="file tokens in a code prompt")
    ap.add_argument("--warmup-tokens", type=int, default=16,
                    help="tokens per request of the warm-up batch before each measured one")
    ap.add_argument("--num-pages", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    ap.add_argument("--step-model", default=None,
                    help="CUDA: also time a decode step vs a verify step of this model")
    ap.add_argument("--context", type=int, default=2048, help="--step-model cached tokens")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None, help="write the result JSON here")
    args = ap.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    args.torch_dtype = getattr(torch, args.dtype)
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    net, cfg, folder = load_model(args.model, args.device, args.torch_dtype)
    tok = get_tokenizer(folder if folder else "byte")
    rows = []
    for wl in args.workloads:
        for b in args.batch_sizes:
            if wl == "code":
                prompts = code_prompts(tok, b, args.file_tokens)
                warm = code_prompts(tok, b, args.file_tokens, 1000)
            else:
                prompts, warm = chat_prompts(tok, b), chat_prompts(tok, b, 1)
            ctx = (net, cfg, tok, args, b, prompts, warm)

            base, _ = measured(ctx, None)
            for method in args.methods:
                got, eng = measured(ctx, spec_config(args, method))
                st = eng.spec.stats
                row = {
                    "workload": wl, "batch": b, "method": method, "k": args.k,
                    "plain_tokens_per_s": base["tokens_per_s"], "plain_itl_ms": base["itl_ms"],
                    "spec_tokens_per_s": got["tokens_per_s"], "spec_itl_ms": got["itl_ms"],
                    "speedup": got["tokens_per_s"] / base["tokens_per_s"],
                    "proposed": st.proposed, "accepted": st.accepted,
                    "acceptance_rate": st.acceptance_rate,
                    "mean_accepted_length": st.mean_accepted_length,
                    "verify_steps": st.steps, "identical": got["outputs"] == base["outputs"],
                }  # fmt: skip
                rows.append(row)
                print(f"{wl:5s} b={b:3d} {method:5s} k={args.k}: plain "
                      f"{base['tokens_per_s']:8.1f} tok/s ITL {base['itl_ms']:7.2f} ms | spec "
                      f"{got['tokens_per_s']:8.1f} tok/s ITL {got['itl_ms']:7.2f} ms | x"
                      f"{row['speedup']:.2f} acc {st.acceptance_rate:.2f} "
                      f"len {st.mean_accepted_length:.2f} same={row['identical']}", flush=True)
    result = {
        "benchmark": "speculative", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": (torch.cuda.get_device_name() if args.device.startswith("cuda")
                   else platform.processor() or "cpu"),
        "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items() if k != "torch_dtype"},
        "results": rows,
    }  # fmt: skip
    if args.step_model:
        result["step_cost"] = step_cost(args)
        print("step cost:", json.dumps(result["step_cost"]))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
