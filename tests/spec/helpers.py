"""Shared pieces of the speculative-decoding tests: k3-tiny (the trained embedded checkpoint,
float32 on CPU), prompts cut from this repository's sources, engines over one loaded model."""

from __future__ import annotations

import pathlib

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.spec import SpecConfig
from k3serve.sampling import SamplingParams

ROOT = pathlib.Path(__file__).resolve().parents[2]

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
"""The greedy reference's sampling (``greedy20``): 10 tokens, no early stop."""


def repo_prompts(tok, n: int, lo: int = 24, hi: int = 90) -> list[list[int]]:
    """``n`` prompts of ``lo``…``hi`` tokens cut from k3serve's sources (deterministic)."""
    files = sorted((ROOT / "k3serve").rglob("*.py"))
    out = []
    for i, f in enumerate(files):
        text = f.read_text()
        if len(text) < 400:
            continue
        start = (i * 97) % (len(text) - 300)
        ids = tok.encode(text[start : start + 300])
        out.append(ids[: lo + (i * 37) % (hi - lo)])
        if len(out) == n:
            break
    return out


def make_engine(tiny, spec: SpecConfig | None = None, proposer=None, **kw) -> LLMEngine:
    """An engine over the shared k3-tiny model (small pools, block size 16)."""
    net, cfg, tok = tiny
    c = EngineConfig(**{"num_pages": 256, "block_size": 16, "num_slots": 24,
                        "num_snapshots": 32, "speculative": spec, **kw})
    return LLMEngine(net, cfg, tok, c, proposer=proposer)


def run(engine: LLMEngine, prompts, params, step_hook=None) -> list:
    """Add every prompt, step until all finish; ``step_hook(engine)`` after each step.

    Returns:
        The final ``RequestOutput`` per prompt, in order.
    """
    for i, p in enumerate(prompts):
        ps = params[i] if isinstance(params, list) else params
        engine.add_request(f"r{i}", p, ps)
    final = {}
    while len(final) < len(prompts):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if step_hook is not None:
            step_hook(engine)
    return [final[f"r{i}"] for i in range(len(prompts))]
