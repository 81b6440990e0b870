"""Speculative decoding exactness sweep: greedy output with speculation equals greedy output
without, token for token, for both proposers (n-gram lookup; k3-tiny drafting for k3-tiny)
at every k in ``--ks``, on ``--prompts`` prompts cut from this repository's sources (k3-tiny,
float32, CPU). Prints one line per configuration and writes a JSON summary.

Usage::

    .venv/bin/python scripts/spec_sweep.py --prompts 200 --json spec_sweep.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.spec import SpecConfig
from k3serve.model.checkpoint import load_model
from k3serve.sampling import SamplingParams
from k3serve.tokenizer import get_tokenizer


def prompts_from_repo(tok, n: int, lo: int, hi: int) -> list[list[int]]:
    """``n`` prompts of ``lo``…``hi`` tokens cut from ``k3serve/`` and ``tests/`` sources."""
    files = sorted(p for d in ("k3serve", "tests") for p in (ROOT / d).rglob("*.py")
                   if p.stat().st_size > 1200)
    out = []
    i = 0
    while len(out) < n:
        text = files[i % len(files)].read_text()
        start = (i * 131) % (len(text) - 1000)
        ids = tok.encode(text[start : start + 1000])
        out.append(ids[: lo + (i * 37) % (hi - lo)])
        i += 1
    return out


def generate(engine: LLMEngine, prompts, params) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    done = {}
    while len(done) < len(prompts):
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    return [done[f"s{i}"] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--ks", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--methods", nargs="+", default=["ngram", "draft"])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=50, help="requests per engine at once")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    net, cfg, folder = load_model("k3-tiny")
    tok = get_tokenizer(folder)
    prompts = prompts_from_repo(tok, args.prompts, 16, 120)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def engine(spec):
        c = EngineConfig(num_pages=1024, block_size=16, num_slots=args.batch,
                         num_snapshots=64, speculative=spec)
        return LLMEngine(net, cfg, tok, c)

    def all_outputs(spec):
        eng, outs = engine(spec), []
        for a in range(0, len(prompts), args.batch):
            outs += generate(eng, prompts[a : a + args.batch], params)
        return outs, eng

    t0 = time.time()
    ref, _ = all_outputs(None)
    rows = []
    for method in args.methods:
        for k in args.ks:
            sc = SpecConfig(method, k, ngram_min=2, ngram_max=8, draft_model="k3-tiny",
                            cost_per_token=0.0)
            t = time.time()
            got, eng = all_outputs(sc)
            bad = [i for i, (g, r) in enumerate(zip(got, ref)) if g != r]
            st = eng.spec.stats
            row = {"method": method, "k": k, "prompts": len(prompts), "mismatches": bad,
                   "proposed": st.proposed, "accepted": st.accepted,
                   "acceptance_rate": st.acceptance_rate,
                   "mean_accepted_length": st.mean_accepted_length, "seconds": time.time() - t}
            rows.append(row)
            print(f"{method:5s} k={k}: {len(prompts) - len(bad)}/{len(prompts)} identical, "
                  f"acceptance {st.acceptance_rate:.3f}, tokens/step "
                  f"{st.mean_accepted_length:.2f} ({row['seconds']:.0f} s)", flush=True)
    total_bad = sum(len(r["mismatches"]) for r in rows)
    print(f"sweep: {len(rows)} configurations x {len(prompts)} prompts, {total_bad} mismatches, "
          f"{time.time() - t0:.0f} s")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"results": rows}, indent=1))
    if total_bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
